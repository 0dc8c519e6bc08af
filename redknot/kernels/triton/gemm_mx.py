"""FP8 tensor-core GEMMs over the V4.1 weight formats, activation quantisation fused in front.

One kernel, three uses:
* ``linear_mx``: bf16 rows x e4m3 weight [N, K] with E8M0 scales per b×b tile (V4.1 b = 32, V4 b = 128).
* MoE first GEMM: token rows gathered by expert (no copy), times MXFP4 W1 and W3 of the row's expert; the
  epilogue applies the clamped SwiGLU and the routing weight, rounds to bf16 and re-quantises the result
  to FP8 per 32 columns, so the second GEMM reads 1 byte per element.
* MoE second GEMM: those FP8 rows times MXFP4 W2.

The K loop steps over one 32-wide activation group: the bf16 tile is quantised in registers (E8M0 scale
from the group amax, as ``mx_formats``), FP4 weight nibbles are expanded to e4m3 bytes in registers
(every e2m1 value is exact in e4m3), one FP8 MMA runs, and its fp32 result is scaled by
``a_scale · w_scale`` and accumulated in K order, the reference's block-wise summation (§3.0).
Grouped launches use a device-side tile map (no host sync, CUDA-graph safe).

A second MMA mode computes the same products another way: both operands are decoded in registers to
bf16 with their scales folded in (an e4m3 or e2m1 value times a power of two is exact in bf16), and one
bf16 MMA per 64/128-deep K step accumulates in place, so no scaling sits between MMAs. The tuner
measures both per problem class and keeps the faster (``MxGemmConfig.mma``).

``linear_mx`` and ``moe_mx`` run this kernel only as ``path="fused"``; by default they choose by size
between split-K weight streams (``splitk_mx.py``, decode) and exact bf16 decoding with library GEMMs
(``dequant_mx.py``, ``moe_mx.py``, prefill), which keep the scales out of the MMA loop altogether.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels import tuning_cache
from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2
from redknot.kernels.triton.fp8 import _tile_map
from redknot.kernels.triton.moe import route_by_expert
from redknot.kernels.triton.quant_mx import (act_quant_mx, e2m1_to_e4m3_bits, e2m1_value, e8m0_decode,
                                             e8m0_exponent, pow2)


@triton.jit
def _load_a(a_ptr, sa_ptr, arow, rmask, kk, stride_am, stride_sam, kb, A_FP8: tl.constexpr):
    """A tile [BM, 32] as e4m3 and its per-row scale [BM] (quantised here when A is bf16)."""
    if A_FP8:
        a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
        sa = e8m0_decode(tl.load(sa_ptr + arow * stride_sam + kb, mask=rmask, other=127))
    else:
        x = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        e = e8m0_exponent(tl.max(tl.abs(x), 1), 448.0, 1e-4)
        a = tl.minimum(tl.maximum(x * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
        sa = pow2(e)
    return a, sa


@triton.jit
def _load_b(b_ptr, sb_ptr, cols, cmask, kk, kb, stride_bn, stride_sbn, W_FP4: tl.constexpr, WB: tl.constexpr):
    """W tile [BN, 32] as e4m3 and its per-column scale [BN]."""
    if W_FP4:
        half = (kb * 16 + tl.arange(0, 16))
        p = tl.load(b_ptr + cols[:, None].to(tl.int64) * stride_bn + half[None, :], mask=cmask[:, None], other=0)
        p = p.to(tl.int32)
        codes = tl.reshape(tl.join(p & 0xF, (p >> 4) & 0xF), (p.shape[0], 32))
        b = e2m1_to_e4m3_bits(codes).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        sb = e8m0_decode(tl.load(sb_ptr + cols.to(tl.int64) * stride_sbn + kb, mask=cmask, other=127))
    else:
        b = tl.load(b_ptr + cols[:, None].to(tl.int64) * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
        sb = e8m0_decode(tl.load(sb_ptr + (cols // WB).to(tl.int64) * stride_sbn + (kb * 32) // WB,
                                 mask=cmask, other=127))
    return b, sb


@triton.jit
def _load_a_wide(a_ptr, sa_ptr, arow, rmask, k0, K, stride_am, stride_sam, A_FP8: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile [BM, BK] as bf16 holding exactly the FP8-quantised values times their scales."""
    kk = k0 + tl.arange(0, BLOCK_K)
    m = rmask[:, None] & (kk[None, :] < K)
    gs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    if A_FP8:
        q = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=m, other=0.0).to(tl.float32)
        sb = tl.load(sa_ptr + arow[:, None] * stride_sam + gs[None, :], mask=rmask[:, None] & (gs[None, :] * 32 < K),
                     other=127)
        v = tl.reshape(q, (BLOCK_M, BLOCK_K // 32, 32)) * e8m0_decode(sb)[:, :, None]
    else:
        x = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=m, other=0.0).to(tl.float32)
        xg = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
        e = e8m0_exponent(tl.max(tl.abs(xg), 2), 448.0, 1e-4)
        q = tl.minimum(tl.maximum(xg * pow2(-e)[:, :, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        v = q * pow2(e)[:, :, None]
    return tl.reshape(v, (BLOCK_M, BLOCK_K)).to(tl.bfloat16)


@triton.jit
def _load_b_wide(b_ptr, sb_ptr, cols, cmask, k0, K, stride_bn, stride_sbn, W_FP4: tl.constexpr, WB: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W tile [BN, BK] as bf16 holding exactly the stored values times their scales."""
    gs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    gmask = cmask[:, None] & (gs[None, :] * 32 < K)
    c64 = cols.to(tl.int64)
    if W_FP4:
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        p = tl.load(b_ptr + c64[:, None] * stride_bn + half[None, :], mask=cmask[:, None] & (half[None, :] * 2 < K),
                    other=0).to(tl.int32)
        v = e2m1_value(tl.reshape(tl.join(p & 0xF, (p >> 4) & 0xF), (BLOCK_N, BLOCK_K)))
        sb = tl.load(sb_ptr + c64[:, None] * stride_sbn + gs[None, :], mask=gmask, other=127)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(b_ptr + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None] & (kk[None, :] < K),
                    other=0.0).to(tl.float32)
        sb = tl.load(sb_ptr + (cols // WB).to(tl.int64)[:, None] * stride_sbn + (gs * 32 // WB)[None, :], mask=gmask,
                     other=127)
    v = tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 32)) * e8m0_decode(sb)[:, :, None]
    return tl.reshape(v, (BLOCK_N, BLOCK_K)).to(tl.bfloat16)


@triton.jit
def _mx_gemm(a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, wt_ptr, c_ptr, sc_ptr,
             tile_group_ptr, tile_row_ptr, tile_end_ptr, N, K,
             stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_cm, stride_scm, limit,
             A_FP8: tl.constexpr, W_FP4: tl.constexpr, WB: tl.constexpr, GATHER: tl.constexpr,
             GROUPED: tl.constexpr, SWIGLU: tl.constexpr, MMA_BF16: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        grp = tl.load(tile_group_ptr + pid_m)
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
    else:
        grp = 0
        row0 = pid_m * BLOCK_M
        row_end = tl.load(tile_end_ptr)
    if grp >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        if GATHER:
            arow = tl.load(rowid_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            arow = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        bg = b_ptr + grp.to(tl.int64) * stride_bg
        sbg = sb_ptr + grp.to(tl.int64) * stride_sbg
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        b3g = b3_ptr + grp.to(tl.int64) * stride_bg
        sb3g = sb3_ptr + grp.to(tl.int64) * stride_sbg
        if MMA_BF16:  # exact products in bf16 (scales folded in registers), one MMA per BLOCK_K
            for k0 in range(0, K, BLOCK_K):
                a = _load_a_wide(a_ptr, sa_ptr, arow, rmask, k0, K, stride_am, stride_sam, A_FP8, BLOCK_M, BLOCK_K)
                b = _load_b_wide(bg, sbg, cols, cmask, k0, K, stride_bn, stride_sbn, W_FP4, WB, BLOCK_N, BLOCK_K)
                acc = tl.dot(a, tl.trans(b), acc)
                if SWIGLU:
                    b3 = _load_b_wide(b3g, sb3g, cols, cmask, k0, K, stride_bn, stride_sbn, W_FP4, WB, BLOCK_N,
                                      BLOCK_K)
                    acc3 = tl.dot(a, tl.trans(b3), acc3)
        else:  # FP8 MMA per 32-deep K step, scaled by both scales
            for kb in range(0, K // 32):
                kk = kb * 32 + tl.arange(0, 32)
                a, sa = _load_a(a_ptr, sa_ptr, arow, rmask, kk, stride_am, stride_sam, kb, A_FP8)
                b, sb = _load_b(bg, sbg, cols, cmask, kk, kb, stride_bn, stride_sbn, W_FP4, WB)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
                if SWIGLU:
                    b3, sb3 = _load_b(b3g, sb3g, cols, cmask, kk, kb, stride_bn, stride_sbn, W_FP4, WB)
                    acc3 += tl.dot(a, tl.trans(b3)) * (sa[:, None] * sb3[None, :])
        out_rows = rows.to(tl.int64)
        if SWIGLU:
            g = tl.minimum(acc.to(tl.bfloat16).to(tl.float32), limit)
            u = tl.minimum(tl.maximum(acc3.to(tl.bfloat16).to(tl.float32), -limit), limit)
            wt = tl.load(wt_ptr + rows, mask=rmask, other=0.0)
            act = (g / (1.0 + tl.exp(-g)) * u * wt[:, None]).to(tl.bfloat16).to(tl.float32)
            ag = tl.reshape(act, (BLOCK_M, BLOCK_N // 32, 32))
            e = e8m0_exponent(tl.max(tl.abs(ag), 2), 448.0, 1e-4)
            q = tl.reshape(ag * pow2(-e)[:, :, None], (BLOCK_M, BLOCK_N))
            q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
            tl.store(c_ptr + out_rows[:, None] * stride_cm + cols[None, :], q, mask=rmask[:, None] & cmask[None, :])
            gs = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            tl.store(sc_ptr + out_rows[:, None] * stride_scm + gs[None, :], (e + 127).to(tl.uint8),
                     mask=rmask[:, None] & (gs[None, :] * 32 < N))
        else:
            tl.store(c_ptr + out_rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                     mask=rmask[:, None] & cmask[None, :])


@dataclass(frozen=True)
class MxGemmConfig:
    """Launch shape; ``mma="fp8"``: one FP8 MMA per 32-deep K step, scaled after it (the reference's
    block order); ``"bf16"``: operands decoded to bf16 in registers with their scales folded in (every
    product is the same exact value), one MMA per ``block_k``, scales no longer in the MMA loop."""
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4
    mma: str = "fp8"
    block_k: int = 32


MX_GEMM_TUNER = ConfigTuner("mx_gemm", [
    MxGemmConfig(64, 128, 4, 4), MxGemmConfig(128, 128, 8, 4), MxGemmConfig(128, 64, 4, 4),
    MxGemmConfig(64, 64, 4, 4), MxGemmConfig(64, 32, 4, 4),
    MxGemmConfig(128, 128, 8, 3, "bf16", 64), MxGemmConfig(128, 128, 8, 3, "bf16", 128),
    MxGemmConfig(64, 128, 4, 3, "bf16", 128), MxGemmConfig(64, 64, 4, 3, "bf16", 128),
    MxGemmConfig(128, 256, 8, 3, "bf16", 64), MxGemmConfig(64, 32, 4, 4, "bf16", 128),
])
# Measured and dropped: with five more bf16 shapes for single-row expert streaming (BM 16 with BN x BK of
# 64 x 256, 32 x 256, 128 x 128, 32 x 512, and 64 x 128 x 256) the H200 run spent 229 s in its checks
# phase instead of 4 s (their decoded tiles reach 16-32K fp32 values per operand); which one costs the
# time is not yet measured. The list above ran its checks and timings in under a minute.
# Rows from which the activations are quantised by a separate pass (one byte per element afterwards)
# instead of inside the GEMM, where every N-tile would repeat the amax and rounding work.
PREQUANT_MIN_ROWS = 256


def _launch(a, sa, b, sb, out, *, rowid=None, offs=None, b3=None, sb3=None, wt=None, out_scale=None,
            limit: float = 0.0, w_fp4: bool, wb: int = 32, config: Optional[MxGemmConfig] = None):
    M, N = out.shape
    K = a.shape[1]
    if K % 32:
        raise ValueError(f"mx GEMM: K={K} must be a multiple of 32")
    grouped = offs is not None
    swiglu = b3 is not None
    if config is None:
        key = (min(next_pow2(M), 16384), N, K, grouped, swiglu, w_fp4, wb, sa is not None)
        config = MX_GEMM_TUNER.pick(key, lambda cfg: _launch(
            a, sa, b, sb, out, rowid=rowid, offs=offs, b3=b3, sb3=sb3, wt=wt, out_scale=out_scale, limit=limit,
            w_fp4=w_fp4, wb=wb, config=cfg), out.device)
    bm, bn = config.block_m, config.block_n
    if M == 0:
        return out
    b3d = b if grouped else b.unsqueeze(0)
    sb3d = sb if grouped else sb.unsqueeze(0)
    if grouped:
        tg, tr, te, n_tiles = _tile_map(offs, bm, M)
    else:
        n_tiles = cdiv(M, bm)
        te = torch.full((1,), M, dtype=torch.int32, device=a.device)
        tg = tr = te
    dummy = te
    _mx_gemm[(n_tiles, cdiv(N, bn))](
        a, sa if sa is not None else dummy, rowid if rowid is not None else dummy, b3d, sb3d,
        b3 if swiglu else b3d, sb3 if swiglu else sb3d, wt if wt is not None else dummy, out,
        out_scale if out_scale is not None else dummy, tg, tr, te, N, K,
        a.stride(0), sa.stride(0) if sa is not None else 0, b3d.stride(0), b3d.stride(1), sb3d.stride(0),
        sb3d.stride(1), out.stride(0), out_scale.stride(0) if out_scale is not None else 0, float(limit),
        A_FP8=sa is not None, W_FP4=w_fp4, WB=wb, GATHER=rowid is not None, GROUPED=grouped, SWIGLU=swiglu,
        MMA_BF16=config.mma == "bf16", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=config.block_k, num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


# linear_mx paths by row count: up to SPLITK_MAX_ROWS rows a split-K weight stream (decode), above it
# the weight decoded to bf16 (exact) in chunks of at most DEQUANT_MAX_ELEMS and a library GEMM (prefill).
LINEAR_PATHS = ("auto", "splitk", "dequant", "fused")
SPLITK_MAX_ROWS = 128
DEQUANT_MAX_ELEMS = 1 << 26


def linear_path(rows: int, path: str = "auto") -> str:
    """The ``linear_mx`` path that runs for ``rows`` rows (``auto``: by row count)."""
    if path not in LINEAR_PATHS:
        raise ValueError(f"linear_mx: path={path!r}: must be one of {LINEAR_PATHS}")
    if path != "auto":
        return path
    return "splitk" if rows <= SPLITK_MAX_ROWS else "dequant"


def _linear_dequant(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int,
                    out: torch.Tensor) -> torch.Tensor:
    """QDQ(x) in bf16 times the weight decoded to bf16, N-chunk by N-chunk, by ``torch.mm`` (fp32
    accumulation): exact products, only the summation order differs from the reference."""
    from redknot.kernels.triton.dequant_mx import dequant_fp8_bf16, qdq_bf16
    N, K = weight.shape
    xq = qdq_bf16(x2)
    step = max(block, (DEQUANT_MAX_ELEMS // max(K, 1)) // block * block)
    if step >= N:
        return torch.mm(xq, dequant_fp8_bf16(weight, ws, block).t(), out=out)
    buf = torch.empty(step, K, dtype=torch.bfloat16, device=x2.device)
    for n0 in range(0, N, step):
        n1 = min(N, n0 + step)
        wc = dequant_fp8_bf16(weight, ws, block, n0, n1, buf[:n1 - n0])
        out[:, n0:n1] = torch.mm(xq, wc.t())
    return out


# The dense decode streams' weight decode, measured per weight shape on the first call on a GPU (``fp8``
# first: taken untimed off the GPU, under graph capture or with tuning off).
# ``registers_wide``: the ``registers`` kernel with one row tile for up to 128 rows (``dense_row_tile``; a
# 16-row tile reads the whole weight once per 16 rows: 8 times at 128 rows), activations quantised by a
# separate pass above 16 rows, 8 warps from 64-row tiles, the weight tile as the MMA's first operand (its
# 64 columns are the MMA's M; the rows are its N at every row count). Each output is the same dot product
# in the same K order at every row count.
# ``fp8_n32``: the ``fp8`` stream with 32 weight columns per program (below the 64 rows of a Hopper
# warpgroup MMA: synchronous MMAs whose per-group rescales overlap the next group's MMA).
# ``*_f`` (``FUSED_DECODES``): the same stream with the slice sum in the stream launch (``slice_sum``: the last
# program of each output tile adds the tile's partials in slice order; the bits of the two launches, one launch
# fewer per linear). ``*_f16``: and K slices of at least 16 K steps (``split_count``'s ``min_steps``; 4 for
# ``registers``, 8 for ``fp8``): fewer slices, so fewer fp32 partials (S·rows·N·4 bytes written and read again:
# at 32 rows ~28 % of the V4.1 step's dense weight bytes with the default slices, ~110 % at 128 rows), a grid of
# fewer programs; one slice: no partial at all. Both a function of the weight shape only (batch-invariant). Not
# measured on the H200: the tuner keeps them only where the device times them faster.
# ``registers_w64_f*``: ``registers_wide`` with a 64-row tile and 4 warps at every row count (two tiles at 128
# rows): ptxas (sm_90a, triton 3.6) serialises the wgmmas of the swapped ``registers`` kernel with 32-row tiles and
# with 128-row tiles on 8 warps (C7515: non-wgmma instructions define accumulator registers inside the pipeline
# stage), not with 64-row tiles on 4 warps; padded rows cost tensor-core work only.
FUSED_DECODES = ("registers_f", "registers_wide_f", "fp8_f", "fp8_n32_f", "registers_wide_f16", "fp8_f16",
                 "registers_w64_f", "registers_w64_f16")
LINEAR_DECODE_TUNER = ConfigTuner("linear_mx_decode", ["fp8", "scaled", "registers", "registers_wide", "fp8_n32",
                                                       *FUSED_DECODES])
# Rows on which ``LINEAR_DECODE_TUNER`` times its candidates, whatever the size of the call that triggers
# the tuning: the choice is per weight shape, measured at the decode batch the step targets.
LINEAR_TUNE_ROWS = 32
# Calls of at most ``gemv_mx.MAX_ROWS`` rows (decode at batch 1-4): a second choice per weight shape between
# the tensor-core stream ``LINEAR_DECODE_TUNER`` chose (``stream``, first: taken untimed off the GPU) and the
# CUDA-core GEMV streams of ``gemv_mx`` (names in ``gemv_mx.PLANS``), timed on ``LINEAR_SMALL_TUNE_ROWS``
# rows. Each stream keeps a row's bits whatever the other rows of the call, so a row alone equals that row
# among up to four rows and a row among 5-64 rows that row among any other 5-64 (65-128: ``WIDE_ROWS_MIN``);
# where the GEMV stream wins, a row's bits at 1-4 rows and at 5+ rows differ by summation order (the same exact
# products).
# ``SMALL_ROWS_CLASS`` False: one choice for every row count (the stream's).
LINEAR_SMALL_TUNER = ConfigTuner("linear_mx_decode_small", ["stream", "gemv", "gemv_n16", "gemv_k128"])
LINEAR_SMALL_TUNE_ROWS = 1
SMALL_ROWS_CLASS = True
# Calls of ``WIDE_ROWS_MIN`` rows or more (decode batches of 65-128 on the split-K path): ``LINEAR_DECODE_TUNER``'s
# choice of their own per weight shape, timed on ``LINEAR_WIDE_TUNE_ROWS`` rows, under the switch of the 1-4-row
# class (``tuning_cache.small_rows_class()``: off with batch invariance or determinism, one choice for every row
# count then). Why: on an H100 (benchmarks/NOTES.md, run 10, the V4.1 step's eight dense shapes) the choices timed
# at 32 rows summed 1.836 ms a batch-128 step against 1.498 ms for each shape's fastest at 128 rows (wq_b / wo_b:
# registers_wide_f 89.9 / 74.2 us a call, registers_w64_f16 59.1 / 63.8). A row's bits are the same within each
# class: 1-4, 5-64 and 65-128 rows. ``WIDE_ROWS_CLASS`` False: the 32-row choice up to 128 rows.
WIDE_ROWS_CLASS = True
WIDE_ROWS_MIN = 65
LINEAR_WIDE_TUNE_ROWS = 128


def fused_name(name: str) -> tuple[str, bool, int]:
    """(base decode, fused, min K steps per slice or 0 for the decode's default) of a dense decode name."""
    if name not in FUSED_DECODES:
        return name, False, 0
    base, _, steps = name.rpartition("_f")
    return base, True, int(steps or 0)


def _dense_stream(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int, out: torch.Tensor,
                  name: str, unfused: bool = False) -> torch.Tensor:
    """The dense stream ``name`` (``LINEAR_DECODE_TUNER``'s names less the GEMV ones) into ``out``; ``unfused``:
    a ``FUSED_DECODES`` name's launch shape and slices, its slice sum by ``reduce_rows`` (the first-use check's
    comparison)."""
    from redknot.kernels.triton import splitk_mx
    from redknot.kernels.triton.dequant_mx import qdq_bf16
    rows = x2.shape[0]
    dec, fused, min_steps = fused_name(name)
    fused = fused and not unfused
    warps, swap, bn = 4, False, 0
    if dec == "fp8_n32":
        dec, bn = "fp8", 32
    if dec == "registers":
        raw, bm = rows <= splitk_mx.RAW_MAX_ROWS, splitk_mx.ROW_TILE
    elif dec == "registers_wide":
        bm = splitk_mx.dense_row_tile(rows)
        raw, warps, dec, swap = bm == splitk_mx.ROW_TILE, 8 if bm >= 64 else 4, "registers", True
    elif dec == "registers_w64":
        raw, bm, dec, swap = False, 64, "registers", True
    else:
        raw, bm = dec == "fp8" or rows <= splitk_mx.SCALED_RAW_MAX_ROWS, splitk_mx.dense_row_tile(rows)
    splits = None
    if min_steps:   # the stream's own K step (128 for every decode at K a multiple of 128) and column block
        N, K = weight.shape
        splits = splitk_mx.split_count(N, K, bn or (splitk_mx.SCALED_BLOCK_N if dec != "registers" else 64),
                                       splitk_mx.block_k_for(K, False, 0), min_steps)
    p = splitk_mx.splitk_mm(x2 if raw else qdq_bf16(x2), weight, ws, rows, w_fp4=False, wb=block, raw=raw,
                            decode=dec, block_m=bm, num_warps=warps, swap=swap, block_n=bn, splits=splits,
                            out=out if fused else None)
    return p if fused else splitk_mx.reduce_rows(p, out)


def fused_check(decode: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when the ``FUSED_DECODES`` name ``decode`` gives, on fresh random operands, the bits of its base
    decode's two launches (the stream, then ``reduce_rows``): several K slices (the last-program slice sum) and
    one (the direct store), at a few row counts; else what differs (``stream_guard.self_check`` asks it)."""
    from redknot.kernels import mx_formats as mx
    if decode not in FUSED_DECODES:
        return f"{decode!r} is not one of {FUSED_DECODES}"
    g = torch.Generator(device=device).manual_seed(seed)
    for n, k, rows in ((128, 4096, 5), (96, 4096, 33), (64, 256, 3)):
        w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
        x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
        got = _dense_stream(x, w, ws.view(torch.uint8), 32, torch.empty(rows, n, dtype=x.dtype, device=device),
                            decode)
        want = _dense_stream(x, w, ws.view(torch.uint8), 32, torch.empty(rows, n, dtype=x.dtype, device=device),
                             decode, unfused=True)
        if not torch.equal(got, want):
            diff = int((got != want).sum())
            return (f"differs from its two launches (decode={fused_name(decode)[0]!r} and reduce_rows) in {diff} of "
                    f"{got.numel()} values at [{rows}, {n}] K={k}")
    return None


def wide_rows(rows: int) -> bool:
    """Whether a dense decode stream of ``rows`` rows takes the wide row class's choice (``WIDE_ROWS_MIN``)."""
    return WIDE_ROWS_CLASS and tuning_cache.small_rows_class() and rows >= WIDE_ROWS_MIN


def tune_rows(rows: int) -> int:
    """The rows ``LINEAR_DECODE_TUNER`` times its candidates on for a call of ``rows`` rows (its row class)."""
    return LINEAR_WIDE_TUNE_ROWS if wide_rows(rows) else LINEAR_TUNE_ROWS


def decode_key(weight_shape, block: int, rows: int) -> tuple:
    """``LINEAR_DECODE_TUNER``'s key for a call of ``rows`` rows: (shape, block), and the wide class's tuning rows
    after them for a wide call."""
    t = tune_rows(rows)
    return (tuple(weight_shape), block) + ((t,) if t != LINEAR_TUNE_ROWS else ())


def _stream_decode(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int, out: torch.Tensor) -> str:
    """``LINEAR_DECODE_TUNER``'s choice for this weight shape and the call's row class (timed on
    ``LINEAR_TUNE_ROWS`` rows, or ``LINEAR_WIDE_TUNE_ROWS`` for a wide call, whatever the call's size, on the
    class's first call)."""
    made = {}
    m = tune_rows(x2.shape[0])

    def tuning_run(d: str) -> torch.Tensor:
        if not made:
            g = torch.Generator(device=x2.device).manual_seed(0)
            made["x"] = torch.randn(m, x2.shape[1], generator=g, device=x2.device).to(x2.dtype)
            made["out"] = torch.empty(m, weight.shape[0], dtype=out.dtype, device=x2.device)
        return _linear_splitk(made["x"], weight, ws, block, made["out"], d)
    return LINEAR_DECODE_TUNER.pick(decode_key(weight.shape, block, x2.shape[0]), tuning_run, x2.device)


def _linear_splitk(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int,
                   out: torch.Tensor, decode: Optional[str] = None) -> torch.Tensor:
    """Split-K weight stream (``splitk_mx``) and the slice reduction; ``decode`` None: the choice of
    ``LINEAR_DECODE_TUNER`` (``splitk_mx.DECODES`` or ``registers_wide``, see the tuner), at up to
    ``gemv_mx.MAX_ROWS`` rows that of ``LINEAR_SMALL_TUNER`` (``gemv*``: ``gemv_mx``'s CUDA-core stream, four
    rows per launch). ``scaled`` /
    ``fp8``: activations quantised by a separate pass (each program would otherwise repeat the amax work
    for 16+ padded rows per weight tile), one row tile of up to 128 rows (each row tile reads the whole
    weight)."""
    from redknot.kernels.triton import gemv_mx, stream_guard
    rows = x2.shape[0]
    if decode is None and SMALL_ROWS_CLASS and tuning_cache.small_rows_class() and rows <= gemv_mx.MAX_ROWS:
        made_small = {}

        def small_run(d: str) -> torch.Tensor:  # timed on LINEAR_SMALL_TUNE_ROWS rows
            if not made_small:
                g = torch.Generator(device=x2.device).manual_seed(0)
                made_small["x"] = torch.randn(LINEAR_SMALL_TUNE_ROWS, x2.shape[1], generator=g,
                                              device=x2.device).to(x2.dtype)
                made_small["out"] = torch.empty(LINEAR_SMALL_TUNE_ROWS, weight.shape[0], dtype=out.dtype,
                                                device=x2.device)
            dec = _stream_decode(x2, weight, ws, block, out) if d == "stream" else d
            return _linear_splitk(made_small["x"], weight, ws, block, made_small["out"], dec)
        small = LINEAR_SMALL_TUNER.pick((tuple(weight.shape), block), small_run, x2.device)
        decode = _stream_decode(x2, weight, ws, block, out) if small == "stream" else small
    if decode is not None and decode.startswith("gemv"):
        plan = gemv_mx.PLANS[decode]

        def gemv() -> torch.Tensor:
            for r0 in range(0, rows, gemv_mx.MAX_ROWS):  # groups of up to MAX_ROWS rows (each row's own sums)
                gemv_mx.gemv_fp8(x2[r0:r0 + gemv_mx.MAX_ROWS], weight, ws, block,
                                 out[r0:r0 + gemv_mx.MAX_ROWS], plan)
            return out
        return stream_guard.with_fallback(x2.device, decode, gemv,
                                          lambda: _linear_splitk(x2, weight, ws, block, out, "registers"))
    if decode is None:  # measured per weight shape and row class (5-64, 65+; a row's bits the same within a class)
        decode = _stream_decode(x2, weight, ws, block, out)

    def run(dec: str) -> torch.Tensor:
        return _dense_stream(x2, weight, ws, block, out, dec)

    if decode != "registers":
        return stream_guard.with_fallback(x2.device, decode, lambda: run(decode), lambda: run("registers"))
    return run(decode)


def linear_mx(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = 32,
              act_group: int = 32, config: Optional[MxGemmConfig] = None, path: str = "auto",
              decode: Optional[str] = None) -> torch.Tensor:
    """x [..., K] bf16 · Wᵀ (e4m3 [N, K], E8M0 [ceil(N/b), ceil(K/b)]) with per-32 FP8 activations.

    ``path``: ``splitk`` (weight stream, decode), ``dequant`` (bf16 weight chunks + library GEMM,
    prefill), ``fused`` (the FP8-MMA kernel above), ``auto`` by row count (``linear_path``). ``decode``:
    the split-K weight decode (``splitk_mx.DECODES``; None: measured per weight shape)."""
    if act_group != 32:
        raise ValueError(f"linear_mx: act_group={act_group}: the Triton kernel quantises activations per 32")
    if block % 32:
        raise ValueError(f"linear_mx: block={block} must be a multiple of 32")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    chosen = linear_path(x2.shape[0], path)
    if x2.shape[0] and chosen != "fused" and x.dtype == torch.bfloat16:
        ws = weight_scale.view(torch.uint8)
        if chosen == "splitk":
            _linear_splitk(x2, weight, ws, block, out, decode)
        else:
            _linear_dequant(x2, weight, ws, block, out)
        return out.view(*lead, weight.shape[0])
    xs = None
    if x2.shape[0] >= PREQUANT_MIN_ROWS:
        x2, xs = act_quant_mx(x2)
    _launch(x2, xs, weight, weight_scale.view(torch.uint8), out, w_fp4=False, wb=block, config=config)
    return out.view(*lead, weight.shape[0])


@triton.jit
def _combine(y_ptr, inv_ptr, out_ptr, D, stride_y, stride_o, K: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(K):  # slot order j = 0..k-1, fp32
        r = tl.load(inv_ptr + tok * K + j).to(tl.int64)
        acc += tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_path(tokens: int, path: str = "auto") -> str:
    """The ``moe_mx`` path that runs for ``tokens`` tokens (``auto``: split-K up to
    ``moe_mx.GROUPED_MIN_TOKENS``, then ``prefill``: the plan measured fastest, grouped or tiled)."""
    from redknot.kernels.triton import moe_mx as fast_moe
    allowed = fast_moe.PATHS + ("prefill", "fused")
    if path not in allowed:
        raise ValueError(f"moe_mx: path={path!r}: must be one of {allowed}")
    if path != "auto":
        return path
    return "splitk" if tokens <= fast_moe.GROUPED_MIN_TOKENS else "prefill"


def moe_mx(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
           w1_scale: torch.Tensor, w3: torch.Tensor, w3_scale: torch.Tensor, w2: torch.Tensor,
           w2_scale: torch.Tensor, swiglu_limit: float, config: Optional[MxGemmConfig] = None,
           path: str = "auto") -> torch.Tensor:
    """Routed experts with MXFP4 weights (see ``ref_v41.moe_mx``). ``path``: ``splitk`` / ``grouped`` /
    ``tiled`` / ``prefill`` (the measured choice of the last two; ``moe_mx.py``), ``fused`` (below: route
    on device, fused W1/W3 GEMM with SwiGLU + FP8 re-quantisation, W2 GEMM, fixed-order combine; three
    kernels), ``auto`` by token count. No host sync."""
    chosen = moe_path(topk_idx.shape[0], path)
    if chosen != "fused" and x.dtype == torch.bfloat16:
        from redknot.kernels.triton import moe_mx as fast_moe
        args = (x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit)
        if chosen == "splitk":
            return fast_moe.moe_splitk(*args)
        if chosen == "grouped":
            return fast_moe.moe_grouped(*args)
        if chosen == "tiled":
            return fast_moe.moe_splitk(*args, plan=fast_moe.PREFILL_TUNER.candidates[1])
        return fast_moe.moe_prefill(*args)
    T, k = topk_idx.shape
    E, inter = w1.shape[0], w1.shape[1]
    D = w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    rows, inv, offs = route_by_expert(topk_idx, E)  # sorted pair -> token row; pair -> sorted position
    order = torch.empty_like(inv)
    order[inv] = torch.arange(inv.numel(), device=inv.device)
    wt = topk_weight.reshape(-1).float()[order].contiguous()  # routing weight per sorted pair
    M = T * k
    act_q = torch.empty(M, inter, dtype=torch.float8_e4m3fn, device=x.device)
    act_s = torch.empty(M, inter // 32, dtype=torch.uint8, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    xs = None
    if T >= PREQUANT_MIN_ROWS:
        x, xs = act_quant_mx(x)  # once per token, not once per (token, expert) and N-tile
    _launch(x, xs, w1, w1_scale, act_q, rowid=rows.to(torch.int32), offs=offs, b3=w3, sb3=w3_scale, wt=wt,
            out_scale=act_s, limit=swiglu_limit, w_fp4=True, config=config)
    y = torch.empty(M, D, dtype=torch.bfloat16, device=x.device)
    _launch(act_q, act_s, w2, w2_scale, y, offs=offs, w_fp4=True, config=config)
    bd = min(1024, next_pow2(D))
    _combine[(T, cdiv(D, bd))](y, inv, out, D, y.stride(0), out.stride(0), K=k, BLOCK_D=bd, num_warps=4)
    return out
