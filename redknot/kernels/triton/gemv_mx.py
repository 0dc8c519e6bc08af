"""Weight streams shaped as GEMVs for 1-4 activation rows (decode at batch 1-4) on CUDA cores.

At one to four rows a V4.1 linear or expert GEMM is a pure weight stream: every weight byte is used once
per row, so the floor is the weight's bytes over HBM bandwidth, and the tensor-core streams
(``splitk_mx``, ``stream_fp8``, ``moe_stream*``) pad the rows to an MMA tile of 16 (or 4-8) rows. Here each
thread loads 16 consecutive bytes of a weight row (one 16-byte load) for each of ``block_n / 8`` rows per
K step, converts them to fp32 and multiplies them by the activation values of its 16 K positions (the
activations' per-32 FP8 QDQ values, exact in bf16, loaded once per thread and K step for all its weight
rows), adds the 16 exact products per row in fp32, multiplies that half-group sum by the weight's E8M0
scale (a power of two: exact) and adds it to the row's accumulator; at the end of its K slice the program
adds its accumulators across K positions (a fixed tree) and stores one fp32 partial per K slice (or the
output itself with one slice). A second launch adds the slices in slice order (``splitk_mx.reduce_rows``).

Every product is the reference's exact product; only the fp32 summation order differs from ``ref_v41``
(which the ``linear_mx`` / ``moe_mx`` contracts allow). A row's arithmetic does not depend on how many
rows share the call (the rows are separate accumulators with the same code), so a row alone equals that
row among up to four; the callers take this stream only for calls of at most ``MAX_ROWS`` rows, so above
that a row's bits are those of the tensor-core stream the tuner chose (the same products, another order).

MXFP4 experts (``moe_gemv``): the same loop over packed nibbles: a thread's 16 bytes are 32 e2m1 values
of one row (one whole 32-wide group, one E8M0 scale), decoded through fp16 bit fields (``e2m1_half``:
the value times 2^-14, the 2^14 folded into the group scale), one program per (expert pair, column
block, K slice).

Not measured on the H200: the callers enter these streams as tuner candidates for calls of at most
``MAX_ROWS`` rows, so they run only where the first-use timing finds them faster.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.dequant_mx import as_bytes, qdq_bf16
from redknot.kernels.triton.quant_mx import e2m1_half, e8m0_decode

# Rows up to which the GEMV streams are candidates (each row is its own accumulator set).
MAX_ROWS = 4
# Programs a launch aims for at least (132 SMs, several programs each so that loads overlap).
TARGET_PROGRAMS = 6 * 132


@dataclass(frozen=True)
class GemvPlan:
    """Launch shape: ``block_n`` weight rows per program (each thread ``block_n / (256 / block_k · ...)``
    of them), ``block_k`` weight bytes per row per K step (16 per thread), ``min_steps`` K steps per slice
    at least (fewer slices: less partial traffic, a longer load pipeline per program)."""
    block_n: int = 64
    block_k: int = 256
    min_steps: int = 2
    num_warps: int = 4
    num_stages: int = 1


# The small-row tuners' GEMV candidates by name (strings: the tuning store keeps names): ``gemv*`` dense FP8
# (``gemm_mx.LINEAR_SMALL_TUNER``), ``moe_gemv*`` MXFP4 experts (``moe_mx.SMALL_TUNER``; block_k in packed bytes).
PLANS = {"gemv": GemvPlan(32, 256), "gemv_n16": GemvPlan(16, 256), "gemv_k512": GemvPlan(16, 512),
         "moe_gemv": GemvPlan(32, 256), "moe_gemv_n16": GemvPlan(16, 256), "moe_gemv_k128": GemvPlan(32, 128)}


@triton.jit
def _row_dot(w, xv, sc, acc):
    """acc [BN, G] + (Σ over each 16 K positions of w [BN, BK] · xv [BK]) · sc [BN, G]."""
    BN: tl.constexpr = w.shape[0]
    G: tl.constexpr = w.shape[1] // 16
    return acc + tl.sum(tl.reshape(w * xv.to(tl.float32)[None, :], (BN, G, 16)), 2) * sc


@triton.jit
def _x_rows(x_ptr, stride_x, koff, ROWS: tl.constexpr):
    """The activation values of K positions ``koff`` [BK] for rows 0..3 (rows past ROWS: row 0, unused)."""
    x0 = tl.load(x_ptr + koff)
    x1 = x0
    x2 = x0
    x3 = x0
    if ROWS > 1:
        x1 = tl.load(x_ptr + stride_x + koff)
    if ROWS > 2:
        x2 = tl.load(x_ptr + 2 * stride_x + koff)
    if ROWS > 3:
        x3 = tl.load(x_ptr + 3 * stride_x + koff)
    return x0, x1, x2, x3


@triton.jit
def _gemv_fp8(x_ptr, w_ptr, s_ptr, p_ptr, N, K, KSPLIT, stride_x, stride_w, stride_s, stride_ps, stride_pm,
              WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: BLOCK_N weight rows over one K slice for ROWS activation rows (QDQ'd bf16 [ROWS, K]).
    K and KSPLIT are multiples of BLOCK_K (no K masks). The next K step's weight bytes, scales and
    activations are loaded before the current step's arithmetic (one step of register prefetch)."""
    G: tl.constexpr = BLOCK_K // 16
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    j = tl.arange(0, G)
    kpos = tl.max_contiguous(tl.arange(0, BLOCK_K), BLOCK_K)
    wrow = w_ptr + c64[:, None] * stride_w + kpos[None, :]
    srow = s_ptr + (cols // WB).to(tl.int64)[:, None] * stride_s
    k_lo = tl.program_id(1) * KSPLIT
    k_hi = tl.minimum(K, k_lo + KSPLIT)
    acc0 = tl.zeros([BLOCK_N, G], tl.float32)
    acc1 = tl.zeros([BLOCK_N, G], tl.float32)
    acc2 = tl.zeros([BLOCK_N, G], tl.float32)
    acc3 = tl.zeros([BLOCK_N, G], tl.float32)
    k0 = tl.multiple_of(k_lo, BLOCK_K)
    w = tl.load(wrow + k0, mask=cmask[:, None], other=0.0)
    sb = tl.load(srow + ((k0 + j * 16) // WB)[None, :], mask=cmask[:, None], other=127)
    x0, x1, x2, x3 = _x_rows(x_ptr, stride_x, k0 + kpos, ROWS)
    for k_step in range(k_lo, k_hi, BLOCK_K):
        # the next step (the last step again at the slice's end: an L2 hit, no mask in the address)
        k1 = tl.multiple_of(tl.minimum(k_step + BLOCK_K, k_hi - BLOCK_K), BLOCK_K)
        w_n = tl.load(wrow + k1, mask=cmask[:, None], other=0.0)
        sb_n = tl.load(srow + ((k1 + j * 16) // WB)[None, :], mask=cmask[:, None], other=127)
        y0, y1, y2, y3 = _x_rows(x_ptr, stride_x, k1 + kpos, ROWS)
        wf = w.to(tl.float32)
        sc = e8m0_decode(sb)
        acc0 = _row_dot(wf, x0, sc, acc0)
        if ROWS > 1:
            acc1 = _row_dot(wf, x1, sc, acc1)
        if ROWS > 2:
            acc2 = _row_dot(wf, x2, sc, acc2)
        if ROWS > 3:
            acc3 = _row_dot(wf, x3, sc, acc3)
        w, sb, x0, x1, x2, x3 = w_n, sb_n, y0, y1, y2, y3
    _store_rows(p_ptr, acc0, acc1, acc2, acc3, cols, cmask, stride_ps, stride_pm, ROWS)


@triton.jit
def _store_rows(p_ptr, acc0, acc1, acc2, acc3, cols, cmask, stride_ps, stride_pm, ROWS: tl.constexpr):
    """Each row's accumulators added over the K positions (a fixed tree) -> p[slice, row, cols]."""
    base = p_ptr + tl.program_id(1).to(tl.int64) * stride_ps + cols
    tl.store(base, tl.sum(acc0, 1).to(p_ptr.dtype.element_ty), mask=cmask)
    if ROWS > 1:
        tl.store(base + stride_pm, tl.sum(acc1, 1).to(p_ptr.dtype.element_ty), mask=cmask)
    if ROWS > 2:
        tl.store(base + 2 * stride_pm, tl.sum(acc2, 1).to(p_ptr.dtype.element_ty), mask=cmask)
    if ROWS > 3:
        tl.store(base + 3 * stride_pm, tl.sum(acc3, 1).to(p_ptr.dtype.element_ty), mask=cmask)


def _block_k(K: int, block_k: int, least: int = 32) -> int:
    """The largest power of two up to ``block_k`` that divides K (no K masks), at least ``least``."""
    bk = block_k
    while K % bk:
        bk //= 2
    if bk < least:
        raise ValueError(f"gemv_mx: K={K} must be a multiple of {least}")
    return bk


def slices(N: int, K: int, plan: GemvPlan, least: int = 32) -> tuple:
    """(slice count, slice width) for an [N, K] weight: enough programs for ``TARGET_PROGRAMS`` from the
    column blocks and K slices, each slice at least ``plan.min_steps`` K steps. A function of the weight
    shape and the plan only (not of the rows)."""
    bk = _block_k(K, plan.block_k, least)
    n_blocks = cdiv(N, plan.block_n)
    S = max(1, min(cdiv(TARGET_PROGRAMS, n_blocks), K // (plan.min_steps * bk)))
    ksplit = cdiv(cdiv(K, S), bk) * bk
    return cdiv(K, ksplit), ksplit


def gemv_fp8(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int, out: torch.Tensor,
             plan: GemvPlan = GemvPlan()) -> torch.Tensor:
    """out [M, N] = QDQ_fp8(x2) · dequant(W)ᵀ for M <= ``MAX_ROWS`` bf16 rows x2 [M, K]; W e4m3 [N, K] with
    E8M0 tiles ``ws`` [ceil(N/block), ceil(K/block)] (``linear_mx``'s contract)."""
    M, K = x2.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv_fp8: {M} rows; at most {MAX_ROWS}")
    if M == 0:
        return out
    bk = _block_k(K, plan.block_k)
    if bk < 32 or block % 16:
        raise ValueError(f"gemv_fp8: K={K}, block={block}")
    S, ksplit = slices(N, K, plan)
    xq = qdq_bf16(x2)
    p = out if S == 1 else torch.empty(S, M, N, dtype=torch.float32, device=x2.device)
    _gemv_fp8[(cdiv(N, plan.block_n), S)](
        xq, weight, as_bytes(ws), p, N, K, ksplit, xq.stride(0), weight.stride(0), ws.stride(0),
        p.stride(0) if S > 1 else 0, p.stride(-2), WB=block, ROWS=M, BLOCK_N=plan.block_n, BLOCK_K=bk,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    if S > 1:
        from redknot.kernels.triton.splitk_mx import reduce_rows
        reduce_rows(p, out)
    return out


def self_check(name: str, device: torch.device, seed: int = 1234):
    """None when the GEMV stream ``name`` (``PLANS``) computes what the split-K ``registers`` stream computes
    on fresh random operands, else what differs (``stream_guard``'s first-use check). Dense (``gemv*``): fp32
    sums of the same exact products at one and three rows, within ``stream_guard.CHECK_TOL``; MXFP4 experts
    (``moe_gemv*``): the W1 | W3 fp32 sums within ``CHECK_TOL`` and the whole MoE output within
    ``STREAM_OUT_TOL`` (bf16 roundings of differently ordered sums)."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import splitk_mx
    from redknot.kernels.triton.stream_guard import (
        CHECK_TOL,
        STREAM_OUT_TOL,
        _rel,
        random_moe,
    )
    plan = PLANS[name]
    g = torch.Generator(device=device).manual_seed(seed)
    if name.startswith("moe_gemv"):
        from redknot.kernels.triton import moe_mx
        E, D, inter, T, k = 3, 256, 128, 3, 2
        packed, x = random_moe(g, device, E, D, inter, T)
        idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
        wt = torch.rand(T, k, generator=g, device=device) + 0.1
        w1, s1, w3, s3 = packed[:4]
        got = gemv_fp4(qdq_bf16(x), idx.reshape(-1).contiguous(), k, w1, s1, plan, w3, s3)
        flat = idx.reshape(-1)
        want = [torch.stack([(qdq_bf16(x)[p // k].double() @ mx.dequant_mxfp4(w[flat[p]], s[flat[p]]).double().t())
                             for p in range(T * k)]) for w, s in ((w1, s1), (w3, s3))]
        worst = max(_rel(got[i].sum(0), want[i]) for i in range(2))
        if worst > CHECK_TOL:
            return f"W1 | W3 sums differ from the exact products' sums by {worst:.3g} (tolerance {CHECK_TOL:g})"
        err = _rel(moe_gemv(x, idx, wt, *packed, 10.0, plan), moe_mx.moe_splitk(x, idx, wt, *packed, 10.0,
                                                                               decode="registers"))
        return None if err <= STREAM_OUT_TOL else (f"MoE output differs from decode='registers' by {err:.3g} "
                                                   f"(tolerance {STREAM_OUT_TOL:g})")
    N, K, block = 96, 1024, 32
    w, ws = mx.quant_fp8_blocks(torch.randn(N, K, generator=g, device=device) * 0.02, block)
    worst = 0.0
    for rows in (1, 3):
        x = torch.randn(rows, K, generator=g, device=device).to(torch.bfloat16)
        got = gemv_fp8(x, w, ws, block, torch.empty(rows, N, dtype=torch.float32, device=device), plan)
        want = splitk_mx.splitk_mm(qdq_bf16(x), w, ws, rows, w_fp4=False, wb=block, decode="registers").sum(0)
        worst = max(worst, _rel(got, want))
    return None if worst <= CHECK_TOL else f"differs from decode='registers' by {worst:.3g} (tolerance {CHECK_TOL:g})"


# ---------------------------------------------------------------------- MXFP4 experts
@triton.jit
def _fp4_dot(b_ptr, s_ptr, c64, cmask, k_step, xe, xo, stride_bn, stride_sbn, acc, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """acc [BN, G] + per 32-wide group (16 packed bytes): Σ of the group's 32 exact products (low nibbles x
    even activation columns xe, high nibbles x odd ones xo; [BK] each) times 2^(s - 127) · 2^14 (the 2^-14 of
    ``e2m1_half``)."""
    G: tl.constexpr = BLOCK_K // 16
    kb = tl.max_contiguous(tl.multiple_of(k_step + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    p = tl.load(b_ptr + c64[:, None] * stride_bn + kb[None, :], mask=cmask[:, None], other=0).to(tl.int32)
    lo = e2m1_half(p & 0xF).to(tl.float32)
    hi = e2m1_half((p >> 4) & 0xF).to(tl.float32)
    part = tl.sum(tl.reshape(lo * xe[None, :] + hi * xo[None, :], (BLOCK_N, G, 16)), 2)
    gs = k_step // 16 + tl.arange(0, G)
    sb = tl.load(s_ptr + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None], other=127)
    return acc + part * (e8m0_decode(sb) * 16384.0)


@triton.jit
def _gemv_fp4(x_ptr, ids_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, N, KH, KSPLIT, stride_x, stride_be,
              stride_bn, stride_sbe, stride_sbn, stride_ps, stride_pm, TOPK: tl.constexpr, DUAL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: expert pair ``program_id(0)`` (its expert ``ids[pair]``, activation row ``pair // TOPK``),
    BLOCK_N weight rows over one K slice of packed bytes [k_lo, k_hi) (BLOCK_K bytes = 2·BLOCK_K values a
    step); fp32 partials per slice. ``DUAL``: W1 and W3 in one pass over the same activations."""
    G: tl.constexpr = BLOCK_K // 16
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    xrow = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    bg = b_ptr + e * stride_be
    sg = sb_ptr + e * stride_sbe
    b3g = b3_ptr + e * stride_be
    s3g = sb3_ptr + e * stride_sbe
    k_lo = tl.program_id(2) * KSPLIT
    k_hi = tl.minimum(KH, k_lo + KSPLIT)
    acc = tl.zeros([BLOCK_N, G], tl.float32)
    acc3 = tl.zeros([BLOCK_N, G], tl.float32)
    for k_step in range(k_lo, k_hi, BLOCK_K):
        k0 = tl.multiple_of(k_step, BLOCK_K)
        xk = tl.max_contiguous(tl.multiple_of(2 * k0 + tl.arange(0, 2 * BLOCK_K), 2 * BLOCK_K), 2 * BLOCK_K)
        xe, xo = tl.split(tl.reshape(tl.load(xrow + xk), (BLOCK_K, 2)))
        xe = xe.to(tl.float32)
        xo = xo.to(tl.float32)
        acc = _fp4_dot(bg, sg, c64, cmask, k0, xe, xo, stride_bn, stride_sbn, acc, BLOCK_N, BLOCK_K)
        if DUAL:
            acc3 = _fp4_dot(b3g, s3g, c64, cmask, k0, xe, xo, stride_bn, stride_sbn, acc3, BLOCK_N, BLOCK_K)
    out = p_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols
    tl.store(out, tl.sum(acc, 1), mask=cmask)
    if DUAL:
        tl.store(p3_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols,
                 tl.sum(acc3, 1), mask=cmask)


def gemv_fp4(x: torch.Tensor, ids: torch.Tensor, topk: int, w: torch.Tensor, ws: torch.Tensor, plan: GemvPlan,
             w3=None, ws3=None):
    """fp32 partials [S, P, N] (and W3's with ``w3``) of pair p's activation row ``x[p // topk]`` (QDQ'd bf16
    [R, K]) times expert ``ids[p]``'s packed MXFP4 weight ``w`` [E, N, K/2] with E8M0 ``ws`` [E, N, K/32]."""
    P = ids.numel()
    w, ws = as_bytes(w), as_bytes(ws)
    N, KH = w.shape[1], w.shape[2]
    S, ksplit = slices(N * max(P, 1), KH, plan, least=16)  # the pairs multiply the column blocks
    dual = w3 is not None
    p = torch.empty(S, P, N, dtype=torch.float32, device=x.device)
    p3 = torch.empty_like(p) if dual else p
    if P:
        bk = _block_k(KH, plan.block_k, 16)
        w3b = as_bytes(w3) if dual else w
        s3b = as_bytes(ws3) if dual else ws
        _gemv_fp4[(P, cdiv(N, plan.block_n), S)](
            x, ids, w, ws, w3b, s3b, p, p3, N, KH, ksplit, x.stride(0), w.stride(0), w.stride(1), ws.stride(0),
            ws.stride(1), p.stride(0), p.stride(1), TOPK=topk, DUAL=dual, BLOCK_N=plan.block_n, BLOCK_K=bk,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
    return (p, p3) if dual else p


def moe_gemv(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
             plan: GemvPlan = GemvPlan()) -> torch.Tensor:
    """``moe_mx`` for a few tokens as GEMV streams over the (token, slot) pairs in their own order (no sort):
    W1 | W3 of each pair's expert against its token's QDQ'd row, ``splitk_mx.reduce_swiglu`` (clamped SwiGLU,
    routing weight, bf16 rounding, the W2 input's per-32 FP8 QDQ), W2 against each pair's row,
    ``splitk_mx.reduce_combine`` (each slot rounded to bf16, a token's slots added in slot order)."""
    from redknot.kernels.triton.splitk_mx import reduce_combine, reduce_swiglu
    T, k = topk_idx.shape
    inter, D = w1.shape[1], w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    ids = topk_idx.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    wt = topk_weight.reshape(-1).float().contiguous()
    p1, p3 = gemv_fp4(qdq_bf16(x), ids, k, w1, w1_scale, plan, w3, w3_scale)
    act = torch.empty(T * k, inter, dtype=torch.bfloat16, device=x.device)
    reduce_swiglu(p1, p3, wt, swiglu_limit, act, split=False)
    p2 = gemv_fp4(act, ids, 1, w2, w2_scale, plan)
    inv = torch.arange(T * k, dtype=torch.int32, device=x.device)
    return reduce_combine(p2, inv, k, out)
