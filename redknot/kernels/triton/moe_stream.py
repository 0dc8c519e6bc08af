"""MoE decode as one weight stream per GEMM with the epilogues fused (``StreamPlan``, a ``moe_mx.DECODE_TUNER``
candidate next to the split-K decodes).

At decode sizes (1-128 tokens, top-6 of 384 experts) every touched expert holds one to a few rows: a
step's cost is reading each touched expert's packed FP4 weights once. The split-K streams (``splitk_mx``)
write fp32 partials per K slice and need a reduction launch after each GEMM. Here a program owns one
expert's 16-row tile and ``block_n`` weight columns over all of K (or over a K slice when the plan asks
for slices), so:

* the W1 | W3 program ends with the clamped SwiGLU, the routing weight, the bf16 rounding and the per-32
  FP8 QDQ of the W2 input (no fp32 partials, no ``reduce_swiglu`` launch);
* the W2 program rounds each slot to bf16 in registers; ``reduce_combine`` adds a token's k slots.

Each touched expert's weights are read exactly once per step (one 16-row tile per expert up to 16 rows
routed to it; the rows of an expert share the program). The weight tile is decoded either by
``tl.dot_scaled`` (``decode="scaled"``) or in registers (``decode="regs"``): an e2m1 nibble's magnitude bits
shifted into an fp16's exponent / mantissa field are that value times 2^-14 (code 1 lands on the fp16
subnormal 2^-15, which the fp16 -> fp32 conversion keeps exactly), so the decode is two masks, two
shifts and an or per value, one conversion, and one multiply by ``2^(s-127+14)``, in natural K order (the
two nibbles of a byte joined), for a bf16 MMA with the weight as the first operand. ``decode="fp8"`` runs the
FP8 tensor-core form of the same stream (``moe_stream_fp8``: FP4 -> e4m3 bytes by word arithmetic, the cheapest
decode; the H200 measured the bf16 decode, not the loads or the MMA, as what bounds the ``regs`` stream).

Row tiles are 16 rows and the K slicing depends on the weight shape only: a row's result does not depend
on how many rows share the call (batch invariance). Every product is the reference's exact product
(bf16-exact operands); only the fp32 summation order differs from ``ref_v41.moe_mx``.

``mode`` (benchmarks only): 1 streams the weights and sums the raw bytes (no decode, no MMA), 2 decodes
and sums without the MMA: the rungs that say which part of a program costs the time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.dequant_mx import as_bytes, fp8_qdq_groups
from redknot.kernels.triton.stream_scaled import tile_of

ROW_TILE = 16  # rows per program (fixed: batch invariance)
# fp8: ``moe_stream_fp8`` (FP4 -> e4m3 bytes, FP8 MMA per group); fp8h: ``moe_stream_fp8h`` (the same with each
# group's K elements in halves order: no byte permutes; hidden and intermediate sizes multiples of 128, else fp8);
# fp8hd / fp8hd4: fp8h with 8- / 4-row tiles and one MMA per 4 groups against block-diagonal activations (up to
# 64 columns)
STREAM_DECODES = ("regs", "scaled", "fp8", "fp8h", "fp8hd", "fp8hd4")
FP8_DECODES = ("fp8", "fp8h", "fp8hd", "fp8hd4")


@dataclass(frozen=True)
class StreamPlan:
    """Launch shape of the fused MoE decode stream. ``min_steps`` 0: one K slice per program and the
    epilogues fused; > 0: K slices of at least that many steps (fp32 partials, the split-K reductions).
    ``inline``: each program finds its row tile from the per-expert ends (no tile-map launch).
    ``w2_block_n``: another column block for the W2 GEMM than for W1 | W3."""
    decode: str = "regs"
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    min_steps: int = 0
    inline: bool = False
    w2_block_n: int = 0  # the W2 GEMM's block_n (0: block_n)


@triton.jit
def stream_tile(offs_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, G, pid_m, TILE_INLINE: tl.constexpr,
                BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """(group, first row, group end) of row tile ``pid_m`` of the stream kernels: from the group ends
    (``tile_of``) when TILE_INLINE, else from the tile map (group -1: no tile)."""
    if TILE_INLINE:
        grp, row0, row_end = tile_of(offs_ptr, G, pid_m, BLOCK_M, G_POW2)
    else:
        grp = tl.load(tile_group_ptr + pid_m)
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
    return grp, row0, row_end


@triton.jit
def swiglu_rows(acc, acc3, wt_ptr, rows, rmask, limit):
    """The fused SwiGLU of a tile's W1 | W3 sums (acc / acc3 [BN, BM], rows on the second axis):
    bf16(w · silu(min(g, L)) · clamp(u, ±L)) per row, [BM, BN] as fp32 (g, u rounded to bf16 first)."""
    g = tl.minimum(tl.trans(acc).to(tl.bfloat16).to(tl.float32), limit)
    u = tl.trans(acc3).to(tl.bfloat16).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    wt = tl.load(wt_ptr + rows, mask=rmask, other=0.0)
    return (g / (1.0 + tl.exp(-g)) * u * wt[:, None]).to(tl.bfloat16).to(tl.float32)


@triton.jit
def fp4_tile_bf16(b_ptr, sb_ptr, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """A packed MXFP4 tile [BN, BK/2] bytes with its E8M0 scales [BN, BK/32] -> bf16 [BN, BK] in natural K
    order (element 2i: low nibble of byte i), scales folded in; exact."""
    c = tl.load(b_ptr + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0).to(tl.int32)
    s = tl.load(sb_ptr + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None], other=127).to(tl.int32)
    scale = ((s + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^(s - 127 + 14)
    hlo = ((c & 7) << 9) | ((c & 8) << 12)     # fp16 bits of e2m1 · 2^-14 (low nibble)
    hhi = ((c & 0x70) << 5) | ((c & 0x80) << 8)  # high nibble
    flo = hlo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    fhi = hhi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    flo = tl.reshape(tl.reshape(flo, (BLOCK_N, BLOCK_K // 32, 16)) * scale, (BLOCK_N, BLOCK_K // 2))
    fhi = tl.reshape(tl.reshape(fhi, (BLOCK_N, BLOCK_K // 32, 16)) * scale, (BLOCK_N, BLOCK_K // 2))
    return tl.reshape(tl.join(flo, fhi), (BLOCK_N, BLOCK_K)).to(tl.bfloat16)


@triton.jit
def _stream_mm(a_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, wt_ptr,
               tile_group_ptr, tile_row_ptr, tile_end_ptr, offs_ptr, G, N, K, KSPLIT, limit,
               stride_am, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ps, stride_pm,
               GATHER: tl.constexpr, DUAL: tl.constexpr, EPI: tl.constexpr, DEC: tl.constexpr,
               MODE: tl.constexpr, TILE_INLINE: tl.constexpr, G_POW2: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: an expert's row tile x BN weight columns x one K slice. EPI 0: fp32 partials at slice
    ``pid_s``; 1: SwiGLU + routing weight + bf16 + per-32 FP8 QDQ, bf16 [M, N] (needs DUAL, one slice);
    2: bf16 [M, N] (one slice). DEC 0: registers decode, 1: ``tl.dot_scaled``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    grp, row0, row_end = stream_tile(offs_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, G, pid_m, TILE_INLINE,
                                     BLOCK_M, G_POW2)
    if grp >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        if GATHER:
            arow = tl.load(rowid_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            arow = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        c64 = cols.to(tl.int64)
        bg = b_ptr + grp.to(tl.int64) * stride_bg
        sbg = sb_ptr + grp.to(tl.int64) * stride_sbg
        b3g = b3_ptr + grp.to(tl.int64) * stride_bg
        sb3g = sb3_ptr + grp.to(tl.int64) * stride_sbg
        k_lo = pid_s * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k_step in range(k_lo, k_hi, BLOCK_K):
            k0 = tl.multiple_of(k_step, BLOCK_K)
            kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2), BLOCK_K // 2)
            gs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            if MODE == 1:  # bytes only
                w = tl.load(bg + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
                acc += tl.sum(w.to(tl.int32), 1).to(tl.float32)[:, None]
                if DUAL:
                    w3 = tl.load(b3g + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
                    acc3 += tl.sum(w3.to(tl.int32), 1).to(tl.float32)[:, None]
            elif MODE == 2:  # decode, no MMA
                w = fp4_tile_bf16(bg, sbg, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                acc += tl.sum(w.to(tl.float32), 1)[:, None]
                if DUAL:
                    w3 = fp4_tile_bf16(b3g, sb3g, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                    acc3 += tl.sum(w3.to(tl.float32), 1)[:, None]
            else:
                kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
                a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
                at = tl.trans(a.to(tl.bfloat16))
                if DEC == 1:
                    w = tl.load(bg + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
                    s = tl.load(sbg + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None], other=127)
                    acc = tl.dot_scaled(w, s, "e2m1", at, None, "bf16", acc=acc, fast_math=True)
                    if DUAL:
                        w3 = tl.load(b3g + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
                        s3 = tl.load(sb3g + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None], other=127)
                        acc3 = tl.dot_scaled(w3, s3, "e2m1", at, None, "bf16", acc=acc3, fast_math=True)
                else:
                    w = fp4_tile_bf16(bg, sbg, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                    acc = tl.dot(w, at, acc)
                    if DUAL:
                        w3 = fp4_tile_bf16(b3g, sb3g, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                        acc3 = tl.dot(w3, at, acc3)
        r64 = rows.to(tl.int64)
        omask = rmask[:, None] & cmask[None, :]
        if EPI == 0:
            out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
            tl.store(p_ptr + out, tl.trans(acc), mask=omask)
            if DUAL:
                tl.store(p3_ptr + out, tl.trans(acc3), mask=omask)
        elif EPI == 1:  # the W2 input: QDQ_fp8(bf16(w · silu(min(g, L)) · clamp(u, ±L)))
            act = swiglu_rows(acc, acc3, wt_ptr, rows, rmask, limit)
            v = fp8_qdq_groups(act, BLOCK_M, BLOCK_N).to(tl.bfloat16)
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], v, mask=omask)
        else:
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], tl.trans(acc).to(tl.bfloat16), mask=omask)


def w2_plan(plan: StreamPlan) -> StreamPlan:
    """The launch shape of the W2 GEMM under ``plan``."""
    return replace(plan, block_n=plan.w2_block_n, w2_block_n=0) if plan.w2_block_n else plan


def _block_k(K: int, block_k: int) -> int:
    bk = block_k
    while K % bk:
        bk //= 2
    return bk


def slices(N: int, K: int, plan: StreamPlan) -> int:
    """K slices of an [N, K] weight under ``plan`` (a function of the weight shape only)."""
    if not plan.min_steps:
        return 1
    from redknot.kernels.triton.splitk_mx import split_count
    return split_count(N, K, plan.block_n, _block_k(K, plan.block_k), plan.min_steps)


def stream_gemm(a, w, ws, rows: int, plan: StreamPlan, *, offs, tiles, rowid=None, w3=None, ws3=None, wt=None,
                limit: float = 0.0, epi: int = 0, mode: int = 0):
    """One grouped weight stream over MXFP4 experts ``w`` [G, N, K/2] (scales [G, N, K/32]), rows grouped by
    ``offs``. epi 0: fp32 partials [S, rows, N] (and the W3 ones); 1: the SwiGLU W2 input bf16 [rows, N];
    2: bf16 [rows, N]. ``a``: bf16 QDQ'd rows [R, K] (row r reads ``rowid[r]``)."""
    if plan.decode not in STREAM_DECODES:
        raise ValueError(f"StreamPlan.decode={plan.decode!r}: must be one of {STREAM_DECODES}")
    if plan.decode in FP8_DECODES:
        raise ValueError(f"stream_gemm: decode={plan.decode!r} streams take e4m3 rows (moe_stream_fp8 / fp8h)")
    w, ws = as_bytes(w), as_bytes(ws)
    G, N, K = w.shape[0], w.shape[1], w.shape[2] * 2
    if K % 32:
        raise ValueError(f"stream_gemm: K={K} must be a multiple of 32")
    bn = plan.block_n
    if epi == 1 and bn % 32:
        raise ValueError(f"StreamPlan.block_n={bn}: the fused SwiGLU quantises per 32 columns (a multiple of 32)")
    bk = _block_k(K, plan.block_k)
    S = slices(N, K, plan) if epi == 0 else 1
    ksplit = cdiv(cdiv(K, S), bk) * bk
    S = cdiv(K, ksplit)
    dual = w3 is not None
    if epi == 0:
        p = torch.empty(S, rows, N, dtype=torch.float32, device=a.device)
        p3 = torch.empty_like(p) if dual else p
    else:
        p = torch.empty(rows, N, dtype=torch.bfloat16, device=a.device)
        p3 = p
    if rows == 0:
        return (p, p3) if dual and epi == 0 else p
    if plan.inline:
        n_tiles = cdiv(rows, ROW_TILE) + min(G, rows)
        tg = tr = te = offs
    else:
        tg, tr, te, n_tiles = tiles
    w3g = as_bytes(w3) if dual else w
    s3g = as_bytes(ws3) if dual else ws
    _stream_mm[(n_tiles, cdiv(N, bn), S)](
        a, rowid if rowid is not None else offs, w, ws, w3g, s3g, p, p3, wt if wt is not None else p,
        tg, tr, te, offs, G, N, K, ksplit, float(limit),
        a.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), p.stride(0) if epi == 0 else 0,
        p.stride(-2), GATHER=rowid is not None, DUAL=dual, EPI=epi, DEC=1 if plan.decode == "scaled" else 0,
        MODE=mode, TILE_INLINE=plan.inline, G_POW2=max(16, next_pow2(G)), BLOCK_M=ROW_TILE, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return (p, p3) if dual and epi == 0 else p


def moe_stream(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
               plan: StreamPlan, mode: int = 0) -> torch.Tensor:
    """``moe_mx`` at decode sizes through the fused streams (module docstring): routing kernel (sorted
    pairs, per-expert ends, QDQ'd rows), tile map (unless ``plan.inline``), W1 | W3 with the SwiGLU
    epilogue, W2 with the bf16 slot epilogue, the slot combine. No host sync; CUDA-graph safe."""
    from redknot.kernels.triton.moe_mx import _sorted_pairs
    from redknot.kernels.triton.splitk_mx import reduce_combine, reduce_swiglu, tile_map
    T, k = topk_idx.shape
    E, inter = w1.shape[0], w1.shape[1]
    D = w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    M = T * k
    x = x if x.stride(-1) == 1 else x.contiguous()
    if plan.decode not in STREAM_DECODES:
        raise ValueError(f"StreamPlan.decode={plan.decode!r}: must be one of {STREAM_DECODES}")
    if plan.decode in FP8_DECODES:
        return _moe_stream_fp8(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit,
                               plan, out)
    rows, inv, offs, wt, xq = _sorted_pairs(topk_idx, topk_weight, E, x)
    tiles = None if plan.inline else tile_map(offs, ROW_TILE, M)
    fused1 = slices(inter, D, plan) == 1 and mode == 0
    common = dict(offs=offs, tiles=tiles, mode=mode)
    if fused1:
        act = stream_gemm(xq, w1, w1_scale, M, plan, rowid=rows, w3=w3, ws3=w3_scale, wt=wt, limit=swiglu_limit,
                          epi=1, **common)
    else:
        p1, p3 = stream_gemm(xq, w1, w1_scale, M, plan, rowid=rows, w3=w3, ws3=w3_scale, **common)
        act = torch.empty(M, inter, dtype=torch.bfloat16, device=x.device)
        reduce_swiglu(p1, p3, wt, swiglu_limit, act, split=False)
    plan2 = w2_plan(plan)
    fused2 = slices(D, inter, plan2) == 1
    y = stream_gemm(act, w2, w2_scale, M, plan2, epi=2 if fused2 else 0, **common)
    return reduce_combine(y[None] if fused2 else y, inv, k, out)


def _moe_stream_fp8(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
                    plan: StreamPlan, out: torch.Tensor) -> torch.Tensor:
    """``moe_stream`` with an FP8 decode (``FP8_DECODES``): the token rows quantised to e4m3 + E8M0 once, the
    W1 | W3 epilogue writing the W2 input in that form (one K slice), else partials, ``reduce_swiglu`` and a
    quantisation pass (the QDQ values re-quantise to themselves). The routing kernel writes the quantised token
    rows. ``fp8h`` / ``fp8hd`` / ``fp8hd4`` keep the rows in halves order with fp32 scales
    (``moe_stream_fp8h``; ``fp8hd`` / ``fp8hd4`` in 8- / 4-row tiles) where the hidden and intermediate sizes
    are multiples of 128 and the weight scales allow 32-bit loads, else run the ``fp8`` kernels with the
    plan's launch shape."""
    from redknot.kernels.triton import moe_stream_fp8h as fp8h
    from redknot.kernels.triton.moe_mx import _sorted_pairs
    from redknot.kernels.triton.moe_stream_fp8 import stream_gemm_fp8
    from redknot.kernels.triton.quant_mx import act_quant_mx
    from redknot.kernels.triton.splitk_mx import reduce_combine, reduce_swiglu, tile_map
    T, k = topk_idx.shape
    E, inter, D = w1.shape[0], w1.shape[1], w2.shape[1]
    M = T * k
    halves = plan.decode in ("fp8h", "fp8hd", "fp8hd4") and D % 128 == 0 and inter % 128 == 0 and all(
        fp8h.words_ok(s) for s in (w1_scale, w3_scale, w2_scale))
    gemm = fp8h.stream_gemm_fp8h if halves else stream_gemm_fp8
    rows, inv, offs, wt, xq, xs = _sorted_pairs(topk_idx, topk_weight, E, x, fp8=True, halves=halves)
    rows_per_tile = fp8h.DIAG_ROWS.get(plan.decode, ROW_TILE) if halves else ROW_TILE
    tiles = None if plan.inline else tile_map(offs, rows_per_tile, M)
    common = dict(offs=offs, tiles=tiles)
    if slices(inter, D, plan) == 1:
        aq, sa = gemm(xq, xs, w1, w1_scale, M, plan, rowid=rows, w3=w3, ws3=w3_scale, wt=wt, limit=swiglu_limit,
                      epi=1, **common)
    else:
        p1, p3 = gemm(xq, xs, w1, w1_scale, M, plan, rowid=rows, w3=w3, ws3=w3_scale, **common)
        act = torch.empty(M, inter, dtype=torch.bfloat16, device=x.device)
        aq, sa = act_quant_mx(reduce_swiglu(p1, p3, wt, swiglu_limit, act, split=False))
        aq, sa = (fp8h.halves_order(aq), fp8h.scales_f32(sa)) if halves else (aq, sa)
    plan2 = w2_plan(plan)
    fused2 = slices(D, inter, plan2) == 1
    y = gemm(aq, sa, w2, w2_scale, M, plan2, epi=2 if fused2 else 0, **common)
    return reduce_combine(y[None] if fused2 else y, inv, k, out)
