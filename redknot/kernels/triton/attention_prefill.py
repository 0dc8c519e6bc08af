"""Prefill form of V4's ``sparse_attention_paged`` (bf16 rows): transposed scores, keys on the MMA's M side.

Same contract and rounding as :mod:`attention` (the virtual key list of a query: its window rows from this
step's ``kv`` or the per-sequence ring, then its compressed entries through the block table, from a top-k
list or every visible entry; fp32 scores, probabilities rounded to the key dtype for the PV product, fp32
denominator, the sink in the denominator only, the optional fused inverse RoPE of the output's rope columns).
What differs is the shape of one program's tensor-core work (one query, ``BLOCK_H`` heads, normally all 64),
as in the V4.1 prefill kernel (:mod:`attention_prefill_mx`, whose online softmax over transposed scores and
chunk store this kernel imports):

* :mod:`attention` computes s = Q·Kᵀ [heads, keys]; Triton lays a dot whose result feeds another dot with
  every warp along M, and M is the 64 heads, one warpgroup: with 8 warps both warpgroups compute the same
  [64, 32] scores (sm_90a TTGIR ``warpsPerCTA = [8, 1]``, 64 ``wgmma m64n16k16`` per 32-key step in each).
  Here sᵀ = K·Qᵀ [keys, heads] with ``BLOCK_N = 64 · warpgroups``: each warpgroup owns 64 keys; the softmax
  runs down the key axis; O = P·K [heads, D] (P = (Pᵀ)ᵀ) is the second product;
* the 512-wide rows are read and multiplied in ``D_SPLIT`` column chunks, so one chunk of rows (not a whole
  block) passes through registers at a time on its way to shared memory;
* the window and the compressed entries run as two loops, each with only its own row addressing (window:
  ``attention._key_rows`` without the compressed part; entries: top-k id, block table), not one loop computing
  both kinds of pointer for every key;
* the inverse RoPE of the rope columns runs on the last chunk's accumulator (pairs split and rejoined in
  registers) instead of two extra [heads, rope] accumulators and dots per key block.

Only unsplit launches (prefill: one program per query and head block fills the device). Not measured on
the H200: the prefill tuner (``attention.ATTN_PREFILL_TUNER``) times these launch shapes next to the earlier
ones per problem class and keeps the fastest; a shape runs only after its first-use check against the float64
oracle on the device (:func:`first_use_ok`).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import LOG2E, cdiv, next_pow2
from redknot.kernels.triton.attention import (
    COMP_ALL,
    COMP_NONE,
    COMP_TOPK,
    PrefillTConfig,
    _key_rows,
    _query_span,
)
from redknot.kernels.triton.attention_prefill_mx import _online_t, _store_t


@triton.jit
def _chunk(ptr, valid, C0: tl.constexpr, DC: tl.constexpr):
    """Columns [C0, C0 + DC) of the key rows ``ptr`` (invalid rows: zeros)."""
    return tl.load(ptr[:, None] + C0 + tl.arange(0, DC)[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _comp_rows(j0, n_comp, tok, b, cache_ptr, bt_ptr, topk_ptr, stride_cb, stride_ce, stride_bt, stride_tk, ratio,
               block_size, BLOCK_N: tl.constexpr, COMP: tl.constexpr):
    """Row pointers and validity of compressed entries ``j0 .. j0+BLOCK_N`` of a query's list (``attention._key_rows``
    past the window: top-k id or the entry itself, then the block table)."""
    j = j0 + tl.arange(0, BLOCK_N)
    ok = j < n_comp
    if COMP == 1:
        w = tl.load(topk_ptr + tok.to(tl.int64) * stride_tk + j, mask=ok, other=-1)
        ok = ok & (w >= 0)
    else:
        w = j
    first = w * ratio
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + first // block_size, mask=ok, other=0)
    return cache_ptr + blk.to(tl.int64) * stride_cb + ((first % block_size) // ratio).to(tl.int64) * stride_ce, ok


@triton.jit
def _block_t(q0, q1, q2, q3, acc0, acc1, acc2, acc3, m, l, ptr, valid, qk_scale, D: tl.constexpr,
             D_SPLIT: tl.constexpr):
    """One block of keys: sᵀ = Σ_c K_c·Q_cᵀ, online softmax down the keys, O_c = α·O_c + P·K_c per chunk c."""
    DC: tl.constexpr = D // D_SPLIT
    k0 = _chunk(ptr, valid, 0, DC)
    zt = tl.dot(k0, tl.trans(q0))
    if D_SPLIT >= 2:
        k1 = _chunk(ptr, valid, DC, DC)
        zt = tl.dot(k1, tl.trans(q1), zt)
    if D_SPLIT == 4:
        k2 = _chunk(ptr, valid, 2 * DC, DC)
        zt = tl.dot(k2, tl.trans(q2), zt)
        k3 = _chunk(ptr, valid, 3 * DC, DC)
        zt = tl.dot(k3, tl.trans(q3), zt)
    m, l, alpha, pt = _online_t(zt, valid, m, l, qk_scale)
    p = tl.trans(pt).to(k0.dtype)
    acc0 = tl.dot(p, k0, acc0 * alpha[:, None])
    if D_SPLIT >= 2:
        acc1 = tl.dot(p, k1, acc1 * alpha[:, None])
    if D_SPLIT == 4:
        acc2 = tl.dot(p, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(p, k3, acc3 * alpha[:, None])
    return acc0, acc1, acc2, acc3, m, l


@triton.jit
def _store_rope(out_ptr, acc, denom, tok, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh,
                C0: tl.constexpr, DC: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Columns [C0, C0 + DC), the interleaved pairs among the last RD columns rotated back by the query's angle:
    (a, b) -> (a·cos + b·sin, b·cos - a·sin)."""
    o = tl.reshape(acc / denom[:, None], (BLOCK_H, DC // 2, 2))
    a, b = tl.split(o)
    pair = (C0 - (D - RD)) // 2 + tl.arange(0, DC // 2)  # rope pair index of each column pair (< 0: no rope)
    rp = pair >= 0
    c = tl.load(cos_ptr + tok * (RD // 2) + tl.where(rp, pair, 0), mask=rp, other=1.0)[None, :]
    s = tl.load(sin_ptr + tok * (RD // 2) + tl.where(rp, pair, 0), mask=rp, other=0.0)[None, :]
    o = tl.reshape(tl.join(a * c + b * s, b * c - a * s), (BLOCK_H, DC))
    row = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + C0 + tl.arange(0, DC)[None, :]
    tl.store(row, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _store_chunk(out_ptr, acc, denom, tok, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh,
                 C0: tl.constexpr, DC: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr,
                 ROPE: tl.constexpr):
    if ROPE and C0 + DC > D - RD:
        _store_rope(out_ptr, acc, denom, tok, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh, C0, DC, D, RD,
                    BLOCK_H)
    else:
        _store_t(out_ptr, acc, denom, tok, heads, hmask, stride_ot, stride_oh, C0, DC)


@triton.jit
def _sparse_attn_prefill_t(q_ptr, kv_ptr, ring_ptr, cache_ptr, out_ptr, tok_seq_ptr, pos_ptr, ctx_ptr, qstart_ptr,
                           slot_ptr, bt_ptr, topk_ptr, sink_ptr, cos_ptr, sin_ptr,
                           stride_qt, stride_qh, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce,
                           stride_ot, stride_oh, stride_bt, stride_tk,
                           qk_scale, ring_size, window, ratio, block_size, num_topk, H,
                           D: tl.constexpr, RD: tl.constexpr, D_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_N: tl.constexpr, COMP: tl.constexpr, HAS_RING: tl.constexpr,
                           HAS_SINK: tl.constexpr, ROPE: tl.constexpr, PREFETCH: tl.constexpr):
    """One program per (query, head block): sᵀ = K·Qᵀ [BLOCK_N, BLOCK_H] (BLOCK_N = 64 per warpgroup),
    O = P·K [BLOCK_H, D] in D_SPLIT (1, 2, 4) column chunks; PREFETCH: a block's row pointers one block ahead."""
    DC: tl.constexpr = D // D_SPLIT
    tok = tl.program_id(0)
    b, ctx, qs, slot, lo, n_swa, n_comp = _query_span(tok, tok_seq_ptr, pos_ptr, ctx_ptr, qstart_ptr, slot_ptr,
                                                      window, ratio, num_topk, COMP, HAS_RING)

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    tok64 = tok.to(tl.int64)
    qrow = q_ptr + tok64 * stride_qt + heads[:, None] * stride_qh + tl.arange(0, DC)[None, :]
    q0 = tl.load(qrow, mask=hmask[:, None], other=0.0)
    q1 = q0
    q2 = q0
    q3 = q0
    if D_SPLIT >= 2:
        q1 = tl.load(qrow + DC, mask=hmask[:, None], other=0.0)
    if D_SPLIT == 4:
        q2 = tl.load(qrow + 2 * DC, mask=hmask[:, None], other=0.0)
        q3 = tl.load(qrow + 3 * DC, mask=hmask[:, None], other=0.0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    else:  # a finite floor: every query has at least its own row, so m ends at a real score
        sink = tl.full([BLOCK_H], -1.0e30, tl.float32)
    m = sink
    l = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, DC], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    # the window (rows of this step or the ring), then the compressed entries: two loops, each with only its own
    # row addressing
    ptr_nx, valid_nx = _key_rows(0, n_swa, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr,
                                 topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt,
                                 stride_tk, ring_size, ratio, block_size, BLOCK_N, 0, HAS_RING)
    for kb in range(0, n_swa, BLOCK_N):
        if PREFETCH:
            ptr, valid = ptr_nx, valid_nx
            ptr_nx, valid_nx = _key_rows(kb + BLOCK_N, n_swa, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr,
                                         cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb,
                                         stride_ce, stride_bt, stride_tk, ring_size, ratio, block_size, BLOCK_N,
                                         0, HAS_RING)
        else:
            ptr, valid = _key_rows(kb, n_swa, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr,
                                   topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt,
                                   stride_tk, ring_size, ratio, block_size, BLOCK_N, 0, HAS_RING)
        acc0, acc1, acc2, acc3, m, l = _block_t(q0, q1, q2, q3, acc0, acc1, acc2, acc3, m, l, ptr, valid, qk_scale,
                                                D, D_SPLIT)
    if COMP != 0:
        ptr_nx, valid_nx = _comp_rows(0, n_comp, tok, b, cache_ptr, bt_ptr, topk_ptr, stride_cb, stride_ce, stride_bt,
                                      stride_tk, ratio, block_size, BLOCK_N, COMP)
        for j0 in range(0, n_comp, BLOCK_N):
            if PREFETCH:
                ptr, valid = ptr_nx, valid_nx
                ptr_nx, valid_nx = _comp_rows(j0 + BLOCK_N, n_comp, tok, b, cache_ptr, bt_ptr, topk_ptr, stride_cb,
                                              stride_ce, stride_bt, stride_tk, ratio, block_size, BLOCK_N, COMP)
            else:
                ptr, valid = _comp_rows(j0, n_comp, tok, b, cache_ptr, bt_ptr, topk_ptr, stride_cb, stride_ce,
                                        stride_bt, stride_tk, ratio, block_size, BLOCK_N, COMP)
            acc0, acc1, acc2, acc3, m, l = _block_t(q0, q1, q2, q3, acc0, acc1, acc2, acc3, m, l, ptr, valid,
                                                    qk_scale, D, D_SPLIT)
    denom = l + tl.exp2(sink - m)
    _store_chunk(out_ptr, acc0, denom, tok64, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh, 0, DC, D, RD,
                 BLOCK_H, ROPE)
    if D_SPLIT >= 2:
        _store_chunk(out_ptr, acc1, denom, tok64, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh, DC, DC, D,
                     RD, BLOCK_H, ROPE)
    if D_SPLIT == 4:
        _store_chunk(out_ptr, acc2, denom, tok64, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh, 2 * DC, DC,
                     D, RD, BLOCK_H, ROPE)
        _store_chunk(out_ptr, acc3, denom, tok64, heads, hmask, cos_ptr, sin_ptr, stride_ot, stride_oh, 3 * DC, DC,
                     D, RD, BLOCK_H, ROPE)


def paged_launch_args(*, q, kv, token_seq, positions, context_lens, query_start, window, sink, scale, ring, seq_slots,
                      cache, block_table, ratio, block_size, topk, rope_cos, rope_sin, out):
    """The positional arguments the prefill kernels (``_sparse_attn_prefill_t``, the Gluon
    ``_sparse_attn_prefill_wg``) share, from ``attention._launch``'s keywords, and their forms:
    (args, COMP, ROPE, RD)."""
    comp = COMP_NONE if cache is None else (COMP_TOPK if topk is not None else COMP_ALL)
    rope = rope_cos is not None
    rd = 2 * rope_cos.shape[-1] if rope else 16
    ring_t = ring if ring is not None else kv
    cache_t = cache if cache is not None else kv
    bt = block_table if block_table is not None else positions.view(1, -1)
    tk = topk if topk is not None else positions.view(-1, 1)
    args = (q, kv, ring_t, cache_t, out, token_seq, positions, context_lens, query_start, seq_slots, bt, tk,
            sink if sink is not None else q, rope_cos if rope else q, rope_sin if rope else q,
            q.stride(0), q.stride(1), kv.stride(0),
            ring_t.stride(0) if ring is not None else 0, ring_t.stride(1) if ring is not None else 0,
            cache_t.stride(0) if cache is not None else 0, cache_t.stride(1) if cache is not None else 0,
            out.stride(0), out.stride(1), bt.stride(0), tk.stride(0),
            scale * LOG2E, ring.shape[1] if ring is not None else 1, window, max(ratio, 1), max(block_size, 1),
            tk.shape[1] if comp == COMP_TOPK else 0, q.shape[1])
    return args, comp, rope, rd


def launch_prefill_t(cfg: PrefillTConfig, **kw) -> torch.Tensor:
    """``attention._launch``'s arguments (already normalised by ``sparse_attention_paged``), this kernel."""
    q, out = kw["q"], kw["out"]
    T, H, D = q.shape
    block_h = max(16, min(cfg.block_h, next_pow2(H)))
    args, comp, rope, rd = paged_launch_args(**kw)
    d_split = cfg.d_split
    while d_split > 1 and (D // d_split < 16 or (rope and D // d_split < rd)):  # the rope columns in one chunk
        d_split //= 2
    _sparse_attn_prefill_t[(T, cdiv(H, block_h))](
        *args, D=D, RD=rd, D_SPLIT=d_split, BLOCK_H=block_h, BLOCK_N=cfg.block_n, COMP=comp,
        HAS_RING=kw["ring"] is not None, HAS_SINK=kw["sink"] is not None, ROPE=rope, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


_FIRST_USE: dict[tuple[object, str, bool, str], bool] = {}


def launcher(cfg):
    """The launch function of a prefill-only shape: ``launch_prefill_t`` for ``PrefillTConfig``, the Gluon kernel's
    for ``attention_prefill_wg.PrefillWGConfig``."""
    from redknot.kernels.triton import attention_prefill_wg as wg
    return wg.launch_prefill_wg if isinstance(cfg, wg.PrefillWGConfig) else launch_prefill_t


def first_use_ok(cfg, device: torch.device, rope: bool = False, comp: str = "topk") -> bool:
    """Whether ``cfg`` matches the float64 oracle on fresh random inputs at V4 width (64 heads x 512, window 128;
    a sequence with rows in the ring and in this step, compressed entries from a top-k list with -1 pads, and a
    query with no entry yet; ``comp`` and ``rope`` as :func:`check_inputs`: the compiled form the call will run);
    checked once per device and form, a build error counts as a mismatch. The prefill tuner's candidate runs only
    where this holds."""
    key = (cfg, str(device), rope, comp)
    if key not in _FIRST_USE and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # no check inside a CUDA-graph capture: run the shape once before capturing it
    if key not in _FIRST_USE:
        from redknot.kernels.triton import oracle
        try:
            args = check_inputs(device, seed=int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF, rope=rope,
                                comp=comp)
            got = launcher(cfg)(cfg, **args).double()
            want = oracle.sparse_attention_paged(**{k: v for k, v in args.items() if k != "out"})
            _FIRST_USE[key] = bool(float((got - want).norm() / want.norm()) < 1e-2)
        except Exception:  # noqa: BLE001 - a launch shape the compiler refuses on this device
            _FIRST_USE[key] = False
    return _FIRST_USE[key]


def check_inputs(device, dtype=torch.bfloat16, *, seed: int, heads: int = 64, dim: int = 512, window: int = 128,
                 ratio: int = 4, block_size: int = 64, topk: int = 64, ctx: int = 300, new: int = 3,
                 comp: str = "topk", rope: bool = False):
    """``launch_prefill_t`` keyword arguments of one sequence (``ctx`` rows in the ring and the cache, ``new``
    queries), plus a second sequence of one query at position 1 (no compressed entry visible): fresh random
    rows, a shuffled block table, top-k lists of distinct visible entries with -1 pads (``comp``: "topk",
    "all" = every visible entry, "none" = the window alone), rope tables of 64 columns with ``rope``."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)
    pos = list(range(ctx, ctx + new)) + [1]
    per_block = block_size // ratio
    nblk = cdiv(ctx + new, block_size) + 2
    bt = torch.randperm(2 * nblk, generator=g)[:2 * nblk].view(2, nblk).to(device=device, dtype=torch.int32)
    args = {"q": rnd(new + 1, heads, dim), "kv": rnd(new + 1, dim), "token_seq": i32([0] * new + [1]),
            "positions": i32(pos), "context_lens": i32([ctx, 1]), "query_start": i32([0, new]), "window": window,
            "sink": torch.randn(heads, generator=g).to(device), "scale": dim ** -0.5,
            "ring": rnd(3, window + 8, dim), "seq_slots": i32([2, 0]), "cache": None, "block_table": None,
            "ratio": ratio, "block_size": block_size, "topk": None, "rope_cos": None, "rope_sin": None}
    if comp != "none":
        args["cache"] = rnd(2 * nblk, per_block, dim)
        args["block_table"] = bt
    if comp == "topk":
        rows = []
        for p in pos:
            vis = (p + 1) // ratio
            sel = torch.randperm(vis, generator=g)[:topk] if vis else torch.zeros(0, dtype=torch.long)
            rows.append(torch.cat([sel, sel.new_full((topk - sel.numel(),), -1)]))
        args["topk"] = torch.stack(rows).to(device=device, dtype=torch.int32)
    if rope:
        rd = min(64, dim // 2)
        ang = torch.tensor(pos, dtype=torch.float32)[:, None] * (160000.0 ** (-torch.arange(0, rd, 2) / rd))[None, :]
        args["rope_cos"], args["rope_sin"] = ang.cos().to(device), ang.sin().to(device)
    args["out"] = torch.empty(new + 1, heads, dim, device=device, dtype=dtype)
    return args
