"""Two decode-size FP8 linears that read the same rows, with their row epilogues, in two launches.

A V4.1 attention layer projects its input ``u`` twice (``wq_a`` -> the q latent, ``wkv`` -> the kv latent) and
the normalised q latent once more (``wq_b`` -> the query heads), each through ``linear_mx`` (at decode sizes
with the ``fp8`` decode: activation quantisation, split-K FP8 weight stream, slice reduction: three launches)
followed by a row kernel (``step_rope_v41.rope_rows``: norm, RoPE, FP4 grid). :func:`proj_rows` runs up to two
such linears over the same rows and their row epilogues in two launches:

* one FP8 weight stream over both weights (``stream_fp8._fp8_stream`` with the rows quantised per 32 inside,
  the bits of ``act_quant_mx``): the column blocks of the first weight, then those of the second, each with
  the K slices ``splitk_mx.splitk_mm`` cuts for its own shape with ``decode="fp8"`` (the same partials);
* one program per output row (a token's head): the slice sum in slice order cast to the row dtype (the bits of
  ``splitk_mx.reduce_rows``) into a scratch row, then ``rope_rows``'s own per-row code on that row (same loads,
  shapes and warps: the same bits).

So the outputs are bit for bit ``rope_rows(linear_mx(x, W), ...)`` with the ``fp8`` decode, which the tests
check. Two launches instead of up to eight; not measured on the H200.

At 1-4 rows (decode at batch 1-4) the first launch may instead be a CUDA-core GEMV over both weights
(:func:`gemv_partials`: ``gemv_mx``'s word-wise FP8 decode, the rows quantised per 32 inside with the bits of
``qdq_bf16``, each weight's K slices as ``gemv_mx.slices`` cuts them), writing the same [S, T, N] fp32 partials
that the same epilogue launch sums: still two launches, and the bits of ``gemv_mx.gemv_fp8`` followed by the
row epilogue (the same exact products as the ``fp8`` stream in another summation order). ``STEP_SMALL_TUNER``
chooses per launch (the weights' shapes) between ``fp8`` (first: taken untimed off the GPU, under capture, with
tuning off), ``gemv_mx.PLANS``' dense shapes and the same shapes with the rows quantised once (``qgemv*``: one
``qdq_bf16`` launch before the stream, which then runs ``gemv_fp8``'s own loop instead of quantising in every
program: 984 SASS instead of 1128 for the two-weight kernel at one row on sm_90a; three launches, the same bits),
timed on one row on the first call outside capture, each GEMV behind its first-use check (:func:`self_check`
through ``stream_guard.first_use``); a launch first met under capture keeps ``fp8`` for the process, so eager
and graph steps compute the same bits. :func:`linear_post` (``STEP_POST_TUNER``) also has ``fpgemv*``: ``pgemv*``
with its epilogue in the stream launch (``_gemv_post``: the last program of each column block, found by an
acquire-release counter, sums the block's slices in slice order and mixes it; one launch, the same bits).
``tuning_cache.small_rows_class()`` False or ``gemm_mx.SMALL_ROWS_CLASS`` False: ``fp8`` always (the bits of
the tensor-core stream at every row count). Not measured on the H200.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv, interpreting, next_pow2
from redknot.kernels.triton.gemv_mx import _e4m3x4, _row_fma
from redknot.kernels.triton.mhc import _post_mix
from redknot.kernels.triton.quant_mx import (
    e2m1_code,
    e2m1_value,
    e8m0_decode,
    e8m0_exponent,
    pow2,
)
from redknot.kernels.triton.step_rope_v41 import _mul_rn

# Rows up to which the step runs these kernels (decode and speculative verify), as the MoE's step kernels.
MAX_ROWS = 16
# The first launch's weight stream at up to ``gemv_mx.MAX_ROWS`` rows, per launch (key: the weights' shapes):
# the ``fp8`` tensor-core stream (first), a ``gemv_mx.PLANS`` dense GEMV shape with the rows quantised inside every
# program, or the same shape with a ``q`` in front: the rows quantised once (``qdq_bf16``, one small launch before
# the stream) and read as ``gemv_mx._gemv_fp8`` reads them, or with a ``p``: each program quantises its K slice of
# the rows first (no launch more), then ``_gemv_fp8``'s loop (module docstring).
GEMV_NAMES = ("gemv", "gemv_n16", "gemv_k128")
STEP_SMALL_TUNER = ConfigTuner("step_proj_small", ["fp8", *GEMV_NAMES, *("q" + n for n in GEMV_NAMES),
                                                   *("p" + n for n in GEMV_NAMES)])
# The shared expert's W2 stream at up to ``gemv_mx.MAX_ROWS`` rows (``step_moe_v41.shared_expert_finish``; key:
# W2's shape): ``fp8`` (first), a ``gemv_mx.PLANS`` dense shape on the quantised SwiGLU rows (a launch before),
# that shape with a ``p``: the W2 launch forms its input itself, or with ``fp``: and runs the finish too (the last
# program of each column block; one launch for W2 and its combine), or with ``f``: ``_swiglu_quant`` then W2 with
# the combine (two launches, no re-read of the W1 | W3 partials per column block).
# ``linear_post``'s launch (wo_b + the mHC post mix): ``STEP_SMALL_TUNER``'s candidates and the ``pgemv*`` shapes
# with the epilogue in the stream launch (``fpgemv*``: the last program of each column block sums its slices and
# mixes the block; one launch instead of two).
STEP_POST_TUNER = ConfigTuner("step_post_small", [*STEP_SMALL_TUNER.candidates, *("fp" + n for n in GEMV_NAMES)])
STEP_W2_TUNER = ConfigTuner("step_w2_small", ["fp8", *GEMV_NAMES, *("p" + n for n in GEMV_NAMES),
                                             *("fp" + n for n in GEMV_NAMES), *("f" + n for n in GEMV_NAMES)])
# A ``STEP_SMALL_TUNER`` candidate every launch takes instead of the tuner's choice (tests and the launch count of
# ``benchmarks/step_kernels_v41.py``); None: the tuner's. The small-row class off still gives ``fp8``.
FORCE_SMALL = None


@triton.jit
def _fp8_tile(a_ptr, b_ptr, sb_ptr, p_ptr, pid_m, pid_n, pid_s, M, N, K, KSPLIT, stride_am, stride_bn, stride_sbn,
              stride_ps, stride_pm, WB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUPS: tl.constexpr):
    """``stream_fp8._fp8_stream`` with A_RAW for one (row tile, column block, K slice)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    wrow = (cols // WB).to(tl.int64) * stride_sbn
    k_lo = pid_s * KSPLIT
    k_hi = tl.minimum(K, k_lo + KSPLIT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k_step in range(k_lo, k_hi, 32 * GROUPS):
        for g in tl.static_range(GROUPS):
            k0 = tl.multiple_of(k_step + 32 * g, 32)
            kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
            x = tl.load(a_ptr + r64[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
            x = x.to(tl.float32)
            e = e8m0_exponent(tl.max(tl.abs(x), 1), 448.0, 1e-4)
            a = tl.minimum(tl.maximum(x * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
            sa = pow2(e)
            w = tl.load(b_ptr + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
            sw = e8m0_decode(tl.load(sb_ptr + wrow + k0 // WB, mask=cmask, other=127))
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
    tl.store(p_ptr + out, tl.trans(acc), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _stream2(a_ptr, M, K, stride_am,
             b0_ptr, sb0_ptr, p0_ptr, N0, KS0, S0, NB0, stride_b0, stride_sb0, stride_p0s, stride_p0m,
             b1_ptr, sb1_ptr, p1_ptr, N1, KS1, S1, stride_b1, stride_sb1, stride_p1s, stride_p1m,
             WB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS0: tl.constexpr,
             GROUPS1: tl.constexpr):
    """Column blocks [0, NB0) stream weight 0 (slices < S0), the rest weight 1 (slices < S1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_n < NB0:
        if pid_s < S0:
            _fp8_tile(a_ptr, b0_ptr, sb0_ptr, p0_ptr, pid_m, pid_n, pid_s, M, N0, K, KS0, stride_am, stride_b0,
                      stride_sb0, stride_p0s, stride_p0m, WB, BLOCK_M, BLOCK_N, GROUPS0)
    else:
        if pid_s < S1:
            _fp8_tile(a_ptr, b1_ptr, sb1_ptr, p1_ptr, pid_m, pid_n - NB0, pid_s, M, N1, K, KS1, stride_am, stride_b1,
                      stride_sb1, stride_p1s, stride_p1m, WB, BLOCK_M, BLOCK_N, GROUPS1)


@triton.jit
def _qdq_words(x_ptr, koff, kbase, sc, W: tl.constexpr):
    """A raw bf16 row's K positions 4i..4i+3 of one K step (int32 words of bf16 pairs at ``koff``: [W, 2], the
    step's first at ``kbase``), QDQ'd per 32 (``qdq_bf16``'s bits) and times the weight's power-of-two tile scale
    ``sc`` [W]: four fp32 [W] tensors, each ``bf16(QDQ(x)) · sc`` exactly (powers of two). The values load as
    ``gemv_mx._x_words`` loads them (the FMA's layout); the groups' maxima from a second load of the same words
    as [W/8 groups, 16] (an L1 hit), so only the per-word exponent changes layout."""
    xa, xb = tl.split(tl.load(x_ptr + koff))
    x0 = (xa << 16).to(tl.float32, bitcast=True)
    x1 = (xa & -65536).to(tl.float32, bitcast=True)
    x2 = (xb << 16).to(tl.float32, bitcast=True)
    x3 = (xb & -65536).to(tl.float32, bitcast=True)
    xg = tl.load(x_ptr + kbase + tl.arange(0, W // 8)[:, None] * 16 + tl.arange(0, 16)[None, :])
    m = tl.maximum(tl.max(tl.abs((xg << 16).to(tl.float32, bitcast=True)), 1),
                   tl.max(tl.abs((xg & -65536).to(tl.float32, bitcast=True)), 1))
    e = e8m0_exponent(m, 448.0, 1e-4)  # [W/8]: one per 32-wide group
    ew = tl.reshape(tl.broadcast_to(e[:, None], (W // 8, 8)), (W,))
    down = pow2(-ew)
    up = pow2(ew) * sc
    q0 = tl.minimum(tl.maximum(x0 * down, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * up
    q1 = tl.minimum(tl.maximum(x1 * down, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * up
    q2 = tl.minimum(tl.maximum(x2 * down, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * up
    q3 = tl.minimum(tl.maximum(x3 * down, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * up
    return q0, q1, q2, q3


@triton.jit
def _row_fma_qdq(acc, w0, w1, w2, w3, x_ptr, koff, kbase, sc, W: tl.constexpr):
    x0, x1, x2, x3 = _qdq_words(x_ptr, koff, kbase, sc, W)
    return acc + w0 * x0[None, :] + w1 * x1[None, :] + w2 * x2[None, :] + w3 * x3[None, :]


@triton.jit
def _qdq_slice(x_ptr, xs_ptr, w_lo, w_hi, HALF: tl.constexpr):
    """One raw bf16 row's words [w_lo, w_hi) (int32 pairs; HALF words a chunk, a multiple of 16) QDQ'd per 32
    (``qdq_bf16``'s bits: the values are exact in bf16, so a value's bf16 bits are its fp32 bits' upper half)
    into the same words at ``xs_ptr``."""
    for wk in range(w_lo, w_hi, HALF):
        offs = wk + tl.arange(0, HALF)
        xw = tl.load(x_ptr + offs)
        v = tl.reshape(tl.join((xw << 16).to(tl.float32, bitcast=True), (xw & -65536).to(tl.float32, bitcast=True)),
                       (HALF // 16, 32))      # K order: word j's low half, then its high half
        e = e8m0_exponent(tl.max(tl.abs(v), 1), 448.0, 1e-4)
        q = tl.minimum(tl.maximum(v * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        lo, hi = tl.split(tl.reshape(q * pow2(e)[:, None], (HALF, 2)))
        word = ((lo.to(tl.int32, bitcast=True) >> 16) & 0xFFFF) | (hi.to(tl.int32, bitcast=True) & -65536)
        tl.store(xs_ptr + offs, word)


@triton.jit
def _fma_rows(acc, w0, w1, w2, w3, x_ptr, koff, kbase, sc, W: tl.constexpr, QX: tl.constexpr):
    """One row's step: QX, rows already QDQ'd (``gemv_mx._row_fma``), else raw rows QDQ'd here."""
    if QX:
        acc = _row_fma(acc, w0, w1, w2, w3, x_ptr, koff, sc)
    else:
        acc = _row_fma_qdq(acc, w0, w1, w2, w3, x_ptr, koff, kbase, sc, W)
    return acc


@triton.jit
def _gemv_tile(x_ptr, w_ptr, s_ptr, p_ptr, pid_n, pid_s, N, KW, KSPLIT, stride_x, stride_w, stride_s, stride_ps,
               stride_pm, WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_ASM: tl.constexpr, QX: tl.constexpr, xs_ptr=None, stride_xs=0):
    """``gemv_mx._gemv_fp8``'s program (column block ``pid_n``, K slice ``pid_s``) on bf16 rows: QX 1, rows already
    quantised per 32 (``qdq_bf16``: ``gemv_fp8``'s own loop); QX 2, raw rows whose K slice the program quantises
    first (:func:`_qdq_slice`) into the scratch rows ``xs_ptr`` (the same words at the same place from every
    program of the slice: identical values), then ``gemv_fp8``'s loop on them; QX 0, raw rows quantised per 32
    inside the loop (:func:`_qdq_words`). Each way the same exact products in the same order as ``gemv_fp8`` on
    ``qdq_bf16(x)``, fp32 partials p[pid_s, row, cols]."""
    W: tl.constexpr = BLOCK_K // 4
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    i = tl.max_contiguous(tl.arange(0, W), W)
    wrow = w_ptr + c64[:, None] * stride_w + i[None, :]
    srow = s_ptr + ((pid_n * BLOCK_N) // WB).to(tl.int64) * stride_s
    xoff = tl.reshape(2 * i[:, None] + tl.arange(0, 2)[None, :], (W, 2))
    k_lo = pid_s * (KSPLIT // 4)
    k_hi = tl.minimum(KW, k_lo + KSPLIT // 4)
    if QX == 2:  # the slice of each row quantised once, stored by every thread, read back after the barrier
        for r in tl.static_range(ROWS):
            _qdq_slice(x_ptr + r * stride_x, xs_ptr + r * stride_xs, 2 * k_lo, 2 * k_hi, BLOCK_K // 2)
        tl.debug_barrier()
        x_ptr = xs_ptr
        stride_x = stride_xs
    acc0 = tl.zeros([BLOCK_N, W], tl.float32)
    acc1 = tl.zeros([BLOCK_N, W], tl.float32)
    acc2 = tl.zeros([BLOCK_N, W], tl.float32)
    acc3 = tl.zeros([BLOCK_N, W], tl.float32)
    k0 = tl.multiple_of(k_lo, W)
    w = tl.load(wrow + k0, mask=cmask[:, None], other=0)
    sb = tl.load(srow + (4 * (k0 + i)) // WB)
    for k_step in range(k_lo, k_hi, W):
        k1 = tl.multiple_of(tl.minimum(k_step + W, k_hi - W), W)  # the next step (the last again at the end)
        w_n = tl.load(wrow + k1, mask=cmask[:, None], other=0)
        sb_n = tl.load(srow + (4 * (k1 + i)) // WB)
        w0, w1, w2, w3 = _e4m3x4(w, USE_ASM)
        sc = e8m0_decode(sb)
        koff = 2 * k_step + xoff
        acc0 = _fma_rows(acc0, w0, w1, w2, w3, x_ptr, koff, 2 * k_step, sc, W, QX > 0)
        if ROWS > 1:
            acc1 = _fma_rows(acc1, w0, w1, w2, w3, x_ptr + stride_x, koff, 2 * k_step, sc, W, QX > 0)
        if ROWS > 2:
            acc2 = _fma_rows(acc2, w0, w1, w2, w3, x_ptr + 2 * stride_x, koff, 2 * k_step, sc, W, QX > 0)
        if ROWS > 3:
            acc3 = _fma_rows(acc3, w0, w1, w2, w3, x_ptr + 3 * stride_x, koff, 2 * k_step, sc, W, QX > 0)
        w, sb = w_n, sb_n
    base = p_ptr + pid_s.to(tl.int64) * stride_ps + cols
    tl.store(base, tl.sum(acc0, 1), mask=cmask)
    if ROWS > 1:
        tl.store(base + stride_pm, tl.sum(acc1, 1), mask=cmask)
    if ROWS > 2:
        tl.store(base + 2 * stride_pm, tl.sum(acc2, 1), mask=cmask)
    if ROWS > 3:
        tl.store(base + 3 * stride_pm, tl.sum(acc3, 1), mask=cmask)


@triton.jit
def _gemv2(x_ptr, KW, stride_x, xs_ptr, stride_xs,
           w0_ptr, s0_ptr, p0_ptr, N0, KS0, S0, NB0, stride_w0, stride_s0, stride_p0s, stride_p0m,
           w1_ptr, s1_ptr, p1_ptr, N1, KS1, S1, stride_w1, stride_s1, stride_p1s, stride_p1m,
           WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           USE_ASM: tl.constexpr, QX: tl.constexpr):
    """Column blocks [0, NB0) stream weight 0 (slices < S0), the rest weight 1 (slices < S1), as ``_stream2``;
    QX: how the rows are quantised (:func:`_gemv_tile`; 2: into the scratch rows ``xs_ptr``)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if pid_n < NB0:
        if pid_s < S0:
            _gemv_tile(x_ptr, w0_ptr, s0_ptr, p0_ptr, pid_n, pid_s, N0, KW, KS0, stride_x, stride_w0, stride_s0,
                       stride_p0s, stride_p0m, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, QX, xs_ptr, stride_xs)
    else:
        if pid_s < S1:
            _gemv_tile(x_ptr, w1_ptr, s1_ptr, p1_ptr, pid_n - NB0, pid_s, N1, KW, KS1, stride_x, stride_w1,
                       stride_s1, stride_p1s, stride_p1m, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, QX, xs_ptr,
                       stride_xs)


def plan_name(name: str) -> str:
    """The ``gemv_mx.PLANS`` shape of a step GEMV candidate (``qgemv*`` / ``pgemv*`` / ``fpgemv*``: ``gemv*`` on rows
    quantised once before the stream / at the start of each program / the same with the epilogue in the launch)."""
    if name.startswith("fpgemv"):
        return name[2:]
    return name[1:] if name.startswith(("qgemv", "pgemv", "fgemv")) else name


def quantise_mode(name: str) -> int:
    """``_gemv_tile``'s QX for a step GEMV candidate: 0 ``gemv*`` (inside the loop), 1 ``qgemv*`` (a ``qdq_bf16``
    launch before), 2 ``pgemv*`` / ``fpgemv*`` (each program's K slice first, into scratch rows: no launch more)."""
    return 1 if name.startswith("qgemv") else 2 if name.startswith(("pgemv", "fpgemv")) else 0


def gemv_partials(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]], block: int,
                  name: str, xq: torch.Tensor | None = None) -> list[torch.Tensor]:
    """fp32 partials [S_i, T, N_i] of ``QDQ_fp8(x) · dequant(W_i)ᵀ`` for one or two FP8 weights over the same
    T <= ``gemv_mx.MAX_ROWS`` raw bf16 rows x [T, K], in one launch of the GEMV shape ``gemv_mx.PLANS[name]``
    (each weight's K slices as ``gemv_mx.slices`` cuts them): Σ_s in slice order, cast, is
    ``gemv_mx.gemv_fp8(x, W_i)``'s output bit for bit. ``name`` ``qgemv*``: the rows quantised once first
    (``xq``, the bf16 ``qdq_bf16(x)``, when the caller has it; else one ``qdq_bf16`` launch) and the stream reads
    them as ``gemv_fp8`` does (no quantisation inside); ``pgemv*``: each program quantises its K slice of the rows
    first into scratch rows, then the same loop (one launch). The same bits every way."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes, qdq_bf16
    mode = quantise_mode(name)
    plan = gemv_mx.PLANS[plan_name(name)]
    T, K = x.shape
    if (T > gemv_mx.MAX_ROWS or x.dtype != torch.bfloat16 or block % plan.block_n or block % 32
            or not 1 <= len(weights) <= 2):
        raise ValueError(f"gemv_partials: {T} {x.dtype} rows (bf16, at most {gemv_mx.MAX_ROWS}), {len(weights)} "
                         f"weights (1 or 2), block {block} (a multiple of 32 and of {plan.block_n})")
    x = x if x.stride(-1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
    bk = gemv_mx._block_k(K, plan.block_k)
    cuts = [gemv_mx.slices(w.shape[0], K, plan) for w, _ in weights]
    parts = [torch.empty(c[0], T, w.shape[0], dtype=torch.float32, device=x.device) for c, (w, _) in zip(cuts, weights)]
    if T == 0:
        return parts
    if mode == 1:
        x = qdq_bf16(x) if xq is None else xq
        if x.shape != (T, K) or x.dtype != torch.bfloat16 or x.stride(-1) != 1 or x.stride(0) % 2:
            raise ValueError(f"gemv_partials: quantised rows {tuple(x.shape)} {x.dtype} must be bf16 [{T}, {K}]")
    xs = torch.empty(T, K, dtype=torch.bfloat16, device=x.device) if mode == 2 else x
    ws = [(as_bytes(w).view(torch.int32), as_bytes(s)) for w, s in weights]
    two = list(zip(ws, cuts, parts))
    if len(two) == 1:
        two.append(two[0])
    ((w0, s0), c0, p0), ((w1, s1), c1, p1) = two
    nb0 = cdiv(w0.shape[0], plan.block_n)
    nb = nb0 + (cdiv(w1.shape[0], plan.block_n) if len(weights) > 1 else 0)
    _gemv2[(nb, max(c0[0], c1[0]))](
        x.view(torch.int32), K // 4, x.stride(0) // 2, xs.view(torch.int32), xs.stride(0) // 2,
        w0, s0, p0, w0.shape[0], c0[1], c0[0], nb0, w0.stride(0), s0.stride(0), p0.stride(0), p0.stride(1),
        w1, s1, p1, w1.shape[0], c1[1], c1[0], w1.stride(0), s1.stride(0), p1.stride(0), p1.stride(1),
        WB=block, ROWS=T, BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(), QX=mode,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return parts


def self_check(name: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when :func:`gemv_partials` with the GEMV shape ``name`` computes, for two weights at one and three
    rows, the fp32 sums the split-K ``registers`` stream computes (within ``stream_guard.CHECK_TOL``), else what
    differs: the first-use check of the step's GEMV launch (``stream_guard.first_use``)."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import splitk_mx
    from redknot.kernels.triton.dequant_mx import qdq_bf16
    from redknot.kernels.triton.stream_guard import CHECK_TOL, _rel
    g = torch.Generator(device=device).manual_seed(seed)
    K, block = 1024, 32
    weights = [mx.quant_fp8_blocks(torch.randn(n, K, generator=g, device=device) * 0.02, block) for n in (96, 64)]
    worst = 0.0
    for rows in (1, 3):
        x = torch.randn(rows, K, generator=g, device=device).to(torch.bfloat16)
        for p, (w, ws) in zip(gemv_partials(x, weights, block, name), weights):
            want = splitk_mx.splitk_mm(qdq_bf16(x), w, ws, rows, w_fp4=False, wb=block, decode="registers").sum(0)
            worst = max(worst, _rel(p.sum(0), want))
        if name.startswith("fpgemv"):  # the epilogue in the stream launch: the two launches' bits
            w, ws = mx.quant_fp8_blocks(torch.randn(1024, K, generator=g, device=device) * 0.02, block)
            h = torch.randn(rows, 4, 1024, generator=g, device=device).to(torch.bfloat16)
            post = torch.rand(rows, 4, generator=g, device=device)
            comb = torch.rand(rows, 4, 4, generator=g, device=device)
            for _ in range(2):  # twice: the block counters are zero again after a launch
                got = linear_post(x, w, ws, h, post, comb, block, stream=name)
                if not torch.equal(got, linear_post(x, w, ws, h, post, comb, block, stream=name[1:])):
                    return f"step GEMV {name}: the epilogue in the stream launch differs from the two launches"
    return None if worst <= CHECK_TOL else (f"step GEMV {name} differs from decode='registers' by {worst:.3g} "
                                            f"(tolerance {CHECK_TOL:g})")


def small_choice(kind: str, x: torch.Tensor, weights: Sequence[torch.Tensor], block: int,
                 run, tuner: ConfigTuner | None = None) -> str | None:
    """The GEMV shape (a ``gemv_mx.PLANS`` name) the step's launch ``kind`` streams these weights with at this
    call's rows, or None (the ``fp8`` stream): None above ``gemv_mx.MAX_ROWS`` rows, for 16-bit rows other than
    bf16, with the small-row class off (``tuning_cache.small_rows_class()`` / ``gemm_mx.SMALL_ROWS_CLASS``), and
    where ``STEP_SMALL_TUNER`` (key: the launch's weight shapes; ``run(choice)`` times one) keeps ``fp8``. A key
    first met under CUDA-graph capture keeps ``fp8`` for the process (eager and graph steps: one choice).
    ``tuner``: another tuner of the same pattern (``STEP_W2_TUNER``)."""
    from redknot.kernels import tuning_cache
    from redknot.kernels.triton import gemm_mx, gemv_mx
    if (x.shape[0] > gemv_mx.MAX_ROWS or x.dtype != torch.bfloat16 or not gemm_mx.SMALL_ROWS_CLASS
            or not tuning_cache.small_rows_class()):
        return None
    tuner = STEP_SMALL_TUNER if tuner is None else tuner
    if FORCE_SMALL is not None:  # where not a candidate: fpgemv* -> pgemv*, qgemv* -> gemv* (W2), else the shape
        forced = next((n for n in (FORCE_SMALL, FORCE_SMALL[1:]) if n in tuner.candidates), plan_name(FORCE_SMALL))
        return None if forced == "fp8" else forced
    key = (kind, tuple(tuple(w.shape) for w in weights), block)
    if key not in tuner.choices and x.is_cuda and torch.cuda.is_current_stream_capturing():
        tuner.choices[key] = tuner.candidates[0]
    got = tuner.pick(key, run, x.device)
    return None if got == "fp8" else got


def _with_check(device: torch.device, name: str, fast, fallback):
    """``fast()`` behind the first-use check of the step's GEMV ``name`` on a CUDA device (``fallback()``, the
    ``fp8`` stream, where it fails); off the GPU ``fast()`` (errors propagate to the tests)."""
    if device.type != "cuda":
        return fast()
    from redknot.kernels.triton import stream_guard
    key = ("step_proj", name)
    return stream_guard.first_use(key, stream_guard._CHECKED, stream_guard.DECODE_ERRORS,
                                  lambda: self_check(name, device), fast, fallback, stream_guard._fail)


@triton.jit
def _reduce_row(p_ptr, raw_ptr, row, tok, head, S, stride_ps, stride_pm, D: tl.constexpr, DP: tl.constexpr,
                CG: tl.constexpr = False):
    """raw[row] = Σ_s p[s, tok, head·D : (head+1)·D] in slice order, cast (``reduce_rows``). CG: the partials
    load from L2 (written by other programs of the same launch)."""
    cols = tl.arange(0, DP)
    m = cols < D
    off = tok * stride_pm + head * D + cols
    acc = tl.zeros([DP], tl.float32)
    for s in range(S):  # slice order 0..S-1
        if CG:
            acc += tl.load(p_ptr + s * stride_ps + off, mask=m, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(p_ptr + s * stride_ps + off, mask=m, other=0.0)
    tl.store(raw_ptr + row * D + cols, acc.to(raw_ptr.dtype.element_ty), mask=m)


@triton.jit
def _row_epilogue(x_ptr, out_ptr, row, tok, cos_ptr, sin_ptr, w_ptr, pack_ptr, stride_c, eps, D: tl.constexpr,
                  D2P: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, QDQ: tl.constexpr, PACK: tl.constexpr,
                  ASM: tl.constexpr):
    """``step_rope_v41._rope_rows``'s per-row code (not inverse) on row ``row`` of a contiguous [R, D] input;
    PACK: also the row's window-cache bytes (``quant_mx._insert_rows`` FMT 0: e4m3 + E8M0 per 32) at row
    ``row`` of ``pack_ptr`` [R, D + D/32], from the same values ``cache_insert_mx`` would load."""
    D2: tl.constexpr = D // 2
    FIRST: tl.constexpr = D2 - HALF
    i = tl.arange(0, D2P)
    two = tl.arange(0, 2)
    offs = i[:, None] * 2 + two[None, :]
    inside = (i < D2)[:, None] & (two[None, :] < 2)
    x = tl.load(x_ptr + row * D + offs, mask=inside, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        x = (w * (x * r)).to(out_ptr.dtype.element_ty).to(tl.float32)
    re, im = tl.split(x)
    rot = (i >= FIRST) & (i < D2)
    j = tl.maximum(i - FIRST, 0)
    c = tl.load(cos_ptr + tok * stride_c + j, mask=rot, other=1.0)
    s = tl.load(sin_ptr + tok * stride_c + j, mask=rot, other=0.0)
    new_re = _mul_rn(re, c, ASM) - _mul_rn(im, s, ASM)
    new_im = _mul_rn(re, s, ASM) + _mul_rn(im, c, ASM)
    new_re = tl.where(rot, new_re.to(out_ptr.dtype.element_ty).to(tl.float32), re)
    new_im = tl.where(rot, new_im.to(out_ptr.dtype.element_ty).to(tl.float32), im)
    y = tl.reshape(tl.join(new_re, new_im), (2 * D2P,))
    if QDQ:
        g = tl.reshape(y, (2 * D2P // 32, 32))
        e = e8m0_exponent(tl.max(tl.abs(g), 1), 6.0, 7.052966104933725e-38)
        code = e2m1_code(g * pow2(-e)[:, None])
        y = tl.reshape(e2m1_value(code) * pow2(e)[:, None], (2 * D2P,))
    cols = tl.arange(0, 2 * D2P)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + cols, y, mask=cols < D)
    if PACK:
        NG: tl.constexpr = 2 * D2P // 32
        xg = tl.reshape(y.to(tl.float32), (NG, 32))
        e = e8m0_exponent(tl.max(tl.abs(xg), 1), 448.0, 1e-4)
        qv = tl.reshape(xg * pow2(-e)[:, None], (2 * D2P,))
        qv = tl.minimum(tl.maximum(qv, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        pbase = pack_ptr + row * (D + D // 32)
        tl.store(pbase + cols, qv, mask=cols < D)
        gs = tl.arange(0, NG)
        tl.store(pbase + D + gs, (e + 127).to(tl.uint8), mask=gs < D // 32)


@triton.jit
def _epilogue2(cos_ptr, sin_ptr, stride_c, n0,
               p0_ptr, raw0_ptr, out0_ptr, w0_ptr, S0, stride_p0s, stride_p0m, eps0, H0,
               p1_ptr, raw1_ptr, out1_ptr, w1_ptr, S1, stride_p1s, stride_p1m, eps1, H1, pack_ptr,
               D0: tl.constexpr, D2P0: tl.constexpr, HALF0: tl.constexpr, NORM0: tl.constexpr, QDQ0: tl.constexpr,
               D1: tl.constexpr, D2P1: tl.constexpr, HALF1: tl.constexpr, NORM1: tl.constexpr, QDQ1: tl.constexpr,
               PACK1: tl.constexpr, ASM: tl.constexpr):
    """Programs [0, n0): rows (token, head) of output 0, the rest those of output 1."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < n0:
        tok = pid // H0
        _reduce_row(p0_ptr, raw0_ptr, pid, tok, pid - tok * H0, S0, stride_p0s, stride_p0m, D0, 2 * D2P0)
        tl.debug_barrier()   # the row's raw values, stored by every thread of the program, then read back
        _row_epilogue(raw0_ptr, out0_ptr, pid, tok, cos_ptr, sin_ptr, w0_ptr, pack_ptr, stride_c, eps0, D0, D2P0,
                      HALF0, NORM0, QDQ0, False, ASM)
    else:
        row = pid - n0
        tok = row // H1
        _reduce_row(p1_ptr, raw1_ptr, row, tok, row - tok * H1, S1, stride_p1s, stride_p1m, D1, 2 * D2P1)
        tl.debug_barrier()
        _row_epilogue(raw1_ptr, out1_ptr, row, tok, cos_ptr, sin_ptr, w1_ptr, pack_ptr, stride_c, eps1, D1, D2P1,
                      HALF1, NORM1, QDQ1, PACK1, ASM)


@triton.jit
def _post_block(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dblk, D, stride_y, stride_st, stride_sn, stride_ot,
                stride_on, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``mhc._mhc_post``'s code for one (token, column block): out[k] = post[k]·y + Σ_j C[j, k]·h[j]."""
    dd = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    offs_n = tl.arange(0, N)
    y = tl.load(y_ptr + tok * stride_y + dd, mask=dmask, other=0.0).to(tl.float32)
    _post_mix(y, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dd, dmask, offs_n, stride_st, stride_sn, stride_ot,
              stride_on, N)


@triton.jit
def _epilogue_post(p_ptr, y_ptr, S, stride_ps, stride_pm, H, s_ptr, post_ptr, comb_ptr, out_ptr, stride_st, stride_sn,
                   stride_ot, stride_on, D: tl.constexpr, N: tl.constexpr):
    """Row (token, block) of a linear without a row epilogue: the slice sum (``reduce_rows``) into ``y``, then the
    mHC post mix of that column block (``mhc_post`` with ``BLOCK_D`` = D)."""
    pid = tl.program_id(0).to(tl.int64)
    tok = pid // H
    blk = pid - tok * H
    _reduce_row(p_ptr, y_ptr, pid, tok, blk, S, stride_ps, stride_pm, D, D)
    tl.debug_barrier()   # the block's y, stored by every thread of the program, then read back
    _post_block(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, tok, blk, H * D, H * D, stride_st, stride_sn, stride_ot,
                stride_on, N, D)


@triton.jit
def _gemv_post(x_ptr, KW, stride_x, xs_ptr, stride_xs, w_ptr, s_ptr, p_ptr, N, KS, S, stride_w, stride_s, stride_ps,
               stride_pm, cnt_ptr, y_ptr, H, h_ptr, post_ptr, comb_ptr, out_ptr, stride_st, stride_sn, stride_ot,
               stride_on, WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_ASM: tl.constexpr, D: tl.constexpr, NS: tl.constexpr):
    """``linear_post``'s two launches in one: each program streams its (column block, K slice) as ``_gemv2`` with
    QX 2 and stores its partials; then a barrier and one acquire-release increment of its D-wide block's counter
    (the partials released at GPU scope); the program that takes the count to the block's last value (every
    program of the block has stored its partials) resets it and runs ``_epilogue_post``'s code for the block and
    each row (the slice sum in slice order, from L2; the mHC post mix). The bits of the two launches."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    _gemv_tile(x_ptr, w_ptr, s_ptr, p_ptr, pid_n, pid_s, N, KW, KS, stride_x, stride_w, stride_s, stride_ps,
               stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, 2, xs_ptr, stride_xs)
    tl.debug_barrier()   # every thread's partials stored before the release
    blk = (pid_n * BLOCK_N) // D
    done = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
    if done == (D // BLOCK_N) * S - 1:
        tl.atomic_xchg(cnt_ptr + blk, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
        for t in tl.static_range(ROWS):
            _reduce_row(p_ptr, y_ptr, t * H + blk, t, blk, S, stride_ps, stride_pm, D, D, True)
            tl.debug_barrier()   # the block's y, stored by every thread of the program, then read back
            _post_block(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, t, blk, H * D, H * D, stride_st, stride_sn,
                        stride_ot, stride_on, NS, D)


_COUNTERS: dict = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 block counters of :func:`_gemv_post` for ``device`` (each launch leaves them zero again; the
    step's launches run one after another on one stream). Kept for the process: a CUDA graph may capture them."""
    key = (device.type, device.index)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = c
    return c


def _post_fused(x, weight, scale, s, post, comb, out, block: int, bd: int, name: str) -> torch.Tensor:
    """:func:`linear_post` with ``fpgemv*``: one ``_gemv_post`` launch (at most ``gemv_mx.MAX_ROWS`` bf16 rows)."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes
    plan = gemv_mx.PLANS[plan_name(name)]
    T, K = x.shape
    D = weight.shape[0]
    if (T > gemv_mx.MAX_ROWS or x.dtype != torch.bfloat16 or block % plan.block_n or bd % plan.block_n
            or x.stride(0) % 2):
        raise ValueError(f"linear_post: {name} takes at most {gemv_mx.MAX_ROWS} bf16 rows and a column block "
                         f"({bd}) and scale tile ({block}) that its {plan.block_n} columns divide")
    bk = gemv_mx._block_k(K, plan.block_k)
    S, ks = gemv_mx.slices(D, K, plan)
    part = torch.empty(S, T, D, dtype=torch.float32, device=x.device)
    xs = torch.empty(T, K, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    wb = as_bytes(weight).view(torch.int32)
    sc = as_bytes(scale)
    _gemv_post[(cdiv(D, plan.block_n), S)](
        x.view(torch.int32), K // 4, x.stride(0) // 2, xs.view(torch.int32), xs.stride(0) // 2, wb, sc, part, D, ks,
        S, wb.stride(0), sc.stride(0), part.stride(0), part.stride(1), _counters(x.device, D // bd), y, D // bd, s,
        post.float().contiguous(), comb.float().contiguous(), out, s.stride(0), s.stride(1), out.stride(0),
        out.stride(1), WB=block, ROWS=T, BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(), D=bd,
        NS=s.shape[1], num_warps=plan.num_warps, num_stages=plan.num_stages)
    return out


def linear_post(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, block: int = 32, stream: str | None = None) -> torch.Tensor:
    """``mhc_post(linear_mx(x, weight, scale), h, post, comb)`` with the ``fp8`` decode in two launches, the same
    bits: the FP8 stream, then one program per (token, column block of ``mhc_post``'s width) that sums the slices
    and mixes the block into the n streams. x [T, K] 16-bit, weight e4m3 [D, K], h [T, n, D] (n a power of two),
    post [T, n] / comb [T, n, n] fp32 -> h' [T, n, D] in h's dtype. ``stream``: the weight stream, ``fp8`` or a
    ``gemv_mx.PLANS`` dense shape (:func:`proj_rows`); None: :func:`small_choice`'s."""
    T, K = x.shape
    D = weight.shape[0]
    n = h.shape[1]
    bd = min(512, next_pow2(D))
    if (h.shape != (T, n, D) or D % bd or bd % 2 or n & (n - 1) or weight.dtype != torch.float8_e4m3fn
            or weight.shape[1] != K or K % 32 or block % 32 or x.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"linear_post: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, h "
                         f"{tuple(h.shape)}: need h [T, n, D] (n a power of two), D a multiple of min(512, D's "
                         "power of two), K and block multiples of 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    s = h.contiguous()
    out = torch.empty_like(s)
    if T == 0:
        return out
    scale = scale.view(torch.uint8)
    if stream is None:
        stream = small_choice("post", x, [weight], block, lambda c: linear_post(
            x[:1], weight, scale, h[:1], post[:1], comb[:1], block, stream=c), tuner=STEP_POST_TUNER) or "fp8"

    def launches(dec: str) -> torch.Tensor:
        if dec.startswith("fpgemv"):
            return _post_fused(x, weight, scale, s, post, comb, out, block, bd, dec)
        if dec == "fp8":
            part = _stream_partials(x, [(weight, scale)], block)[0]
        else:
            part = gemv_partials(x, [(weight, scale)], block, dec)[0]
        y = torch.empty(T, D, dtype=x.dtype, device=x.device)
        _epilogue_post[(T * (D // bd),)](part, y, part.shape[0], part.stride(0), part.stride(1), D // bd, s,
                                         post.float().contiguous(), comb.float().contiguous(), out, s.stride(0),
                                         s.stride(1), out.stride(0), out.stride(1), D=bd, N=n, num_warps=4)
        return out
    if stream != "fp8":
        return _with_check(x.device, stream, lambda: launches(stream), lambda: launches("fp8"))
    return launches("fp8")


def slices(N: int, K: int, rows: int) -> tuple[int, int, int, int]:
    """(S, ksplit, block_m, block_n) of ``splitk_mx.splitk_mm`` with ``decode="fp8"`` for an [N, K] weight."""
    from redknot.kernels.triton import splitk_mx as sk
    block_n = sk.SCALED_BLOCK_N
    bk = sk.block_k_for(K, False, sk.SCALED_BLOCK_K)
    S = sk.split_count(N, K, block_n, bk, sk.SCALED_MIN_STEPS) if rows <= sk.SPLIT_MAX_ROWS else 1
    ksplit = cdiv(cdiv(K, S), bk) * bk
    return cdiv(K, ksplit), ksplit, sk.dense_row_tile(rows), block_n


def epilogue_warps(specs: Sequence[Proj]) -> int | None:
    """The warps of the epilogue launch: those ``rope_rows`` runs each row kind with (1 up to 128 columns, else
    4). A normalised row's sum of squares depends on them, so its kind decides; None: two normalised kinds
    that ``rope_rows`` would run with different warps (one launch cannot give both their bits)."""
    def warps(d):
        return 1 if d <= 128 else 4
    normed = {warps(s.dim) for s in specs if s.norm_w is not None}
    if len(normed) > 1:
        return None
    return normed.pop() if normed else max(warps(s.dim) for s in specs)


class Proj:
    """One linear of :func:`proj_rows` and its row epilogue: ``weight`` e4m3 [H·dim, K] with E8M0 ``scale``
    tiles, output rows [T, H, dim]; ``norm_w``: RMS norm first (``eps``); ``rope``: rotate the last ``2·half``
    dims by the call's cos/sin; ``qdq``: the FP4 grid after (``rope_rows``'s options)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dim: int, norm_w: torch.Tensor | None = None,
                 eps: float = 0.0, rope: bool = False, qdq: bool = False):
        self.weight, self.scale, self.dim = weight, scale.view(torch.uint8), dim
        self.norm_w, self.eps, self.rope, self.qdq = norm_w, eps, rope, qdq
        self.heads = weight.shape[0] // dim


def check(x: torch.Tensor, specs: Sequence[Proj], half: int, block: int) -> None:
    if not 1 <= len(specs) <= 2:
        raise ValueError(f"proj_rows: {len(specs)} linears (1 or 2)")
    K = x.shape[-1]
    for s in specs:
        N = s.weight.shape[0]
        if s.weight.dtype != torch.float8_e4m3fn or s.weight.shape[1] != K or N % s.dim:
            raise ValueError(f"proj_rows: weight {tuple(s.weight.shape)} {s.weight.dtype} must be e4m3 [H·{s.dim}, "
                             f"{K}]")
        if s.dim % 2 or (s.rope and 2 * half > s.dim) or (s.qdq and (s.dim & (s.dim - 1) or s.dim < 32)):
            raise ValueError(f"proj_rows: row width {s.dim} must be even and >= 2*half ({2 * half}), a power of "
                             "two >= 32 with qdq")
    if K % 32 or block % 32 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"proj_rows: K={K} and block={block} must be multiples of 32, x 16-bit ({x.dtype})")
    if epilogue_warps(specs) is None:
        raise ValueError("proj_rows: two normalised row widths that rope_rows runs with different warps")


def proj_rows(x: torch.Tensor, specs: Sequence[Proj], cos: torch.Tensor, sin: torch.Tensor,
              block: int = 32, pack: torch.Tensor | None = None,
              stream: str | None = None) -> list[torch.Tensor]:
    """[rope_rows(linear_mx(x, s.weight, s.scale).view(T, H, dim), cos, sin, norm_w, eps, qdq) for s in specs]
    with ``linear_mx``'s ``fp8`` decode, bit for bit, in two launches (module docstring): x [T, K] 16-bit,
    cos/sin [T, half] (``rope_table``; rows without ``rope`` ignore them). ``pack`` uint8 [T·H, dim + dim/32]: the
    second linear's output rows also as window-cache bytes there (``cache_insert_mx(pack, arange, rows,
    "window")``'s bytes; needs two linears, the second's width a multiple of 32). ``stream``: the first launch's
    weight stream, ``fp8`` or a ``gemv_mx.PLANS`` dense shape (at most ``gemv_mx.MAX_ROWS`` bf16 rows: the bits
    of ``gemv_mx.gemv_fp8`` then the same epilogue); None: :func:`small_choice`'s."""
    half = cos.shape[-1]
    check(x, specs, half, block)
    if pack is not None:
        s = specs[-1]
        if (len(specs) != 2 or s.dim % 32 or s.qdq or pack.dtype != torch.uint8
                or pack.shape != (x.shape[0] * s.heads, s.dim + s.dim // 32) or pack.stride(0) != pack.shape[1]):
            raise ValueError(f"proj_rows: pack {tuple(pack.shape)} {pack.dtype} must be contiguous uint8 "
                             f"[T·H, dim + dim/32] of a second linear (width a multiple of 32, no qdq)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    T = x.shape[0]
    dev = x.device
    outs = [torch.empty(T, s.heads, s.dim, dtype=x.dtype, device=dev) for s in specs]
    if T == 0:
        return outs
    if stream is None:
        def timed(c):  # STEP_SMALL_TUNER times a choice on the first row
            one = None if pack is None else torch.empty(specs[-1].heads, pack.shape[1], dtype=pack.dtype, device=dev)
            return proj_rows(x[:1], specs, cos[:1], sin[:1], block, pack=one, stream=c)
        stream = small_choice("proj", x, [s.weight for s in specs], block, timed) or "fp8"
    if stream != "fp8":
        return _with_check(dev, stream, lambda: _proj_launches(x, specs, cos, sin, block, pack, outs, stream),
                           lambda: _proj_launches(x, specs, cos, sin, block, pack, outs, "fp8"))
    return _proj_launches(x, specs, cos, sin, block, pack, outs, "fp8")


def _stream_partials(x: torch.Tensor, weights: Sequence[tuple[torch.Tensor, torch.Tensor]],
                     block: int) -> list[torch.Tensor]:
    """The ``fp8`` stream's fp32 partials [S_i, T, N_i] of one or two weights (``_stream2``, one launch)."""
    T, K = x.shape
    cuts = [slices(w.shape[0], K, T) for w, _ in weights]
    parts = [torch.empty(c[0], T, w.shape[0], dtype=torch.float32, device=x.device) for c, (w, _) in zip(cuts, weights)]
    bm, bn = cuts[0][2], cuts[0][3]
    two = list(zip(weights, cuts, parts))
    if len(two) == 1:
        two.append(two[0])
    ((w0, s0), c0, p0), ((w1, s1), c1, p1) = two
    nb0 = cdiv(w0.shape[0], bn)
    nb = nb0 + (cdiv(w1.shape[0], bn) if len(weights) > 1 else 0)

    def groups(c):
        return 4 if c[1] % 128 == 0 and K % 128 == 0 else 1
    _stream2[(cdiv(T, bm), nb, max(c0[0], c1[0]))](
        x, T, K, x.stride(0),
        w0, s0, p0, w0.shape[0], c0[1], c0[0], nb0, w0.stride(0), s0.stride(0), p0.stride(0), p0.stride(1),
        w1, s1, p1, w1.shape[0], c1[1], c1[0], w1.stride(0), s1.stride(0), p1.stride(0), p1.stride(1),
        WB=block, BLOCK_M=bm, BLOCK_N=bn, GROUPS0=groups(c0), GROUPS1=groups(c1), num_warps=4, num_stages=4)
    return parts


def _proj_launches(x, specs, cos, sin, block, pack, outs, stream: str):
    """:func:`proj_rows`' two launches: the weight stream (``fp8`` or a GEMV shape) and the epilogue."""
    T = x.shape[0]
    dev = x.device
    half = cos.shape[-1]
    weights = [(s.weight, s.scale) for s in specs]
    parts = _stream_partials(x, weights, block) if stream == "fp8" else gemv_partials(x, weights, block, stream)
    raws = [torch.empty(T * s.heads, s.dim, dtype=x.dtype, device=dev) for s in specs]
    two = list(zip(specs, parts, raws, outs))
    if len(two) == 1:
        two.append(two[0])
    (s0, p0, r0, o0), (s1, p1, r1, o1) = two
    n1 = len(specs) > 1
    cos, sin = cos.contiguous(), sin.contiguous()
    n0 = T * s0.heads
    n_all = n0 + (T * s1.heads if n1 else 0)

    def kind(s):
        w = s.norm_w if s.norm_w is not None else cos      # unread without NORM
        return (w, s.eps)

    (w0, e0), (w1, e1) = kind(s0), kind(s1)
    _epilogue2[(n_all,)](
        cos, sin, half, n0,
        p0, r0, o0, w0, p0.shape[0], p0.stride(0), p0.stride(1), e0, s0.heads,
        p1, r1, o1, w1, p1.shape[0], p1.stride(0), p1.stride(1), e1, s1.heads, pack if pack is not None else r1,
        D0=s0.dim, D2P0=next_pow2(s0.dim // 2), HALF0=half if s0.rope else 0, NORM0=s0.norm_w is not None,
        QDQ0=s0.qdq, D1=s1.dim, D2P1=next_pow2(s1.dim // 2), HALF1=half if s1.rope else 0,
        NORM1=s1.norm_w is not None, QDQ1=s1.qdq, PACK1=pack is not None, ASM=not interpreting() and x.is_cuda,
        num_warps=epilogue_warps(specs))
    return outs
