"""Weight streams shaped as GEMVs for 1-4 activation rows (decode at batch 1-4) on CUDA cores.

At one to four rows a V4.1 linear or expert GEMM is a pure weight stream: every weight byte is used once
per row, so the floor is the weight's bytes over HBM bandwidth, and the tensor-core streams
(``splitk_mx``, ``stream_fp8``, ``moe_stream*``) pad the rows to an MMA tile of 16 (or 4-8) rows and spend
their issue slots on scales, address arithmetic and synchronous scale loads. Here each thread loads 16
consecutive bytes of a weight row (one 16-byte load) for each of its rows per K step, with the next step's
weight, scale and activation loads issued before the current step's arithmetic (one step of register
prefetch), and the programs (column blocks x K slices, about ``TARGET_PROGRAMS``) cover every SM several
times; a second launch adds the K slices' fp32 partials in slice order (``splitk_mx.reduce_rows``; none
when one slice fills the device).

Dense FP8 (``gemv_fp8``): the weight read as int32 words of 4 e4m3 bytes, each word two ``e4m3x2 -> f16x2``
and four ``f16 -> f32`` conversions (inline PTX), then one FFMA per value and row into an elementwise
accumulator; the activations (the per-32 FP8 QDQ values, exact in bf16, read as bf16 pairs) are multiplied
by the weight's power-of-two tile scale once per K step (a program's rows lie in one row of scale tiles),
which gives every product exactly: ``w · (x · 2^s) = (w · 2^s) · x``. The accumulators are added over K
positions once, at the end (a fixed tree).

MXFP4 experts (``moe_gemv``, module ``gemv_fp4_mx``; launch shapes and slice rules in ``gemv_plan``; every
name importable from here): one program per (token, slot) pair, column block and K slice, the pair's
expert weights against its token's row; per 16 bytes (one 32-wide group) the 32 exact products are added
and multiplied by the group's E8M0 scale.

Every product is the reference's exact product; only the fp32 summation order differs from ``ref_v41``
(which the ``linear_mx`` / ``moe_mx`` contracts allow). A row's arithmetic does not depend on how many
rows share the call (the rows are separate accumulators with the same code), so a row alone equals that
row among up to four; the callers take these streams only for calls of at most ``MAX_ROWS`` rows (tuned
per weight shape, ``gemm_mx.LINEAR_SMALL_TUNER`` / ``moe_mx.SMALL_TUNER``), so above that a row's bits are
those of the tensor-core stream (the same products, another order).

Not measured on the H200: the tuners time these streams against the tensor-core streams on first use, so
they run only where they are measured faster.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.dequant_mx import as_bytes, qdq_bf16

# The MXFP4 expert half and the shared plans live in their own modules; every name stays importable from here
# (callers and tests read ``gemv_mx.X``; ``self_check`` reads ``gemv_fp4`` / ``moe_gemv`` from this module's names).
from redknot.kernels.triton.gemv_fp4_mx import (  # noqa: F401
    _aligned,
    _counters,
    _fp4_acc,
    _fp4_acc2,
    _fp4x8,
    _gemv_fp4,
    _gemv_fp4d,
    _ld_scale64,
    _ld_step,
    _ld_x4,
    _scale64,
    fp4_slices,
    fusable,
    gemv_fp4,
    moe_gemv,
)
from redknot.kernels.triton.gemv_plan import (  # noqa: F401
    DEFAULT_PLAN,
    MAX_ROWS,
    PLANS,
    TARGET_PROGRAMS,
    GemvPlan,
    _block_k,
    _e4m3x4,
    _use_asm,
    slices,
)
from redknot.kernels.triton.quant_mx import e8m0_decode


@triton.jit
def _x_words(x_ptr, koff, sc):
    """A row's activation values at K positions 4i..4i+3 (int32 words of bf16 pairs at ``koff`` = 2i, 2i+1:
    [BK/4, 2]) as four fp32 [BK/4] tensors, each times the weight's power-of-two tile scale ``sc`` [BK/4]."""
    xa, xb = tl.split(tl.load(x_ptr + koff))
    x0 = (xa << 16).to(tl.float32, bitcast=True) * sc
    x1 = (xa & -65536).to(tl.float32, bitcast=True) * sc
    x2 = (xb << 16).to(tl.float32, bitcast=True) * sc
    x3 = (xb & -65536).to(tl.float32, bitcast=True) * sc
    return x0, x1, x2, x3


@triton.jit
def _row_fma(acc, w0, w1, w2, w3, x_ptr, koff, sc):
    """acc [BN, BK/4] + Σ_j w_j · x_j (one row's four K positions per word, elementwise: no reduction)."""
    x0, x1, x2, x3 = _x_words(x_ptr, koff, sc)
    return acc + w0 * x0[None, :] + w1 * x1[None, :] + w2 * x2[None, :] + w3 * x3[None, :]


@triton.jit
def _gemv_fp8(x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, stride_x, stride_w, stride_s, stride_ps, stride_pm,
              WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              USE_ASM: tl.constexpr):
    """One program: BLOCK_N weight rows (inside one row of WB x WB scale tiles: BLOCK_N divides WB) over one K
    slice of KSPLIT bytes, for ROWS activation rows (QDQ'd bf16 read as int32 pairs [ROWS, K/2]); the weight
    read as int32 words [N, KW = K/4] (16 bytes per thread and row). The tile scale, one power of two per
    32-wide K group for the whole program, multiplies the activation values (exact: w·(x·2^s) = (w·2^s)·x),
    so every weight word costs two conversions to f16x2, four to f32 and four FFMAs per row into an
    elementwise accumulator, added over K positions once at the end. The next K step's words, scales and
    activations load before the current step's arithmetic (one step of register prefetch)."""
    W: tl.constexpr = BLOCK_K // 4  # words per row and step
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    i = tl.max_contiguous(tl.arange(0, W), W)
    wrow = w_ptr + c64[:, None] * stride_w + i[None, :]
    srow = s_ptr + ((tl.program_id(0) * BLOCK_N) // WB).to(tl.int64) * stride_s
    xoff = tl.reshape(2 * i[:, None] + tl.arange(0, 2)[None, :], (W, 2))
    k_lo = tl.program_id(1) * (KSPLIT // 4)
    k_hi = tl.minimum(KW, k_lo + KSPLIT // 4)
    acc0 = tl.zeros([BLOCK_N, W], tl.float32)
    acc1 = tl.zeros([BLOCK_N, W], tl.float32)
    acc2 = tl.zeros([BLOCK_N, W], tl.float32)
    acc3 = tl.zeros([BLOCK_N, W], tl.float32)
    k0 = tl.multiple_of(k_lo, W)
    w = tl.load(wrow + k0, mask=cmask[:, None], other=0)
    sb = tl.load(srow + (4 * (k0 + i)) // WB)
    for k_step in range(k_lo, k_hi, W):
        # the next step (the last step again at the slice's end: an L2 hit, no mask in the address)
        k1 = tl.multiple_of(tl.minimum(k_step + W, k_hi - W), W)
        w_n = tl.load(wrow + k1, mask=cmask[:, None], other=0)
        sb_n = tl.load(srow + (4 * (k1 + i)) // WB)
        w0, w1, w2, w3 = _e4m3x4(w, USE_ASM)
        sc = e8m0_decode(sb)
        koff = 2 * k_step + xoff
        acc0 = _row_fma(acc0, w0, w1, w2, w3, x_ptr, koff, sc)
        if ROWS > 1:
            acc1 = _row_fma(acc1, w0, w1, w2, w3, x_ptr + stride_x, koff, sc)
        if ROWS > 2:
            acc2 = _row_fma(acc2, w0, w1, w2, w3, x_ptr + 2 * stride_x, koff, sc)
        if ROWS > 3:
            acc3 = _row_fma(acc3, w0, w1, w2, w3, x_ptr + 3 * stride_x, koff, sc)
        w, sb = w_n, sb_n
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


def gemv_fp8(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int, out: torch.Tensor,
             plan: GemvPlan = DEFAULT_PLAN) -> torch.Tensor:
    """out [M, N] = QDQ_fp8(x2) · dequant(W)ᵀ for M <= ``MAX_ROWS`` bf16 rows x2 [M, K]; W e4m3 [N, K] with
    E8M0 tiles ``ws`` [ceil(N/block), ceil(K/block)] (``linear_mx``'s contract)."""
    M, K = x2.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv_fp8: {M} rows; at most {MAX_ROWS}")
    if M == 0:
        return out
    bk = _block_k(K, plan.block_k)
    if block % plan.block_n or block % 32:
        raise ValueError(f"gemv_fp8: block_n={plan.block_n} must divide the scale tile {block} (a multiple of 32)")
    S, ksplit = slices(N, K, plan)
    xq = qdq_bf16(x2)
    p = out if S == 1 else torch.empty(S, M, N, dtype=torch.float32, device=x2.device)
    wb = as_bytes(weight)
    _gemv_fp8[(cdiv(N, plan.block_n), S)](
        xq.view(torch.int32), wb.view(torch.int32), as_bytes(ws), p, N, K // 4, ksplit, xq.stride(0) // 2,
        wb.stride(0) // 4, ws.stride(0), p.stride(0) if S > 1 else 0, p.stride(-2), WB=block, ROWS=M,
        BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=_use_asm(), num_warps=plan.num_warps, num_stages=plan.num_stages)
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
