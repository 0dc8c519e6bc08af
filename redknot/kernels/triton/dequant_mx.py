"""Exact bf16 decodings of the V4.1 GEMM operands, for the library-GEMM and split-K paths.

Every operand of a V4.1 linear is a small-mantissa value times a power of two: an activation after its
per-32 FP8 quantisation is ``e4m3 · 2^e``, an FP8 weight ``e4m3 · 2^s``, an MXFP4 weight ``e2m1 · 2^s``.
Each of those is exactly representable in bf16 (8 exponent bits, 8 significant bits), so a bf16 GEMM on
the decoded operands multiplies exactly the numbers the reference multiplies; only the fp32 summation
order differs (§3.0). These kernels write such decodings:

* ``qdq_bf16``: activations quantised to FP8 per 32 and written back as bf16 (optionally de-interleaved
  into even / odd K columns, the order in which packed FP4 weights hold their two nibbles);
* ``dequant_fp8_bf16``: rows ``n0 .. n1`` of an FP8 weight with E8M0 tile scales;
* ``dequant_fp4_bf16``: a range of experts of an MXFP4 weight;
* ``chunk_rows``: a device-offset range of rows gathered into (or scattered out of) a chunk buffer, so
  an expert chunk's rows move without the host reading the routing counts.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte storage tensor (E8M0 scales, packed FP4 as int8 / float4 pairs) viewed as uint8."""
    return t if t.dtype in (torch.uint8, torch.float8_e4m3fn) else t.view(torch.uint8)


@triton.jit
def fp8_qdq_groups(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BM, BK] -> the per-32 FP8 QDQ values (fp32, exact in bf16), the ``mx_formats`` scale rule."""
    xg = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
    e = e8m0_exponent(tl.max(tl.abs(xg), 2), 448.0, 1e-4)
    q = tl.minimum(tl.maximum(xg * pow2(-e)[:, :, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
    return tl.reshape(q * pow2(e)[:, :, None], (BLOCK_M, BLOCK_K))


@triton.jit
def store_split(out_ptr, rows64, col0, v, mask_r, N, stride_om, stride_oh, SPLIT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store v [BM, BN] at columns ``col0 + [0, BN)`` (col0 and BN even); SPLIT: even columns to half 0
    at column c/2, odd columns to half 1 (``out_ptr + stride_oh``)."""
    cols = col0 + tl.arange(0, BLOCK_N)
    if SPLIT:
        lo, hi = tl.split(tl.reshape(v, (BLOCK_M, BLOCK_N // 2, 2)))
        hc = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        m = mask_r[:, None] & (hc[None, :] < N // 2)
        tl.store(out_ptr + rows64[:, None] * stride_om + hc[None, :], lo, mask=m)
        tl.store(out_ptr + stride_oh + rows64[:, None] * stride_om + hc[None, :], hi, mask=m)
    else:
        tl.store(out_ptr + rows64[:, None] * stride_om + cols[None, :], v,
                 mask=mask_r[:, None] & (cols[None, :] < N))


@triton.jit
def _qdq_rows(x_ptr, out_ptr, M, K, stride_x, stride_om, stride_oh, SPLIT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K),
                other=0.0).to(tl.float32)
    v = fp8_qdq_groups(x, BLOCK_M, BLOCK_K).to(tl.bfloat16)
    store_split(out_ptr, r64, tl.program_id(1) * BLOCK_K, v, rmask, K, stride_om, stride_oh, SPLIT, BLOCK_M, BLOCK_K)


def qdq_bf16(x: torch.Tensor, split: bool = False) -> torch.Tensor:
    """x [M, K] (K % 32 == 0) -> bf16 ``QDQ_fp8(x, per 32)`` [M, K]; ``split``: [2, M, K/2] holding the
    even and the odd columns (element 2i of a row in half 0 at i, element 2i+1 in half 1)."""
    M, K = x.shape
    if K % 32:
        raise ValueError(f"qdq_bf16: K={K} must be a multiple of 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((2, M, K // 2) if split else (M, K), dtype=torch.bfloat16, device=x.device)
    if M:
        bk = 128 if K % 128 == 0 else 32
        bm = 16
        _qdq_rows[(cdiv(M, bm), cdiv(K, bk))](
            x, out, M, K, x.stride(0), out.stride(-2), out.stride(0) if split else 0, SPLIT=split,
            BLOCK_M=bm, BLOCK_K=bk, num_warps=4)
    return out


@triton.jit
def e2m1_scaled(code, scale):
    """e2m1 codes (int32) [R, C] times fp32 scale (broadcastable) -> fp32, exact. Magnitude bits build the
    fp32 directly: codes 2..7 are 2^((m>>1)-1) · (1 + (m&1)/2), code 1 is 0.5, code 0 is 0."""
    m = code & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22), tl.where(m == 1, 0x3F000000, 0))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * scale


@triton.jit
def _dequant_fp8(w_ptr, s_ptr, out_ptr, N, K, n0, stride_w, stride_s, stride_o, WB: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = n0 + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows[:, None] < N) & (cols[None, :] < K)
    r64 = rows.to(tl.int64)
    w = tl.load(w_ptr + r64[:, None] * stride_w + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rows // WB).to(tl.int64)[:, None] * stride_s + (cols // WB)[None, :], mask=m, other=127)
    tl.store(out_ptr + (r64 - n0)[:, None] * stride_o + cols[None, :], (w * e8m0_decode(s)).to(tl.bfloat16), mask=m)


def dequant_fp8_bf16(w: torch.Tensor, ws: torch.Tensor, block: int, n0: int = 0, n1: Optional[int] = None,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows n0..n1 of an e4m3 weight [N, K] with E8M0 tiles [ceil(N/b), ceil(K/b)] -> bf16 [n1-n0, K]."""
    N, K = w.shape
    n1 = N if n1 is None else n1
    out = torch.empty(n1 - n0, K, dtype=torch.bfloat16, device=w.device) if out is None else out
    if n1 > n0:
        bn, bk = 32, 256
        _dequant_fp8[(cdiv(n1 - n0, bn), cdiv(K, bk))](
            w, as_bytes(ws), out, n1, K, n0, w.stride(0), ws.stride(0), out.stride(0), WB=block,
            BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


@triton.jit
def _dequant_fp4(w_ptr, s_ptr, out_ptr, e0, N, K, KH, KG, stride_we, stride_wn, stride_se, stride_sn, stride_oe,
                 stride_on, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    e = e0 + tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    hc = tl.program_id(2) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    p = tl.load(w_ptr + e.to(tl.int64) * stride_we + r64[:, None] * stride_wn + hc[None, :],
                mask=rmask[:, None] & (hc[None, :] < KH), other=0).to(tl.int32)
    gs = tl.program_id(2) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_ptr + e.to(tl.int64) * stride_se + r64[:, None] * stride_sn + gs[None, :],
                mask=rmask[:, None] & (gs[None, :] < KG), other=127)
    codes = tl.reshape(tl.join(p & 0xF, (p >> 4) & 0xF), (BLOCK_N, BLOCK_K // 32, 32))
    v = tl.reshape(e2m1_scaled(codes, e8m0_decode(s)[:, :, None]), (BLOCK_N, BLOCK_K))
    cols = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * stride_oe + r64[:, None] * stride_on + cols[None, :],
             v.to(tl.bfloat16), mask=rmask[:, None] & (cols[None, :] < K))


def dequant_fp4_bf16(w: torch.Tensor, ws: torch.Tensor, e0: int, e1: int, out: torch.Tensor) -> torch.Tensor:
    """Experts e0..e1 of packed MXFP4 w [E, N, K/2] with E8M0 ws [E, N, K/32] -> ``out[:e1-e0]`` bf16 [.., N, K]
    (``out`` may be a column-offset view, e.g. the W3 half of a stacked W1 | W3 buffer)."""
    E, N, KH = w.shape
    K = 2 * KH
    w, ws = as_bytes(w), as_bytes(ws)
    if e1 > e0:
        bn, bk = 16, 256
        _dequant_fp4[(e1 - e0, cdiv(N, bn), cdiv(K, bk))](
            w, ws, out, e0, N, K, K // 2, K // 32, w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), out.stride(0),
            out.stride(1), BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


@triton.jit
def chunk_bounds(bounds_ptr, e0, e1):
    """(first row, end row) of experts e0..e1-1 in rows sorted by expert (``bounds`` = [0, ends...])."""
    return tl.load(bounds_ptr + e0), tl.load(bounds_ptr + e1)


@triton.jit
def _chunk_rows(src_ptr, dst_ptr, rowid_ptr, bounds_ptr, e0, e1, D, stride_s, stride_d, GATHER: tl.constexpr,
                ROWID: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    start, end = chunk_bounds(bounds_ptr, e0, e1)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = start + r < end
    if tl.program_id(0) * BLOCK_R < end - start:
        if GATHER:
            if ROWID:
                src_row = tl.load(rowid_ptr + start + r, mask=ok, other=0).to(tl.int64)
            else:
                src_row = (start + r).to(tl.int64)
            dst_row = r.to(tl.int64)
        else:
            src_row = r.to(tl.int64)
            dst_row = (start + r).to(tl.int64)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = ok[:, None] & (cols[None, :] < D)
            v = tl.load(src_ptr + src_row[:, None] * stride_s + cols[None, :], mask=m)
            tl.store(dst_ptr + dst_row[:, None] * stride_d + cols[None, :], v, mask=m)


def chunk_rows(src: torch.Tensor, dst: torch.Tensor, bounds: torch.Tensor, e0: int, e1: int, gather: bool,
               rowid: Optional[torch.Tensor] = None) -> None:
    """Rows of experts e0..e1-1 (sorted by expert; ``bounds`` int32 [E+1] = 0 then the per-expert ends,
    on the device).

    gather: ``dst[r] = src[rowid[start + r]]`` (or ``src[start + r]`` without rowid) for r < count;
    scatter: ``dst[start + r] = src[r]``. The grid covers ``dst`` / ``src`` capacity; programs past the
    chunk's count return at once, so nothing is read back to the host."""
    cap = dst.shape[0] if gather else src.shape[0]
    D = src.shape[1]
    br, bd = 16, min(1024, triton.next_power_of_2(D))
    if cap:
        _chunk_rows[(cdiv(cap, br),)](src, dst, rowid if rowid is not None else bounds, bounds, e0, e1, D,
                                      src.stride(0), dst.stride(0), GATHER=gather, ROWID=rowid is not None,
                                      BLOCK_R=br, BLOCK_D=bd, num_warps=4)
