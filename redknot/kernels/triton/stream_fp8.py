"""Split-K weight stream of an FP8 weight on FP8 tensor cores: nothing is converted per weight element.

``splitk_mx`` with ``decode="fp8"`` runs this kernel for e4m3 weights with E8M0 scales per b×b tile. The
activations arrive quantised (``quant_mx.act_quant_mx``: e4m3 bytes and one E8M0 byte per 32 columns),
so every 32-wide K group is one FP8 MMA of exact e4m3 products whose fp32 result is multiplied by the
weight tile's and the row's scales (both powers of two) and added in K order: the reference's block-wise
sum (§3.0). The weight bytes go from memory to the MMA unconverted; the per-element work the bf16 paths
spend on ``e4m3 -> bf16`` conversions (quarter-rate instructions on SM90, about half of HBM speed for a
one-byte weight) is gone. The scale multiply costs ``rows / 32`` fp32 FMAs per weight element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2
from redknot.kernels.triton.slice_sum import _slice_sum_tail, counters


@triton.jit
def _fp8_stream(a_ptr, sa_ptr, b_ptr, sb_ptr, p_ptr, M, N, K, KSPLIT, stride_am, stride_sam, stride_bn,
                stride_sbn, stride_ps, stride_pm, out_ptr, cnt_ptr, stride_om, WB: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, A_RAW: tl.constexpr,
                FUSE: tl.constexpr = 0):
    """One program: rows [BM] x weight columns [BN] over one K slice, GROUPS 32-wide groups per step.
    A_RAW: ``a`` holds the bf16 rows, quantised here per group (the bits of ``act_quant_mx``). FUSE: the slice
    sum into ``out`` in this launch (``slice_sum``; 0: partials only)."""
    pid_s = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
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
            a = tl.load(a_ptr + r64[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
            if A_RAW:
                x = a.to(tl.float32)
                e = e8m0_exponent(tl.max(tl.abs(x), 1), 448.0, 1e-4)
                a = tl.minimum(tl.maximum(x * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
                sa = pow2(e)
            else:
                sa = e8m0_decode(tl.load(sa_ptr + r64 * stride_sam + k0 // 32, mask=rmask, other=127))
            w = tl.load(b_ptr + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
            sw = e8m0_decode(tl.load(sb_ptr + wrow + k0 // WB, mask=cmask, other=127))
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    omask = rmask[:, None] & cmask[None, :]
    if FUSE != 2:
        out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
        tl.store(p_ptr + out, tl.trans(acc), mask=omask)
    if FUSE != 0:
        _slice_sum_tail(tl.trans(acc), p_ptr, out_ptr, cnt_ptr, tl.program_id(0) * tl.num_programs(1) +
                        tl.program_id(1), rows, cols, omask, stride_ps, stride_pm, stride_om, FUSE)


def fp8_stream(aq: torch.Tensor, sa, w: torch.Tensor, ws: torch.Tensor, p: torch.Tensor, ksplit: int,
               wb: int, block_m: int, block_n: int, num_warps: int = 4, num_stages: int = 4,
               out=None) -> torch.Tensor:
    """fp32 partials ``p`` [S, M, N] of ``(aq · 2^sa) · (w · 2^ws)ᵀ``: aq e4m3 [M, K] with E8M0 ``sa``
    [M, K/32] (or ``sa`` None and ``aq`` the bf16 rows, quantised inside), w e4m3 [N, K] with E8M0 tiles
    ``ws`` [ceil(N/wb), ceil(K/wb)]; slice s covers K columns ``[s·ksplit, (s+1)·ksplit)`` (ksplit a
    multiple of 32). ``out`` [M, N]: also their slice sum cast to its dtype, in the same launch (the bits of
    ``splitk_mx.reduce_rows(p, out)``; ``slice_sum``), returned instead of ``p``."""
    S, M, N = p.shape
    K = w.shape[1]
    if ksplit % 32 or K % 32:
        raise ValueError(f"fp8_stream: K={K} and ksplit={ksplit} must be multiples of 32")
    groups = 4 if ksplit % 128 == 0 and K % 128 == 0 else 1
    if M:
        grid = (cdiv(M, block_m), cdiv(N, block_n), S)
        fuse = 0 if out is None else (2 if S == 1 else 1)
        cnt = counters(p.device, grid[0] * grid[1]) if fuse == 1 else p
        _fp8_stream[grid](
            aq, sa if sa is not None else aq, w, ws, p, M, N, K, ksplit, aq.stride(0),
            sa.stride(0) if sa is not None else 0, w.stride(0), ws.stride(0), p.stride(0), p.stride(1),
            out if out is not None else p, cnt, out.stride(0) if out is not None else 0, WB=wb,
            BLOCK_M=block_m, BLOCK_N=block_n, GROUPS=groups, A_RAW=sa is None, FUSE=fuse, num_warps=num_warps,
            num_stages=num_stages)
    return p if out is None else out
