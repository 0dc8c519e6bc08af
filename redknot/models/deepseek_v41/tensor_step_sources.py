"""The V4.1 tensor-only step's global-cache sources: a kv source's compressor (latent rows, the ratio-2 pool and
its ring, the entries and index keys the step's rows close, quantised on insert) and an index source's
indexer (scores over every entry a row's block table addresses, candidate blocks, top-k).

Every per-row fact comes from the step's :class:`~redknot.models.deepseek_v41.tensor_step._Rows` (device
tensors only), so these run inside a captured CUDA graph. With the model's attention ops on Triton
(:func:`step_kernels`) they run the graph-safe step kernels; elsewhere the PyTorch math of the eager path.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.attention import candidate_blocks
from redknot.models.deepseek_v41.kernel_ops import ops_of
from redknot.models.deepseek_v41.ref_math import (
    acc_dtype, acc_linear, apply_rope, bf16_round, linear, plain_linear, topk_ids)

if TYPE_CHECKING:
    from redknot.models.deepseek_v41.tensor_step import _Rows


def step_kernels(w) -> bool:
    """Whether the step runs the graph-safe Triton attention/indexer kernels: the model routes its
    attention ops and they resolve to Triton (elsewhere the PyTorch math of the eager path is the step)."""
    ops = ops_of(w)
    return (ops is not None and ops.attention
            and all(ops.choice.get(op) == "triton" for op in ("sparse_attention_mx", "indexer_topk_mx",
                                                               "cache_insert_mx")))


def step_inv(layer) -> torch.Tensor:
    """The RoPE frequency tensor the step rotates the layer's rows with: the one it shares with an earlier
    layer of equal values (``tensor_step._shared_inv``, so their cos/sin table is computed once), else its own."""
    return layer.__dict__.get("_step_inv", layer.inv)


def _compress(layer, u, rows: _Rows, state) -> None:
    """The kv source's compressor: the latent rows (ratio 1: the normed ``wkv`` row; ratio 2: the gated pool
    of each row's group (p-1, p), then the ring update), then the entries the step's rows close and their
    index keys, quantised on insert. With the step kernels on 16-bit rows the look-back, pooling, norm and
    ring stores run in one launch and the keys' norm, both RoPEs and both inserts in another
    (:mod:`redknot.kernels.triton.step_compress_v41`); elsewhere, and where a kernel does not build, the
    PyTorch math of the eager path."""
    w, num, p = layer.w, layer.num, layer.p
    src = state.sources[layer.layer]
    fused = _compress_kernels(layer, u)
    latent = _compress_pool_kernel(layer, u, rows, src) if fused else None
    if latent is None:
        latent = _compress_latent(layer, u, rows, src)
    keys = plain_linear(latent, w, f"{p}.indexer.wk.weight", num.dtype)       # before its norm
    if fused:
        from redknot.kernels.triton.step_compress_v41 import insert_entries

        cfg = layer.cfg
        done = fused_rows._guarded(insert_entries, keys, latent, w.float(f"{p}.indexer.k_norm.weight"), layer.inv,
                                   rows.pos, rows.blocks, src.keys.view(-1, src.keys.shape[-1]),
                                   src.entries.view(-1, src.entries.shape[-1]), layer.ratio, rows.block_size,
                                   cfg.norm_eps)
        if done is not None:
            return
    _compress_insert(layer, keys, latent, rows, src)


def _compress_kernels(layer, u) -> bool:
    """Whether the compressor runs its step kernels: the step's Triton kernels on 16-bit rows of widths
    they take, up to ``MAX_ROWS`` rows."""
    from redknot.kernels.triton.step_compress_v41 import MAX_ROWS, supported

    cfg = layer.cfg
    return (step_kernels(layer.w) and fused_rows.fused(layer.w, u) and layer.num.dtype == u.dtype
            and u.shape[0] <= MAX_ROWS and layer.ratio in (1, 2)
            and supported(cfg.head_dim, cfg.index_head_dim, layer.inv.shape[0]))


def _compress_pool_kernel(layer, u, rows: _Rows, src) -> Optional[torch.Tensor]:
    """The latent rows through the pooling kernel (ratio 2), or through the same norm launch the PyTorch
    math runs (ratio 1); None: the kernel does not build here (the ring is then untouched)."""
    from redknot.kernels.triton.step_compress_v41 import pool_rows

    cfg, w, num, p = layer.cfg, layer.w, layer.num, layer.p
    if layer.ratio == 1:
        return _compress_latent(layer, u, rows, src)
    a = acc_dtype(num.dtype)
    kv_a = acc_linear(u, w, f"{p}.compressor.wkv.weight", a)                   # [T, Dh]
    gate = acc_linear(u, w, f"{p}.compressor.wgate.weight", a)
    return fused_rows._guarded(pool_rows, kv_a, gate, src.kv_rows, src.gate_rows, rows.slot, rows.pos, rows.back,
                               rows.last, w.float(f"{p}.compressor.norm.weight"), cfg.norm_eps, layer.ratio,
                               num.dtype)


def _compress_latent(layer, u, rows: _Rows, src) -> torch.Tensor:
    """The latent rows [T, Dh] as PyTorch math (the ratio-2 ring updated after its reads)."""
    cfg, w, num, p = layer.cfg, layer.w, layer.num, layer.p
    norm = f"{p}.compressor.norm.weight"
    r = layer.ratio
    if r == 1:
        return fused_rows.norm(plain_linear(u, w, f"{p}.compressor.wkv.weight", num.dtype), w, norm, cfg.norm_eps)
    a = acc_dtype(num.dtype)
    kv_a = acc_linear(u, w, f"{p}.compressor.wkv.weight", a)               # [T, Dh]
    gate = acc_linear(u, w, f"{p}.compressor.wgate.weight", a)
    # Group (p-1, p) for every row; only odd positions close a group and store it.
    ka = rows.ring_lookback(src.kv_rows, kv_a, r).flip(1).to(a)            # [T, r, Dh] oldest first
    ga = rows.ring_lookback(src.gate_rows, gate, r).flip(1).to(a)
    pooled = (ka * torch.softmax(ga, dim=1)).sum(1)
    latent = fused_rows.norm(pooled.to(num.dtype), w, norm, cfg.norm_eps)
    ring = src.kv_rows.shape[1]
    dst = rows.ring_dest(ring)
    src.kv_rows.view(-1, src.kv_rows.shape[-1]).index_copy_(0, dst, kv_a.to(src.kv_rows.dtype))
    src.gate_rows.view(-1, src.gate_rows.shape[-1]).index_copy_(0, dst, gate.to(src.gate_rows.dtype))
    return latent


def _compress_insert(layer, keys: torch.Tensor, latent: torch.Tensor, rows: _Rows, src) -> None:
    """Index keys (``keys``: the ``indexer.wk`` rows before their norm) and entries of the rows that close a
    group, as PyTorch math (the registry's insert where the step runs its kernels)."""
    cfg, w, p = layer.cfg, layer.w, layer.p
    r = layer.ratio
    per = src.entries.shape[1]
    pos = rows.pos
    if r == 1:
        ent = pos
        dest = rows.page(ent, r, per)
    else:
        closes = (pos + 1) % r == 0
        ent = ((pos + 1) // r - 1).clamp(min=0)
        spare = torch.full_like(ent, rows.spare_block * per)
        dest = torch.where(closes, rows.page(ent, r, per), spare)
    epos = ent * r
    keys = fused_rows.norm(keys, w, f"{p}.indexer.k_norm.weight", cfg.norm_eps)
    if step_kernels(w):  # quantised on insert (bit-exact with the packing below)
        ops = ops_of(w)
        tables = {}   # keys and entries rotate by the same entry positions (RoPE bits equal apply_rope's)
        ops.cache_insert_mx(src.keys.view(-1, src.keys.shape[-1]), dest,
                            fused_rows.rope(keys, w, epos, layer.inv, tables), "index")
        ops.cache_insert_mx(src.entries.view(-1, src.entries.shape[-1]), dest,
                            fused_rows.rope(latent, w, epos, layer.inv, tables), "compressed")
        return
    src.keys.view(-1, src.keys.shape[-1]).index_copy_(0, dest, mx.pack_index_keys(apply_rope(keys, epos, layer.inv)))
    src.entries.view(-1, src.entries.shape[-1]).index_copy_(
        0, dest, mx.pack_compressed_entries(apply_rope(latent, epos, layer.inv)))


def _index(layer, u, qr, rows: _Rows, state, shared) -> None:
    cfg, w, num = layer.cfg, layer.w, layer.num
    p = f"{layer.p}.indexer"
    t = u.shape[0]
    dev = u.device
    q = shared.pop("index_q", None)   # the query from the q projections' launches (fused_rows.q_kv_rows)
    if q is None:
        q = linear(qr, w, f"{p}.wq_b.weight", num).view(t, cfg.index_n_heads, cfg.index_head_dim)
        q = fused_rows.rope(q, w, rows.pos, step_inv(layer), shared.get("rope"), qdq=True)
    wscale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
    wts = plain_linear(u, w, f"{p}.weights_proj.weight", num.dtype)
    r = layer.ratio
    src = state.sources[layer.kv_source]
    n_max = rows.blocks.shape[1] * rows.block_size // r                          # entries a table addresses
    visible = rows.visible(r)
    if step_kernels(w) and num.acc == torch.float32:   # the cast and scale inside the score kernel (same bits)
        _index_kernel(layer, q, wts, rows, src, visible, n_max, shared, wscale)
        return
    wts = wts.to(num.acc) * wscale
    if step_kernels(w):
        _index_kernel(layer, q, wts, rows, src, visible, n_max, shared)
        return
    sc = _index_scores_torch(q, wts, rows, src, r, n_max, num)
    if cfg.is_candidate_source(layer.layer):
        shared["cand"] = candidate_blocks(sc, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    elif cfg.reads_candidates(layer.layer):
        sc = sc.masked_fill(~shared["cand"][:, :n_max], float("-inf"))
    k = min(cfg.index_topk, n_max)
    sel = topk_ids(sc, k)
    sel = torch.where(sc.gather(1, sel) > float("-inf"), sel, torch.full_like(sel, -1))
    topk = torch.full((t, cfg.index_topk), -1, dtype=torch.long, device=dev)
    topk[:, :k] = sel
    shared["topk"] = topk


def _index_kernel(layer, q, wts, rows: _Rows, src, visible, n_max: int, shared, wscale: float = 1.0) -> None:
    """The indexer through the paged step kernel: every addressable entry on the index sources (the
    candidate source also publishes its blocks as entry lists); only the candidate entries on the
    layers that re-index inside them, when those are fewer than the table addresses."""
    from redknot.kernels.triton.step_indexer_mx import step_index_scores
    from redknot.kernels.triton.step_select import candidate_select, topk_select

    cfg, num = layer.cfg, layer.num
    keys = src.keys.view(-1, src.keys.shape[-1])
    score = functools.partial(step_index_scores, q, wts, keys, rows.blocks, visible, layer.ratio, rows.block_size,
                              bf16_scores=num.act_quant, weights_scale=wscale)
    if cfg.reads_candidates(layer.layer) and shared["cand_entries"].shape[1] < n_max:
        cand = shared["cand_entries"]                                             # [T, NB·bs] ascending, -1
        shared["topk"] = topk_select(score(entries=cand), cfg.index_topk, ids=cand)   # the listed ids
        return
    sc = score()
    if cfg.is_candidate_source(layer.layer):   # the blocks as entry lists and as a map [T, blocks]
        shared["cand_entries"], shared["cand_blocks"] = candidate_select(
            sc, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        shared["topk"] = topk_select(sc, cfg.index_topk)
    elif cfg.reads_candidates(layer.layer):    # every entry of the candidate blocks, in the same launch
        shared["topk"] = topk_select(sc, cfg.index_topk, block_mask=shared["cand_blocks"],
                                     mask_block=cfg.candidate_block_size)
    else:
        shared["topk"] = topk_select(sc, cfg.index_topk)


def _index_scores_torch(q, wts, rows: _Rows, src, r: int, n_max: int, num) -> torch.Tensor:
    """[T, n_max] scores of every entry a row's table addresses (-inf past its visible count)."""
    t = q.shape[0]
    ent = torch.arange(n_max, device=q.device)
    idx = rows.page(ent.expand(t, n_max), r, src.keys.shape[1])
    keys = mx.unpack_index_keys(src.keys.view(-1, src.keys.shape[-1])[idx.reshape(-1)],
                                num.dtype).view(t, n_max, -1)
    a = wts.dtype
    dots = torch.einsum("nhd,nsd->nsh", q.to(a), keys.to(a))
    if num.act_quant:
        sc = bf16_round(bf16_round(bf16_round(F.relu(bf16_round(dots))) * bf16_round(wts)[:, None, :]).sum(-1))
    else:
        sc = (F.relu(dots) * wts[:, None, :]).sum(-1)
    visible = (rows.pos + 1) // r
    return sc.masked_fill(ent[None, :] >= visible[:, None], float("-inf"))
