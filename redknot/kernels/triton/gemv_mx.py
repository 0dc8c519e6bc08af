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

MXFP4 experts (``moe_gemv``): one program per (token, slot) pair, column block and K slice, the pair's
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

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.dequant_mx import as_bytes, fp8_qdq_groups, qdq_bf16
from redknot.kernels.triton.moe_stream_fp8 import _HI_PTX, _LO_PTX
from redknot.kernels.triton.quant_mx import e8m0_decode


def _use_asm() -> bool:
    """Inline PTX when the kernels are compiled; Triton's CPU interpreter runs the byte arithmetic."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# Rows up to which the GEMV streams are candidates (each row is its own accumulator set).
MAX_ROWS = 4
# Programs a launch aims for at least (132 SMs, several programs each so that loads overlap).
TARGET_PROGRAMS = 6 * 132


@dataclass(frozen=True)
class GemvPlan:
    """Launch shape: ``block_n`` weight rows per program (dense: a divisor of the scale tile), ``block_k``
    weight bytes per row per K step (16 per thread and row: ``block_n · block_k / (512 · num_warps)`` rows
    per thread), ``min_steps`` K steps per slice at least (fewer slices: less partial traffic, a longer
    load pipeline per program)."""
    block_n: int = 32
    block_k: int = 256
    min_steps: int = 2
    num_warps: int = 4
    num_stages: int = 1
    w2_block_n: int = 0  # MoE: another column block for W2 (one weight per program: fewer rows per thread)
    direct: bool = False  # MoE: ``_gemv_fp4d`` (activations and scales loaded in the weights' register layout)
    fuse: bool = False  # MoE, direct: the SwiGLU in the W1 | W3 launch, the combine in W2's (one K slice each)
    ksplits: int = 0  # MoE: K slices of every launch of this plan, whatever the pairs (0: ``slices``' rule)
    w2_block_k: int = 0  # MoE: another K step for W2 (0: block_k)
    depth: int = 1  # MoE, direct: K steps of weights and scales loaded ahead (1 or 2)


# The small-row tuners' GEMV candidates by name (strings: the tuning store keeps names): ``gemv*`` dense FP8
# (``gemm_mx.LINEAR_SMALL_TUNER``), ``moe_gemv*`` MXFP4 experts (``moe_mx.SMALL_TUNER``; block_k in packed bytes).
PLANS = {"gemv": GemvPlan(32, 256), "gemv_n16": GemvPlan(16, 512), "gemv_k128": GemvPlan(32, 128),
         "moe_gemv": GemvPlan(16, 256, w2_block_n=32), "moe_gemv_n16": GemvPlan(16, 128, w2_block_n=32),
         "moe_gemv_k128": GemvPlan(32, 128),
         # ``_gemv_fp4d`` with fixed K slices (W1 | W3: 2 / 1 at 32 rows, 4 / 2 at 64; W2 one), so that a token's
         # sums do not depend on how many tokens share the call (``slices`` counts the pairs' column blocks)
         "moe_gemv_d": GemvPlan(32, 128, w2_block_n=32, direct=True, ksplits=2),
         "moe_gemv_d1": GemvPlan(32, 128, w2_block_n=32, direct=True, ksplits=1),
         "moe_gemv_d64": GemvPlan(64, 128, w2_block_n=32, direct=True, ksplits=4),
         "moe_gemv_d64_2": GemvPlan(64, 128, w2_block_n=32, direct=True, ksplits=2),
         # ``moe_gemv_d1`` with the SwiGLU and the combine in the GEMV launches (``_gemv_fp4d``'s EPI): three
         # launches instead of five
         "moe_gemv_f": GemvPlan(32, 128, w2_block_n=32, direct=True, fuse=True, ksplits=1),
         # W2 at 64 x 64 (480 programs of 18 steps at one token, 76 regs: one wave) instead of 32 x 128 (960 of 9)
         "moe_gemv_f_w64": GemvPlan(32, 128, w2_block_n=64, direct=True, fuse=True, ksplits=1, w2_block_k=64),
         # ``moe_gemv_f`` with two K steps in flight per program (more bytes in flight an SM, more registers)
         "moe_gemv_f_p2": GemvPlan(32, 128, w2_block_n=32, direct=True, fuse=True, ksplits=1, depth=2)}


# One 32-bit word of 4 e4m3 bytes (K positions 4i..4i+3, little-endian) -> their 4 fp32 values: two packed
# e4m3x2 -> f16x2 conversions and four f16 -> f32 ones (every e4m3 value is an f16 normal or zero: exact).
_E4M3X4_PTX = tl.constexpr(
    "{ .reg .b16 l, h, a0, a1, b0, b1; .reg .b32 a, b; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
    "cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b; cvt.f32.f16 $0, a0; "
    "cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }")


@triton.jit
def _e4m3x4(wd, USE_ASM: tl.constexpr):
    """int32 words of 4 e4m3 bytes -> the 4 values as fp32 tensors (bytes 0, 1, 2, 3)."""
    if USE_ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(_E4M3X4_PTX, "=r,=r,=r,=r,r", [wd],
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
    else:  # the interpreter: the bytes themselves, bitcast
        v0 = (wd & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v1 = ((wd >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v2 = ((wd >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v3 = ((wd >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v0, v1, v2, v3


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


# ---------------------------------------------------------------------- MXFP4 experts
@triton.jit
def _fp4x8(wd, USE_ASM: tl.constexpr):
    """int32 words of 8 e2m1 codes (K positions 8i..8i+7; byte b: 2b in its low nibble, 2b+1 in its high one)
    -> 8 fp32 tensors, each the e2m1 value times 2^-6: the codes become e4m3 bytes by word arithmetic
    (``moe_stream_fp8``'s PTX: low nibbles, then high ones), then ``_e4m3x4``. Order: K 8i+0, 2, 4, 6, then
    8i+1, 3, 5, 7."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_LO_PTX, "=r,r", [wd], dtype=tl.int32, is_pure=True, pack=1)
        hi = tl.inline_asm_elementwise(_HI_PTX, "=r,r", [wd], dtype=tl.int32, is_pure=True, pack=1)
    else:  # the same bits (0x80808080 as int32: -2139062144)
        lo = ((wd & 0x08080808) << 4) | ((wd & 0x07070707) << 2)
        hi = (wd & -2139062144) | ((wd >> 2) & 0x1C1C1C1C)
    a0, a1, a2, a3 = _e4m3x4(lo, USE_ASM)
    b0, b1, b2, b3 = _e4m3x4(hi, USE_ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _scale64(sb):
    """E8M0 bytes -> 2^(s - 127) · 2^6 from the exponent bits alone (byte 0 gives 2^-121, a normal fp32;
    ``e8m0_decode(s) · 64`` for every byte up to 248, both infinite above)."""
    return ((sb.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_acc(acc, wd, sc, x0, x1, x2, x3, USE_ASM: tl.constexpr):
    """acc [BN, W] + (Σ of a word's 8 exact products) · sc: x_p [W] int32 holds the bf16 pair of K 8i+2p
    (low half) and 8i+2p+1 (high half)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _fp4x8(wd, USE_ASM)
    part = a0 * (x0 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b0 * (x0 & -65536).to(tl.float32, bitcast=True)[None, :]
    part += a1 * (x1 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b1 * (x1 & -65536).to(tl.float32, bitcast=True)[None, :]
    part += a2 * (x2 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b2 * (x2 & -65536).to(tl.float32, bitcast=True)[None, :]
    part += a3 * (x3 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b3 * (x3 & -65536).to(tl.float32, bitcast=True)[None, :]
    return acc + part * sc


@triton.jit
def _gemv_fp4(x_ptr, ids_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, N, KW, KSPLIT, stride_x, stride_be,
              stride_bn, stride_sbe, stride_sbn, stride_ps, stride_pm, TOPK: tl.constexpr, DUAL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """One program: expert pair ``program_id(0)`` (its expert ``ids[pair]``, activation row ``pair // TOPK``,
    bf16 pairs read as int32), BLOCK_N weight rows over one K slice of KSPLIT packed bytes read as int32
    words [N, KW] (8 values a word, 16 bytes per thread and row a step; 4 words = one 32-wide group, its
    E8M0 scale times 2^6 applied to each word's 8-product sum); fp32 partials per slice. ``DUAL``: W1 and
    W3 over the same activations. One step of register prefetch."""
    W: tl.constexpr = BLOCK_K // 4
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    xrow = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    i = tl.max_contiguous(tl.arange(0, W), W)
    wrow = b_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    w3row = b3_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    srow = sb_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    s3row = sb3_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    xoff = tl.reshape(4 * i[:, None] + tl.arange(0, 4)[None, :], (W, 2, 2))
    k_lo = tl.program_id(2) * (KSPLIT // 4)
    k_hi = tl.minimum(KW, k_lo + KSPLIT // 4)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    acc3 = tl.zeros([BLOCK_N, W], tl.float32)
    k0 = tl.multiple_of(k_lo, W)
    w = tl.load(wrow + k0, mask=cmask[:, None], other=0)
    sb = tl.load(srow + k0 // 4, mask=cmask[:, None], other=127)
    w3 = w
    sb3 = sb
    if DUAL:
        w3 = tl.load(w3row + k0, mask=cmask[:, None], other=0)
        sb3 = tl.load(s3row + k0 // 4, mask=cmask[:, None], other=127)
    for k_step in range(k_lo, k_hi, W):
        k1 = tl.multiple_of(tl.minimum(k_step + W, k_hi - W), W)
        w_n = tl.load(wrow + k1, mask=cmask[:, None], other=0)
        sb_n = tl.load(srow + k1 // 4, mask=cmask[:, None], other=127)
        w3_n = w_n
        sb3_n = sb_n
        if DUAL:
            w3_n = tl.load(w3row + k1, mask=cmask[:, None], other=0)
            sb3_n = tl.load(s3row + k1 // 4, mask=cmask[:, None], other=127)
        xv = tl.load(xrow + 4 * k_step + xoff)  # [W, 2, 2]: pairs 4i + 2a + b
        xe, xo = tl.split(xv)  # b = 0: pairs 4i, 4i+2; b = 1: 4i+1, 4i+3
        x0, x2 = tl.split(xe)
        x1, x3 = tl.split(xo)
        acc = _fp4_acc(acc, w, _scale64(sb), x0, x1, x2, x3, USE_ASM)
        if DUAL:
            acc3 = _fp4_acc(acc3, w3, _scale64(sb3), x0, x1, x2, x3, USE_ASM)
        w, sb, w3, sb3 = w_n, sb_n, w3_n, sb3_n
    out = p_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols
    tl.store(out, tl.sum(acc, 1), mask=cmask)
    if DUAL:
        tl.store(p3_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols,
                 tl.sum(acc3, 1), mask=cmask)


# One byte (an E8M0 scale) and one 16-byte vector (four int32 words of bf16 pairs) as elementwise PTX loads: their
# results take the layout of the address tensor (the weight words'), where ``tl.load`` would get a layout of its
# own from the address pattern and a conversion through shared memory before the weight arithmetic.
_LD_U8_PTX = tl.constexpr("ld.global.nc.u8 $0, [$1];")
_LD_V4_PTX = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _ld_scale64(ptr, USE_ASM: tl.constexpr):
    """E8M0 bytes at ``ptr`` -> ``_scale64`` of them, in the layout of ``ptr``."""
    if USE_ASM:
        b = tl.inline_asm_elementwise(_LD_U8_PTX, "=r,l", [ptr.to(tl.int64)], dtype=tl.int32, is_pure=True, pack=1)
    else:
        b = tl.load(ptr).to(tl.int32)
    return ((b + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ld_x4(ptr, USE_ASM: tl.constexpr):
    """The int32 words ptr[0..3] (16-byte aligned) in the layout of ``ptr``: one vector load per element."""
    if USE_ASM:
        x0, x1, x2, x3 = tl.inline_asm_elementwise(_LD_V4_PTX, "=r,=r,=r,=r,l", [ptr.to(tl.int64)],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
    else:
        x0 = tl.load(ptr)
        x1 = tl.load(ptr + 1)
        x2 = tl.load(ptr + 2)
        x3 = tl.load(ptr + 3)
    return x0, x1, x2, x3


@triton.jit
def _fp4_acc2(acc, wd, sc, x0, x1, x2, x3, USE_ASM: tl.constexpr):
    """``_fp4_acc`` with the activation words x_p already [BN, W] (the weight words' layout)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _fp4x8(wd, USE_ASM)
    part = a0 * (x0 << 16).to(tl.float32, bitcast=True)
    part += b0 * (x0 & -65536).to(tl.float32, bitcast=True)
    part += a1 * (x1 << 16).to(tl.float32, bitcast=True)
    part += b1 * (x1 & -65536).to(tl.float32, bitcast=True)
    part += a2 * (x2 << 16).to(tl.float32, bitcast=True)
    part += b2 * (x2 & -65536).to(tl.float32, bitcast=True)
    part += a3 * (x3 << 16).to(tl.float32, bitcast=True)
    part += b3 * (x3 & -65536).to(tl.float32, bitcast=True)
    return acc + part * sc


@triton.jit
def _ld_step(wrow, srow, w3row, s3row, k, DUAL: tl.constexpr, USE_ASM: tl.constexpr):
    """``_gemv_fp4d``'s loads of step ``k``: the weight words and scales (W3's with ``DUAL``, else W1's again)."""
    w = tl.load(wrow + k)
    sc = _ld_scale64(srow + k // 4, USE_ASM)
    w3 = w
    sc3 = sc
    if DUAL:
        w3 = tl.load(w3row + k)
        sc3 = _ld_scale64(s3row + k // 4, USE_ASM)
    return w, sc, w3, sc3


@triton.jit
def _gemv_fp4d(x_ptr, ids_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, N, KW, KSPLIT, stride_x, stride_be,
               stride_bn, stride_sbe, stride_sbn, stride_ps, stride_pm, TOPK: tl.constexpr, DUAL: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, wt_ptr=None, act_ptr=None,
               stride_a=0, limit=0.0, cnt_ptr=None, out_ptr=None, stride_o=0, EPI: tl.constexpr = 0,
               SLOTS: tl.constexpr = 1, DEPTH: tl.constexpr = 1):
    """``_gemv_fp4``'s program (the same products and 8-product word sums) with every load in the weight words' [BN, W]
    register layout: the scales one byte per (row, word) from an elementwise PTX load (one load per thread, row
    and group after CSE) and the activations one 16-byte PTX load per word (the pairs 4i..4i+3; one per thread
    and word, shared by its rows and by W1 | W3). ``tl.load`` gives both a layout of their own (the scales'
    addresses repeat along K, the activations' are 4 words apart), and ``_gemv_fp4`` converts the activations
    and every step's 8-product sums through shared memory (sm_90a, W1 | W3 at 16 x 128: 12 LDS, 8 STS, 6 BAR
    of 365 SASS a step; here none, 294; at 32 x 128 527 for 8 KB against 623). The final sum over a row's
    words follows this layout's tree (another fp32 order than ``_gemv_fp4``'s). Rows past N read row N-1 (stored
    nowhere): no masks. Activation rows 16-byte aligned. Not measured on the H200.

    One K slice only (the grid's third dimension 1), ``EPI`` runs the next launch's code for the program's columns:
    1 (W1 | W3, BLOCK_N a multiple of 32): ``splitk_mx._reduce_swiglu``'s math on the two sums (bf16 roundings,
    clamps, SiLU, the pair's routing weight ``wt``) and the W2 input's per-32 FP8 QDQ, stored as bf16 rows
    ``act`` [P, N], instead of the partials; 2 (W2): the pair's sums stored, a barrier, one acquire-release
    increment of the (token, column block) counter; the program that takes it to ``SLOTS`` (every slot of the
    token stored) zeroes it and runs ``splitk_mx._reduce_combine`` for the block (each slot rounded to bf16, added
    in slot order, the slots' sums from L2) into ``out`` [T, N]. The bits of the separate launches."""
    W: tl.constexpr = BLOCK_K // 4
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    xrow = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = tl.minimum(cols, N - 1).to(tl.int64)
    i = tl.max_contiguous(tl.arange(0, W), W)
    wrow = b_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    w3row = b3_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    srow = sb_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    s3row = sb3_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    xw = xrow + 4 * i[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
    k_lo = tl.program_id(2) * (KSPLIT // 4)
    k_hi = tl.minimum(KW, k_lo + KSPLIT // 4)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    acc3 = tl.zeros([BLOCK_N, W], tl.float32)
    k0 = tl.multiple_of(k_lo, W)
    w, sc, w3, sc3 = _ld_step(wrow, srow, w3row, s3row, k0, DUAL, USE_ASM)
    # DEPTH 2: the step after the next one also in flight (its words and scales in registers one step early)
    kb = tl.multiple_of(tl.minimum(k0 + W, k_hi - W), W)
    wb = w
    scb = sc
    w3b = w
    sc3b = sc
    if DEPTH == 2:
        wb, scb, w3b, sc3b = _ld_step(wrow, srow, w3row, s3row, kb, DUAL, USE_ASM)
    for k_step in range(k_lo, k_hi, W):
        # the next step (DEPTH 1) or the one after it (2); past the slice's end its last step again (an L2 hit)
        k1 = tl.multiple_of(tl.minimum(k_step + DEPTH * W, k_hi - W), W)
        w_n, sc_n, w3_n, sc3_n = _ld_step(wrow, srow, w3row, s3row, k1, DUAL, USE_ASM)
        x0, x1, x2, x3 = _ld_x4(xw + 4 * k_step, USE_ASM)
        acc = _fp4_acc2(acc, w, sc, x0, x1, x2, x3, USE_ASM)
        if DUAL:
            acc3 = _fp4_acc2(acc3, w3, sc3, x0, x1, x2, x3, USE_ASM)
        if DEPTH == 2:
            w, sc, w3, sc3 = wb, scb, w3b, sc3b
            wb, scb, w3b, sc3b = w_n, sc_n, w3_n, sc3_n
        else:
            w, sc, w3, sc3 = w_n, sc_n, w3_n, sc3_n
    if EPI == 1:
        g = tl.minimum(tl.sum(acc, 1).to(tl.bfloat16).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(tl.sum(acc3, 1).to(tl.bfloat16).to(tl.float32), -limit), limit)
        a = (g / (1.0 + tl.exp(-g)) * u * tl.load(wt_ptr + pair)).to(tl.bfloat16).to(tl.float32)
        v = fp8_qdq_groups(tl.reshape(a, (1, BLOCK_N)), 1, BLOCK_N).to(tl.bfloat16)
        tl.store(act_ptr + pair.to(tl.int64) * stride_a + cols[None, :], v, mask=cmask[None, :])
    else:
        out = p_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols
        tl.store(out, tl.sum(acc, 1), mask=cmask)
        if DUAL:
            tl.store(p3_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols,
                     tl.sum(acc3, 1), mask=cmask)
        if EPI == 2:
            tl.debug_barrier()   # every thread's sums stored before the release
            tok = pair // SLOTS
            cnt = cnt_ptr + tok * tl.num_programs(1) + tl.program_id(1)
            done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if done == SLOTS - 1:
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
                comb = tl.zeros([BLOCK_N], tl.float32)
                for j in tl.static_range(SLOTS):  # slot order
                    y = tl.load(p_ptr + (tok * SLOTS + j).to(tl.int64) * stride_pm + cols, mask=cmask, other=0.0,
                                cache_modifier=".cg")
                    comb += y.to(tl.bfloat16).to(tl.float32)
                tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, comb.to(out_ptr.dtype.element_ty), mask=cmask)


def gemv_fp4(x: torch.Tensor, ids: torch.Tensor, topk: int, w: torch.Tensor, ws: torch.Tensor, plan: GemvPlan,
             w3=None, ws3=None, act=None, wt=None, limit: float = 0.0, out=None, slots: int = 1):
    """fp32 partials [S, P, N] (and W3's with ``w3``) of pair p's activation row ``x[p // topk]`` (QDQ'd bf16
    [R, K]) times expert ``ids[p]``'s packed MXFP4 weight ``w`` [E, N, K/2] with E8M0 ``ws`` [E, N, K/32].
    ``plan.direct``: ``_gemv_fp4d`` (the same products and per-word sums; a row's words added in the tree of another
    register layout; activation rows not 16-byte aligned: ``_gemv_fp4``). Where :func:`fusable`: ``act`` (with
    ``w3``, the routing weights ``wt`` [P] fp32, the clamp ``limit``) receives the W2 input rows [P, N] bf16, or
    ``out`` (without ``w3``; ``slots`` pairs a token) the combined rows [P / slots, N]; no partials (None)."""
    P = ids.numel()
    w, ws = as_bytes(w), as_bytes(ws)
    N, KH = w.shape[1], w.shape[2]
    S, ksplit = fp4_slices(N, KH, P, plan)
    dual = w3 is not None
    epi = 1 if act is not None else 2 if out is not None else 0
    if epi and not fusable(x, N, KH, P, plan, dual):
        raise ValueError(f"gemv_fp4: the fused epilogue needs one K slice, a direct plan and aligned rows ({plan})")
    p = torch.empty(S, P, N, dtype=torch.float32, device=x.device) if epi != 1 else None
    p3 = torch.empty_like(p) if dual and not epi else p
    if P:
        bk = _block_k(KH, plan.block_k, 16)
        w3b = as_bytes(w3) if dual else w
        s3b = as_bytes(ws3) if dual else ws
        wv, w3v = w.view(torch.int32), w3b.view(torch.int32)
        # the direct loads read 16-byte vectors of the activation rows: their start and row stride aligned
        kernel = _gemv_fp4d if plan.direct and _aligned(x) else _gemv_fp4
        grid = (P, cdiv(N, plan.block_n), S)
        args = [x.view(torch.int32), ids, wv, ws, w3v, s3b, p if p is not None else act,
                p3 if p3 is not None else act, N, KH // 4, ksplit, x.stride(0) // 2, wv.stride(0), wv.stride(1),
                ws.stride(0), ws.stride(1), p.stride(0) if p is not None else 0, p.stride(1) if p is not None else 0]
        meta = {"TOPK": topk, "DUAL": dual, "BLOCK_N": plan.block_n, "BLOCK_K": bk, "USE_ASM": _use_asm(),
                "num_warps": plan.num_warps, "num_stages": plan.num_stages}
        if kernel is _gemv_fp4d:
            meta["DEPTH"] = plan.depth
        if epi == 1:
            kernel[grid](*args, wt_ptr=wt, act_ptr=act, stride_a=act.stride(0), limit=float(limit), EPI=1, **meta)
        elif epi == 2:
            kernel[grid](*args, cnt_ptr=_counters(x.device, out.shape[0] * grid[1]), out_ptr=out,
                         stride_o=out.stride(0), EPI=2, SLOTS=slots, **meta)
        else:
            kernel[grid](*args, **meta)
    if epi:
        return None
    return (p, p3) if dual else p


def fp4_slices(N: int, KH: int, P: int, plan: GemvPlan) -> tuple:
    """(slice count, slice width in packed bytes) of a ``gemv_fp4`` launch over P pairs of [N, KH] weights:
    ``plan.ksplits`` slices (a function of the weight and the plan only), else ``slices`` over the pairs' column
    blocks (the count depends on P where the pairs' blocks stay under ``TARGET_PROGRAMS``)."""
    if not plan.ksplits:
        return slices(N * max(P, 1), KH, plan, least=16)  # the pairs multiply the column blocks
    bk = _block_k(KH, plan.block_k, 16)
    steps = cdiv(KH, bk)
    ksplit = cdiv(steps, min(plan.ksplits, steps)) * bk
    return cdiv(KH, ksplit), ksplit


def _aligned(x: torch.Tensor) -> bool:
    return x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(-1) == 1


def fusable(x: torch.Tensor, N: int, KH: int, P: int, plan: GemvPlan, dual: bool) -> bool:
    """Whether ``gemv_fp4`` runs this launch with its next launch's code (``plan.fuse``): a direct plan on
    16-byte aligned rows, one K slice, and for W1 | W3 column blocks on the per-32 QDQ groups."""
    return (plan.fuse and plan.direct and _aligned(x) and fp4_slices(N, KH, P, plan)[0] == 1
            and (not dual or (plan.block_n % 32 == 0 and N % 32 == 0)))


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 (token, column block) counters of the fused W2 launch (each launch leaves them zero again;
    launches run one after another on one stream). Kept for the process: a CUDA graph may capture them."""
    key = (device.type, device.index)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


def moe_gemv(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
             plan: GemvPlan = GemvPlan()) -> torch.Tensor:
    """``moe_mx`` for a few tokens as GEMV streams over the (token, slot) pairs in their own order (no sort):
    W1 | W3 of each pair's expert against its token's QDQ'd row, ``splitk_mx.reduce_swiglu`` (clamped SwiGLU,
    routing weight, bf16 rounding, the W2 input's per-32 FP8 QDQ), W2 against each pair's row,
    ``splitk_mx.reduce_combine`` (each slot rounded to bf16, a token's slots added in slot order). ``plan.fuse``:
    the SwiGLU in the W1 | W3 launch and the combine in the W2 launch where :func:`fusable` (the same bits)."""
    from redknot.kernels.triton.splitk_mx import reduce_combine, reduce_swiglu
    T, k = topk_idx.shape
    inter, D = w1.shape[1], w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    ids = topk_idx.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    wt = topk_weight.reshape(-1).float().contiguous()
    xq = qdq_bf16(x)
    act = torch.empty(T * k, inter, dtype=torch.bfloat16, device=x.device)
    if fusable(xq, inter, w1.shape[2], T * k, plan, True):  # SwiGLU in the W1 | W3 launch
        gemv_fp4(xq, ids, k, w1, w1_scale, plan, w3, w3_scale, act=act, wt=wt, limit=swiglu_limit)
    else:
        p1, p3 = gemv_fp4(xq, ids, k, w1, w1_scale, plan, w3, w3_scale)
        reduce_swiglu(p1, p3, wt, swiglu_limit, act, split=False)
    plan2 = GemvPlan(plan.w2_block_n, plan.w2_block_k or plan.block_k, plan.min_steps, plan.num_warps,
                     plan.num_stages, direct=plan.direct, fuse=plan.fuse, ksplits=min(plan.ksplits, 1),
                     depth=plan.depth) if plan.w2_block_n else plan
    if fusable(act, D, w2.shape[2], T * k, plan2, False):  # the combine in the W2 launch
        gemv_fp4(act, ids, 1, w2, w2_scale, plan2, out=out, slots=k)
        return out
    p2 = gemv_fp4(act, ids, 1, w2, w2_scale, plan2)
    inv = torch.arange(T * k, dtype=torch.int32, device=x.device)
    return reduce_combine(p2, inv, k, out)
