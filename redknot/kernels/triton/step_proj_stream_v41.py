"""The first launch of ``step_proj_v41``'s fused linears: one weight stream over one or two FP8 weights that read
the same rows, writing each weight's fp32 partials [S, T, N]: the ``fp8`` tensor-core stream (``_stream2``,
:func:`_stream_partials`: the K slices ``splitk_mx.splitk_mm`` cuts with ``decode="fp8"``) or the CUDA-core GEMV
(``_gemv2``, :func:`gemv_partials`: ``gemv_mx``'s word-wise FP8 decode; its program ``_gemv_tile`` also streams
``step_moe_v41``'s shared expert). The arithmetic and the choice between them: ``step_proj_v41``'s module
docstring. ``_gemv2f``: the GEMV of two weights on a flat grid of exactly nb0·S0 + nb1·S1 programs (``*_flat``
names: the shape's own slices, the same bits; ``*_wave``: the slices :func:`wave_slices` cuts against the
programs resident on an SM, ``RESIDENT``); not measured on the H200."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.gemv_mx import _e4m3x4, _row_fma
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2


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


def slices(N: int, K: int, rows: int) -> tuple[int, int, int, int]:
    """(S, ksplit, block_m, block_n) of ``splitk_mx.splitk_mm`` with ``decode="fp8"`` for an [N, K] weight."""
    from redknot.kernels.triton import splitk_mx as sk
    block_n = sk.SCALED_BLOCK_N
    bk = sk.block_k_for(K, False, sk.SCALED_BLOCK_K)
    S = sk.split_count(N, K, block_n, bk, sk.SCALED_MIN_STEPS) if rows <= sk.SPLIT_MAX_ROWS else 1
    ksplit = cdiv(cdiv(K, S), bk) * bk
    return cdiv(K, ksplit), ksplit, sk.dense_row_tile(rows), block_n


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



@triton.jit
def _gemv2f(x_ptr, KW, stride_x, xs_ptr, stride_xs,
            w0_ptr, s0_ptr, p0_ptr, N0, KS0, S0, P0, stride_w0, stride_s0, stride_p0s, stride_p0m,
            w1_ptr, s1_ptr, p1_ptr, N1, KS1, S1, stride_w1, stride_s1, stride_p1s, stride_p1m,
            WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            USE_ASM: tl.constexpr, QX: tl.constexpr):
    """``_gemv2`` on a flat grid of exactly P0 + nb1·S1 programs (no program that exits at once): program p < P0
    (= nb0·S0) is weight 0's column block p // S0, slice p % S0 (a block's slices adjacent: they read one
    contiguous run of the weight), the rest weight 1's likewise. Each program is ``_gemv_tile``: the bits of
    ``_gemv2`` at the same slices."""
    pid = tl.program_id(0)
    one = pid >= P0
    q = tl.where(one, pid - P0, pid)
    S = tl.where(one, S1, S0)
    _gemv_tile(x_ptr, tl.where(one, w1_ptr, w0_ptr), tl.where(one, s1_ptr, s0_ptr), tl.where(one, p1_ptr, p0_ptr),
               q // S, q % S, tl.where(one, N1, N0), KW, tl.where(one, KS1, KS0), stride_x,
               tl.where(one, stride_w1, stride_w0), tl.where(one, stride_s1, stride_s0),
               tl.where(one, stride_p1s, stride_p0s), tl.where(one, stride_p1m, stride_p0m), WB, ROWS, BLOCK_N,
               BLOCK_K, USE_ASM, QX, xs_ptr, stride_xs)


# The flat-grid forms of the step GEMV shapes (``_gemv2f``: one program index over (weight, column block, slice),
# so a launch has exactly nb0·S0 + nb1·S1 programs): ``*_flat`` with ``gemv_mx.slices``' K slices (the bits of the
# shape it names), ``*_wave`` with the K slices :func:`wave_slices` chooses against the resident programs.
FLAT, WAVE = "_flat", "_wave"
# SMs of the device the wave plans are cut for (H100 / H200: 132). A constant, not the device's count: a weight
# shape's K slices, hence a token's bits, are then the same on every device.
SMS = 132
# Programs resident on an SM, per (``gemv_mx.PLANS`` shape, QX, K step in bytes, weights): from the registers of
# the sm_90a compile at one row (Triton 3.6 ptxas; 4 warps a program, 64K registers an SM, no spills; shared memory
# <= 512 B a program does not bind) of the kernel a ``*_wave`` launch runs: ``_gemv2f`` for two weights, ``_gemv2``
# for one (its (column block, slice) grid has no empty program then, and its pointers stay parameters: qgemv_n16
# at K step 512 96 registers -> 5, ``_gemv2f`` 100 -> 4). A table, not the compiled kernel's count: the registers
# differ from 1 to 4 rows, and a weight shape's K slices (a token's bits) must not. A K step not listed takes the
# smallest count of its shape, QX and weights.
RESIDENT = {("gemv", 0, 256, 2): 3, ("gemv", 1, 256, 2): 5, ("gemv", 2, 256, 2): 5,
            ("gemv_n16", 0, 512, 2): 3, ("gemv_n16", 0, 256, 2): 6, ("gemv_n16", 1, 512, 2): 4,
            ("gemv_n16", 1, 256, 2): 8, ("gemv_n16", 2, 512, 2): 4, ("gemv_n16", 2, 256, 2): 8,
            ("gemv_k128", 0, 128, 2): 4, ("gemv_k128", 1, 128, 2): 10, ("gemv_k128", 2, 128, 2): 12,
            ("gemv", 0, 256, 1): 3, ("gemv", 1, 256, 1): 4, ("gemv", 2, 256, 1): 4,
            ("gemv_n16", 0, 512, 1): 3, ("gemv_n16", 0, 256, 1): 5, ("gemv_n16", 1, 512, 1): 5,
            ("gemv_n16", 1, 256, 1): 8, ("gemv_n16", 2, 512, 1): 5, ("gemv_n16", 2, 256, 1): 8,
            ("gemv_k128", 0, 128, 1): 4, ("gemv_k128", 1, 128, 1): 10, ("gemv_k128", 2, 128, 1): 12}


def resident(shape: str, qx: int, bk: int, weights: int = 2) -> int:
    """``RESIDENT``'s programs an SM for the shape, QX, K step and weight count (the smallest of the shape's, QX's
    and weight count's where the K step is not listed)."""
    got = RESIDENT.get((shape, qx, bk, weights))
    return got if got is not None else min(v for (n, q, _, c), v in RESIDENT.items()
                                           if (n, q, c) == (shape, qx, weights))


def grid_form(name: str) -> str:
    """"" (``_gemv2``'s (column block, slice) grid), ``_flat`` or ``_wave`` (``_gemv2f``'s flat grid)."""
    return next((f for f in (FLAT, WAVE) if name.endswith(f)), "")


def plan_name(name: str) -> str:
    """The ``gemv_mx.PLANS`` shape of a step GEMV candidate (``qgemv*`` / ``pgemv*`` / ``fpgemv*``: ``gemv*`` on rows
    quantised once before the stream / at the start of each program / the same with the epilogue in the launch;
    ``*_flat`` / ``*_wave``: the same shape on the flat grid)."""
    form = grid_form(name)
    if form:
        name = name[:-len(form)]
    if name.startswith("fpgemv"):
        return name[2:]
    return name[1:] if name.startswith(("qgemv", "pgemv", "fgemv")) else name


def wave_slices(Ns: Sequence[int], K: int, plan, resident: int) -> tuple[int, int]:
    """(slice count, slice width) of every weight [N_i, K] of a ``*_wave`` launch: the slice count S (programs of
    L = ceil(steps / S) K steps, L at least ``plan.min_steps`` where K has that many) that minimises
    waves · (L + 1), waves = ceil(Σ_i nb_i · S / (``SMS`` · resident)), the + 1 a program's first load that
    nothing overlaps; on a tie the fewer slices (fewer partials). One S for all the launch's weights (equal
    program lengths); a function of the launch's weight shapes and the plan only, never of the rows (a token's
    bits do not depend on how many tokens share the call)."""
    from redknot.kernels.triton import gemv_mx
    bk = gemv_mx._block_k(K, plan.block_k)
    steps = K // bk
    blocks = sum(cdiv(n, plan.block_n) for n in Ns)
    best = None
    for length in range(steps, min(plan.min_steps, steps) - 1, -1):
        S = cdiv(steps, length)
        cost = cdiv(blocks * S, SMS * resident) * (cdiv(steps, S) + 1)
        if best is None or cost < best[0]:
            best = (cost, S)
    ksplit = cdiv(steps, best[1]) * bk
    return cdiv(K, ksplit), ksplit


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
    first into scratch rows, then the same loop (one launch). The same bits every way. ``*_flat``: the same
    slices on ``_gemv2f``'s flat grid (nb0·S0 + nb1·S1 programs; the same bits); ``*_wave``: ``_gemv2f`` with the
    slices of :func:`wave_slices` (one count for both weights, from ``RESIDENT``): the same exact products summed
    in another slice order where the count differs from ``gemv_mx.slices``' (within the op tolerance; rows
    independent, so a row's bits are the same at 1-4 rows)."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes, qdq_bf16
    mode = quantise_mode(name)
    form = grid_form(name)
    plan = gemv_mx.PLANS[plan_name(name)]
    T, K = x.shape
    if (T > gemv_mx.MAX_ROWS or x.dtype != torch.bfloat16 or block % plan.block_n or block % 32
            or not 1 <= len(weights) <= 2):
        raise ValueError(f"gemv_partials: {T} {x.dtype} rows (bf16, at most {gemv_mx.MAX_ROWS}), {len(weights)} "
                         f"weights (1 or 2), block {block} (a multiple of 32 and of {plan.block_n})")
    x = x if x.stride(-1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
    bk = gemv_mx._block_k(K, plan.block_k)
    if form == WAVE:
        here = resident(plan_name(name), mode, bk, len(weights))
        cut = wave_slices([w.shape[0] for w, _ in weights], K, plan, here)
        cuts = [cut for _ in weights]
    else:
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
    nb1 = cdiv(w1.shape[0], plan.block_n) if len(weights) > 1 else 0
    common = {"WB": block, "ROWS": T, "BLOCK_N": plan.block_n, "BLOCK_K": bk, "USE_ASM": gemv_mx._use_asm(),
              "QX": mode, "num_warps": plan.num_warps, "num_stages": plan.num_stages}
    if form and len(weights) > 1:  # one weight: (block, slice) is already exactly nb0·S0 programs
        _gemv2f[(nb0 * c0[0] + nb1 * c1[0],)](
            x.view(torch.int32), K // 4, x.stride(0) // 2, xs.view(torch.int32), xs.stride(0) // 2,
            w0, s0, p0, w0.shape[0], c0[1], c0[0], nb0 * c0[0], w0.stride(0), s0.stride(0), p0.stride(0),
            p0.stride(1), w1, s1, p1, w1.shape[0], c1[1], c1[0], w1.stride(0), s1.stride(0), p1.stride(0),
            p1.stride(1), **common)
        return parts
    _gemv2[(nb0 + nb1, max(c0[0], c1[0]))](
        x.view(torch.int32), K // 4, x.stride(0) // 2, xs.view(torch.int32), xs.stride(0) // 2,
        w0, s0, p0, w0.shape[0], c0[1], c0[0], nb0, w0.stride(0), s0.stride(0), p0.stride(0), p0.stride(1),
        w1, s1, p1, w1.shape[0], c1[1], c1[0], w1.stride(0), s1.stride(0), p1.stride(0), p1.stride(1), **common)
    return parts
