"""Batch-invariant backend: a row's result never depends on the other rows of the call.

Used by ``features.batch_invariant.enabled``: a request's logits are then
bitwise identical whatever else is in the batch and however its prompt was
chunked. GEMM libraries pick kernels (and so reduction orders) by problem
shape, so every op here works on shapes that depend only on the row itself:

* row-wise ops (linears, norms, hyper-connections, expert GEMMs) run on fixed
  ``TILE_ROWS``-row tiles, the last one zero-padded — one GEMM shape for every
  row, whatever the step's token count or the expert's load;
* attention and the lightning indexer run one query at a time over exactly
  the keys that query sees (its window, then its entries in a fixed order), so
  the reduction length depends only on the query's position;
* the MoE combine adds the k expert outputs in slot order with elementwise adds.

Correct but slower than the reference path; meant for reproducibility runs.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from redknot.kernels import ref_attention
from redknot.kernels import reference as ref
from redknot.kernels.ref_moe import expert_weight, routed_slots, swiglu
from redknot.kernels.ref_quant import dequantize
from redknot.kernels.registry import register

BACKEND = "batch_invariant"
TILE_ROWS = 16


def tiled(fn: Callable, rows: Sequence[torch.Tensor], *args, tile: int = TILE_ROWS):
    """Apply ``fn(*row_tiles, *args)`` to fixed ``tile``-row blocks of the row-aligned
    tensors ``rows`` (zero-padded) and concatenate; returns a tensor or a tuple like ``fn``."""
    t = rows[0].shape[0]
    pad = (-t) % tile
    if pad or t == 0:
        pad = pad or tile
        rows = [torch.cat([r, r.new_zeros((pad,) + tuple(r.shape[1:]))]) for r in rows]
    outs = [fn(*(r[i:i + tile] for r in rows), *args) for i in range(0, rows[0].shape[0], tile)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts)[:t] for parts in zip(*outs))
    return torch.cat(outs)[:t]


@register("rms_norm", BACKEND)
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    return tiled(ref.rms_norm, [flat], weight, eps).view(*lead, -1)


@register("rms_norm_rope", BACKEND)
def rms_norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    return ref.rope(rms_norm(x, weight, eps), cos, sin)


@register("linear", BACKEND)
def linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    w = dequantize(weight, scale, x.dtype)  # once per call, not per tile
    return tiled(F.linear, [x], w)


@register("grouped_linear", BACKEND)
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    w = dequantize(weight, scale, x.dtype)
    return tiled(ref.grouped_linear, [x], w)


@register("mhc_pre", BACKEND)
def mhc_pre(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    return tiled(ref.mhc_pre, [streams], fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)


@register("mhc_pre_norm", BACKEND)
def mhc_pre_norm(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm_weight,
                 rms_eps: float):
    u, post, comb = mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return rms_norm(u, norm_weight, rms_eps), post, comb


@register("mhc_post", BACKEND)
def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[:, k] = post[:, k] * y + Σ_j comb[:, j, k] * streams[:, j], summed over j in order."""
    n = streams.shape[1]
    s, c = streams.float(), comb.float()
    outs = []
    for k in range(n):
        acc = post[:, k:k + 1].float() * y.float()
        for j in range(n):
            acc = acc + c[:, j, k:k + 1] * s[:, j]
        outs.append(acc)
    return torch.stack(outs, dim=1).to(streams.dtype)


@register("mhc_post_pre_norm", BACKEND)
def mhc_post_pre_norm(y, streams, post, comb, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                      norm_weight, rms_eps: float):
    out = mhc_post(y, streams, post, comb)
    return (out,) + mhc_pre_norm(out, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, rms_eps)


@register("mhc_head", BACKEND)
def mhc_head(streams, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    return tiled(ref.mhc_head, [streams], fn, base, scale, hc_eps, norm_eps)


@register("moe", BACKEND)
def moe(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit: float, w1_scale=None, w2_scale=None,
        w3_scale=None) -> torch.Tensor:
    """Routed experts with tiled expert GEMMs and an in-order combine (see ``reference.moe``)."""
    k = topk_idx.shape[1]

    def expert(h: torch.Tensor, e: int) -> torch.Tensor:
        gate = tiled(F.linear, [h], expert_weight(w1, w1_scale, e, x.dtype))
        up = tiled(F.linear, [h], expert_weight(w3, w3_scale, e, x.dtype))
        return tiled(F.linear, [swiglu(gate, up, swiglu_limit)], expert_weight(w2, w2_scale, e, x.dtype))

    per_slot = routed_slots(x, topk_idx, topk_weight, w1.shape[0], expert)  # [T, k, D] fp32
    out = per_slot[:, 0]
    for j in range(1, k):
        out = out + per_slot[:, j]
    return out.to(x.dtype)


@register("compressor", BACKEND)
def compressor(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
               has_prev: bool) -> torch.Tensor:
    """One entry at a time, each from exactly the rows it pools (see ``reference.compressor``)."""
    nw = kv.shape[0] // ratio
    first = 1 if (overlap and has_prev) else 0
    out = []
    for w in range(first, nw):
        if overlap and w > 0:
            lo, prev = (w - 1) * ratio, True
        else:
            lo, prev = w * ratio, False
        hi = (w + 1) * ratio
        out.append(ref_attention.compressor(kv[lo:hi], gate[lo:hi], ape, ratio, overlap, prev))
    return torch.cat(out) if out else kv.new_zeros((0, kv.shape[1] // (2 if overlap else 1)), dtype=torch.float32)


def _spans(meta):
    return zip(meta.query_start_list, meta.num_tokens_per_seq, meta.context_lens, meta.seq_slot_list)


def _entry_rows(block_row: torch.Tensor, w: torch.Tensor, per_block: int) -> torch.Tensor:
    return block_row[w // per_block].long() * per_block + w % per_block


@register("compressor_decode", BACKEND)
def compressor_decode(kv, gate, kv_ring, gate_ring, ring_dest, window_src, window_valid, ape, norm_weight, eps,
                      ratio, overlap, cos, sin, closes, pool_dest, pool) -> None:
    """The reference composition over this backend's ``compressor`` and ``rms_norm``."""
    ref_attention.compressor_decode_with(compressor, rms_norm, ref.rope, kv, gate, kv_ring, gate_ring,
                                         ring_dest, window_src, window_valid, ape, norm_weight, eps, ratio, overlap,
                                         cos, sin, closes, pool_dest, pool)


@register("indexer_topk", BACKEND)
def indexer_topk(q, weights, key_pool, meta, ratio: int, topk: int, scale: float, q_tile: int = 512):
    """Per query: scores over its own visible entries, stable descending sort, first ``topk``."""
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    per_block = key_pool.shape[1]
    flat = key_pool.flatten(0, 1)
    for b, (s0, n, c, _slot) in enumerate(_spans(meta)):
        n_all = (c + n) // ratio
        if n_all == 0:
            continue
        keys = flat[_entry_rows(meta.block_tables[b], torch.arange(n_all, device=q.device), per_block)].float()
        for i in range(n):
            visible = (c + i + 1) // ratio
            if visible == 0:
                continue
            qi = q[s0 + i].float()  # [IH, ID]
            scores = torch.relu(qi @ keys[:visible].T) * scale  # [IH, Ne]
            scores = (scores * weights[s0 + i].float()[:, None]).sum(dim=0)  # [Ne]
            best = torch.sort(scores, descending=True, stable=True).indices[:topk]
            out[s0 + i, :best.shape[0]] = best
    return out


def _query_keys(keys_local: torch.Tensor, lo: int, p: int, window: int) -> torch.Tensor:
    """Window keys of the query at position p: positions max(lo, p-window+1) .. p."""
    return keys_local[max(lo, p - window + 1) - lo:p + 1 - lo]


@register("sparse_attention", BACKEND)
def sparse_attention(q, kv, swa_ring, sinks, scale: float, window: int, meta, extra_pool=None, extra_idx=None,
                     q_tile: int = 256) -> torch.Tensor:
    """Per query: one softmax over [its window keys | its valid entries in index order | sink]."""
    out = torch.empty_like(q)
    ring = swa_ring.shape[1]
    sink = sinks.float().view(-1, 1)  # [H, 1]
    flat_pool = extra_pool.flatten(0, 1) if extra_pool is not None else None
    for b, (s0, n, c, slot) in enumerate(_spans(meta)):
        lo = max(0, c - window + 1)
        old = torch.arange(lo, c, device=q.device) % ring
        keys_local = torch.cat([swa_ring[slot, old], kv[s0:s0 + n]]).float()  # positions lo .. c+n-1
        for i in range(n):
            keys = _query_keys(keys_local, lo, c + i, window)
            if extra_idx is not None:
                idx = extra_idx[s0 + i]
                idx = idx[idx >= 0]
                if idx.numel():
                    ext = flat_pool[_entry_rows(meta.block_tables[b], idx, extra_pool.shape[1])].float()
                    keys = torch.cat([keys, ext])
            qi = q[s0 + i].float()  # [H, d]
            logits = torch.cat([(qi @ keys.T) * scale, sink], dim=1)  # [H, K+1]
            probs = torch.softmax(logits, dim=1)
            out[s0 + i] = (probs[:, :-1] @ keys).to(q.dtype)
    return out


@register("router_scores", BACKEND)
def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x·Wᵀ)) in fp32 on fixed tiles: softplus is vectorised differently in a tensor's
    body and tail on CPU, so the elementwise part needs a fixed shape as much as the GEMM."""
    return tiled(lambda rows, w: F.softplus(F.linear(rows, w)).sqrt(), [x.float()], weight.float())


OPS: Tuple[str, ...] = ("rms_norm", "rms_norm_rope", "linear", "grouped_linear", "mhc_pre", "mhc_pre_norm",
                        "mhc_post", "mhc_post_pre_norm", "mhc_head", "moe", "compressor", "compressor_decode",
                        "indexer_topk", "sparse_attention", "router_scores")
