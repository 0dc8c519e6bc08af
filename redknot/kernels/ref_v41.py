"""Reference (plain PyTorch) V4.1 ops that read and write the shipped storage formats.

Weights stay FP8 (E8M0 per b×b tile) or MXFP4 (E8M0 per 32) and caches stay uint8 rows
(:mod:`redknot.kernels.mx_formats`); these references decode them exactly and compute in fp32, so a
fast backend is checked against the mathematics, not against another rounding order. Contracts
(shapes, dtypes, byte formats) are in ``V41_OPS.md`` next to this file.

==================  ===============================================================================
act_quant_mx        x [M, K] -> (e4m3 [M, K], E8M0 bytes [M, K/32])
linear_mx           per-32 FP8 activation quantisation, then x · dequant(W)ᵀ with W FP8 + E8M0 tiles
moe_mx              routed experts from MXFP4 weights, FP8 activations in front of every GEMM
cache_insert_mx     quantise rows into a window / compressed / index-key byte cache at given slots
sparse_attention_mx softmax with sink over gathered window rows (FP8) + compressed entries (FP4)
indexer_topk_mx     Σ_h w·relu(q·k) over FP4 index keys (optionally inside candidate blocks), top-k
indexer_candidates_mx  block-max scores, newest block pinned, top candidate blocks (layer 20)
indexer_source_mx   both of the above from one scoring pass (the candidate source layer)
engram_gather_mx    rows of an FP8 table with per-row E8M0 scales (table on the device or pinned host)
==================  ===============================================================================
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from redknot.kernels import mx_formats as mx
from redknot.kernels.registry import register

CACHE_FORMATS = {
    "window": (mx.pack_window_rows, mx.unpack_window_rows),
    "compressed": (mx.pack_compressed_entries, mx.unpack_compressed_entries),
    "index": (mx.pack_index_keys, mx.unpack_index_keys),
}


def _acc(x: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: an fp64 model (the exact tests) keeps fp64 through the routed ops.
    fp32 GEMMs on a GPU pick kernels by shape, so a step of several sequences would round otherwise
    than the same sequences one at a time."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_fmt(fmt: str) -> None:
    if fmt not in CACHE_FORMATS:
        raise ValueError(f"fmt={fmt!r}: must be one of {sorted(CACHE_FORMATS)}")


@register("act_quant_mx")
def act_quant_mx(x: torch.Tensor, group: int = mx.MX_GROUP) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], E8M0 bytes [M, K/group]) with the §3.0 scale rule."""
    return mx.quant_fp8_groups(x, group)


@register("linear_mx")
def linear_mx(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = mx.V41_WEIGHT_BLOCK,
              act_group: int = mx.MX_GROUP) -> torch.Tensor:
    """x [..., K] · Wᵀ -> [..., N] in x.dtype: x quantised to FP8 per ``act_group`` (E8M0), W e4m3
    [N, K] with E8M0 ``weight_scale`` [ceil(N/b), ceil(K/b)], b = ``block`` (V4.1 32, V4 128)."""
    a = mx.act_quant_ref(x.float(), "fp8", act_group)
    w = mx.dequant_fp8_blocks(weight, weight_scale, block)
    return (a @ w.T).to(x.dtype)


def _expert_gemm(a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 rows -> FP8 QDQ per 32 -> times a dequantised MXFP4 matrix [N, K] -> bf16 (the REF linear)."""
    return (mx.act_quant_ref(a.float(), "fp8") @ mx.dequant_mxfp4(packed, scale).T).to(torch.bfloat16)


@register("moe_mx")
def moe_mx(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
           w1_scale: torch.Tensor, w3: torch.Tensor, w3_scale: torch.Tensor, w2: torch.Tensor,
           w2_scale: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """Σ_j over each token's k experts e = topk_idx[t, j] of W2_e · bf16(w_tj · silu(g)·u), with
    g = min(bf16(W1_e x), L), u = clamp(bf16(W3_e x), ±L), every GEMM input FP8-quantised per 32 (§3.7).

    x [T, D] bf16; topk_idx [T, k]; topk_weight [T, k] fp32; w1/w3 packed MXFP4 [E, I, D/2] with E8M0
    [E, I, D/32]; w2 [E, D, I/2] with [E, D, I/32]. Slots are summed in fp32 in order j = 0..k-1."""
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    slots = torch.zeros(t * k, w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(flat).tolist():
        rows = (flat == e).nonzero().squeeze(1)
        h = x[rows // k]
        g = _expert_gemm(h, w1[e], w1_scale[e]).float().clamp(max=swiglu_limit)
        u = _expert_gemm(h, w3[e], w3_scale[e]).float().clamp(-swiglu_limit, swiglu_limit)
        act = (F.silu(g) * u * topk_weight.reshape(-1)[rows, None].float()).to(torch.bfloat16)
        slots[rows] = _expert_gemm(act, w2[e], w2_scale[e]).float()
    return slots.view(t, k, -1).sum(1).to(x.dtype)


@register("cache_insert_mx")
def cache_insert_mx(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise rows x [T, D] into the uint8 ``cache`` [num_slots, row_bytes] at ``slots`` [T] (int,
    -1 = skip) in the ``fmt`` row format ("window", "compressed", "index"); returns ``cache``."""
    _check_fmt(fmt)
    keep = slots >= 0
    cache[slots[keep].long()] = CACHE_FORMATS[fmt][0](x[keep])
    return cache


def _gather_rows(cache: torch.Tensor, idx: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 rows cache[idx] (idx -1 -> zeros)."""
    return CACHE_FORMATS[fmt][1](cache[idx.clamp(min=0).long()])


@register("sparse_attention_mx")
def sparse_attention_mx(q: torch.Tensor, window_cache: torch.Tensor, window_idx: torch.Tensor,
                        sinks: torch.Tensor, scale: float, comp_cache: Optional[torch.Tensor] = None,
                        comp_idx: Optional[torch.Tensor] = None, q_tile: int = 128) -> torch.Tensor:
    """o[t, h] = Σ_j e^{z_j} KV_j / (Σ_j e^{z_j} + e^{sink_h}), z_j = scale · q[t, h] · KV_j, over the
    window rows window_cache[window_idx[t]] and compressed entries comp_cache[comp_idx[t]] (-1 = none;
    K = V). q [T, H, D]; window_cache uint8 [Nw, D + D/32]; comp_cache uint8 [Nc, D/2 + D/16];
    sinks [H] fp32. A row with no valid index returns 0. fp32 math (fp64 for an fp64 q), q.dtype out."""
    out = torch.empty_like(q)
    acc = _acc(q)
    sink = sinks.to(acc).view(1, -1, 1)
    for t0 in range(0, q.shape[0], q_tile):
        rows = slice(t0, t0 + q_tile)
        keys = [_gather_rows(window_cache, window_idx[rows], "window")]
        valid = [window_idx[rows] >= 0]
        if comp_idx is not None:
            keys.append(_gather_rows(comp_cache, comp_idx[rows], "compressed"))
            valid.append(comp_idx[rows] >= 0)
        kv, ok = torch.cat(keys, 1).to(acc), torch.cat(valid, 1)  # [q, J, D], [q, J]
        z = torch.einsum("qhd,qjd->qhj", q[rows].to(acc), kv) * scale
        z = z.masked_fill(~ok[:, None, :], float("-inf"))
        m = torch.maximum(z.amax(-1, keepdim=True), sink)
        p = torch.exp(z - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)
        out[rows] = (torch.einsum("qhj,qjd->qhd", p, kv) / denom).to(q.dtype)
    return out


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, bf16_scores: bool = False
                 ) -> torch.Tensor:
    """I[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s]) in fp32 ([T, N]; fp64 for an fp64 q); ``bf16_scores``
    rounds each dot and each weighted term to bf16 as the reference's bf16 einsum does (§3.5(d), §8 item 6)."""
    acc = _acc(q)
    d = torch.einsum("thd,sd->ths", q.to(acc), keys.to(acc))
    if bf16_scores:
        d = d.to(torch.bfloat16).to(acc)
        terms = (torch.relu(d) * weights.to(torch.bfloat16).to(acc)[..., None]).to(torch.bfloat16).to(acc)
        return terms.sum(1).to(torch.bfloat16).to(acc)
    return (torch.relu(d) * weights.to(acc)[..., None]).sum(1)


def _select(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k ids per row of scores [T, N] (-inf = not selectable): valid ids ascending, then -1. Exact
    ties go to the lower id (the model's ``topk_ids`` rule and the kernels'): ``torch.topk`` leaves tie
    order to the device's algorithm, so on a GPU it could pick another set than the tensor-only step's
    ``select_topk`` among equal FP4-quantised scores."""
    k = min(topk, scores.shape[1])
    vals, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :k], ids[:, :k]
    ids = torch.where(vals > float("-inf"), ids, torch.full_like(ids, torch.iinfo(torch.int32).max))
    ids = torch.sort(ids, dim=-1).values
    ids = torch.where(ids == torch.iinfo(torch.int32).max, -1, ids).to(torch.int32)
    if k < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - k), -1)], 1)
    return ids


def _visible_mask(visible: torch.Tensor, n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < visible.long()[:, None]


@register("indexer_topk_mx")
def indexer_topk_mx(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, visible: torch.Tensor,
                    topk: int, cand_blocks: Optional[torch.Tensor] = None, block_size: int = 8,
                    bf16_scores: bool = False, q_tile: int = 256) -> torch.Tensor:
    """Top-``topk`` entries per query of I (see :func:`index_scores`) over entries s < visible[t].

    q [T, Hi, Di] (already rotated and FP4-QDQ'd); weights [T, Hi] (scales folded in); index_keys uint8
    [N, Di/2 + Di/32] (one sequence's entries, in order); visible [T] int; cand_blocks [T, NB] int
    block ids (-1 pad): only entries of those blocks (block b = entries b·bs .. b·bs+bs-1) compete.
    Returns int32 [T, topk]: chosen ids ascending, then -1."""
    keys = mx.unpack_index_keys(index_keys)
    n = keys.shape[0]
    out = []
    for t0 in range(0, q.shape[0], q_tile):
        rows = slice(t0, t0 + q_tile)
        s = index_scores(q[rows], weights[rows], keys, bf16_scores)
        ok = _visible_mask(visible[rows], n, q.device)
        if cand_blocks is not None:
            nb = -(-n // block_size)
            cb = cand_blocks[rows].long()
            allowed = torch.zeros(cb.shape[0], nb + 1, dtype=torch.bool, device=q.device)
            allowed.scatter_(1, torch.where(cb >= 0, cb, nb), True)
            ok &= allowed[:, :nb].repeat_interleave(block_size, 1)[:, :n]
        out.append(_select(s.masked_fill(~ok, float("-inf")), topk))
    return torch.cat(out)


@register("indexer_candidates_mx")
def indexer_candidates_mx(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor,
                          visible: torch.Tensor, num_blocks: int = 2048, block_size: int = 8,
                          bf16_scores: bool = False, q_tile: int = 256) -> torch.Tensor:
    """select_candidate_blocks (§3.5(d)): block score = max of I over the block's entries (invisible
    ones -inf), the block of the newest visible entry pinned to +inf, then the best ``num_blocks``
    blocks with a finite-or-pinned score. Same inputs as :func:`indexer_topk_mx`; returns int32
    [T, num_blocks] block ids ascending, then -1."""
    keys = mx.unpack_index_keys(index_keys)
    n = keys.shape[0]
    nb = -(-n // block_size)
    out = []
    for t0 in range(0, q.shape[0], q_tile):
        rows = slice(t0, t0 + q_tile)
        s = index_scores(q[rows], weights[rows], keys, bf16_scores)
        s = s.masked_fill(~_visible_mask(visible[rows], n, q.device), float("-inf"))
        s = F.pad(s, (0, nb * block_size - n), value=float("-inf"))
        bs = s.view(s.shape[0], nb, block_size).amax(-1)
        vis = visible[rows].long()
        newest = ((vis - 1) // block_size).clamp(min=0)
        pinned = torch.full_like(bs[:, :1], float("inf"))
        bs = torch.where((vis > 0)[:, None] & (torch.arange(nb, device=q.device)[None] == newest[:, None]),
                         pinned, bs)
        out.append(_select(bs, num_blocks))
    return torch.cat(out)


@register("indexer_source_mx")
def indexer_source_mx(q: torch.Tensor, weights: torch.Tensor, index_keys: torch.Tensor, visible: torch.Tensor,
                      topk: int, num_blocks: int = 2048, block_size: int = 8, bf16_scores: bool = False
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The candidate source layer (20): its own top-k over the unmasked scores and the candidate blocks
    it publishes, from the same scores: ``(indexer_topk_mx(...), indexer_candidates_mx(...))``."""
    return (indexer_topk_mx(q, weights, index_keys, visible, topk, bf16_scores=bf16_scores),
            indexer_candidates_mx(q, weights, index_keys, visible, num_blocks, block_size, bf16_scores))


@register("engram_gather_mx")
def engram_gather_mx(table: torch.Tensor, table_scale: torch.Tensor, ids: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows[t, j] = table[ids[t, j]] · 2^(scale[ids[t, j], c//32] - 127) -> [T, n, W] ``dtype`` on
    ids' device. table e4m3 (or its uint8 bytes) [R, W], table_scale E8M0 bytes [R, W/32]; the table
    may live in (pinned) host memory: the gather runs where the table is and only rows move."""
    tid = ids.to(table.device).long()
    rows = mx.dequant_fp8_groups(table[tid], table_scale[tid], mx.MX_GROUP, dtype)
    return rows.to(ids.device, non_blocking=True)
