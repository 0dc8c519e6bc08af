"""Triton quantisers for the V4.1 formats: per-32 FP8 activations, cache rows written on insert, and
the Engram row gather. Scales follow :mod:`redknot.kernels.mx_formats` bit for bit: the E8M0
exponent comes from the fp32 bits of ``amax / fmax`` (rounded up when any mantissa bit is set), the
scale and its inverse are built from exponent bits (exact), values round to nearest even.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton._common import cdiv, next_pow2


@triton.jit
def e8m0_exponent(amax, FMAX: tl.constexpr, FLOOR: tl.constexpr):
    """ceil(log2(max(amax, FLOOR) / FMAX)) as int32, from the exponent bits (ratio is a normal fp32).
    The ratio is divided with IEEE rounding (``div_rn``) as PyTorch divides: Triton's ``/`` is
    ``div.full.f32`` on NVIDIA GPUs, which may land 1 ulp off an exact power of two and move the scale."""
    a = tl.maximum(amax, FLOOR)
    ratio = tl.div_rn(a, tl.zeros_like(a) + FMAX)
    bits = ratio.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def pow2(e):
    """2^e for integer e in [-126, 127], exactly (built from exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_decode(byte):
    """E8M0 bytes (any int type) -> fp32 2^(byte-127) for bytes 1..254 (0 -> 2^-127 via halving)."""
    b = byte.to(tl.int32)
    return tl.where(b == 0, pow2(b - 126) * 0.5, pow2(tl.maximum(b, 1) - 127))


@triton.jit
def e2m1_code(v):
    """fp32 (already divided by its scale) -> e2m1 code 0..15 as int32, ties to the even code."""
    v = tl.minimum(tl.maximum(v, -6.0), 6.0)
    m = tl.abs(v)
    c = (m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + \
        (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32)
    return c | (((v < 0) & (c != 0)).to(tl.int32) << 3)


@triton.jit
def e2m1_to_e4m3_bits(code):
    """e2m1 code (int32, 0..15) -> the e4m3 byte of the same value (every e2m1 value is exact in e4m3)."""
    mag = code & 7
    ex = mag >> 1
    man = mag & 1
    bits = tl.where(ex == 0, man * 0x30, ((ex + 6) << 3) | (man << 2))
    return bits | ((code & 8) << 4)


@triton.jit
def e2m1_value(code):
    """e2m1 code (int32) -> fp32 value."""
    return e2m1_to_e4m3_bits(code).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_half(code):
    """e2m1 code (int32 0..15) -> fp16 holding the e2m1 value times 2^-14, exactly: the code's magnitude
    bits land on the fp16 exponent's two low bits and the mantissa's top bit (code 1, 0.5, becomes the
    subnormal 2^-15), its sign on the sign bit. Five integer operations per value instead of the e4m3
    route's dozen and its fp8 conversion; callers fold the 2^14 into the scale they multiply by anyway."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def unpack_fp4_row(packed):
    """uint8 [R, C] packed codes -> int32 codes [R, 2C] (element 2i = low nibble)."""
    b = packed.to(tl.int32)
    return tl.reshape(tl.join(b & 0xF, (b >> 4) & 0xF), (packed.shape[0], packed.shape[1] * 2))


@triton.jit
def _act_quant(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s,
               BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g0 = tl.program_id(1) * GROUPS
    cols = g0 * GROUP + tl.arange(0, GROUPS * GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows[:, None].to(tl.int64)
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xg = tl.reshape(x, (BLOCK_M, GROUPS, GROUP))
    e = e8m0_exponent(tl.max(tl.abs(xg), 2), 448.0, 1e-4)  # [BM, G]
    q = tl.reshape(xg * pow2(-e)[:, :, None], (BLOCK_M, GROUPS * GROUP))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
    tl.store(q_ptr + r64 * stride_q + cols[None, :], q, mask=mask)
    gs = g0 + tl.arange(0, GROUPS)
    tl.store(s_ptr + r64 * stride_s + gs[None, :], (e + 127).to(tl.uint8),
             mask=(rows[:, None] < M) & (gs[None, :] * GROUP < K))


def act_quant_mx(x: torch.Tensor, group: int = mx.MX_GROUP):
    """x [M, K] (K % group == 0) -> (e4m3 [M, K], E8M0 bytes [M, K/group])."""
    M, K = x.shape
    if K % group:
        raise ValueError(f"act_quant_mx: K={K} must be a multiple of group={group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, K // group, dtype=torch.uint8, device=x.device)
    if M:
        groups = min(next_pow2(K // group), max(1, 256 // group))
        bm = 16
        _act_quant[(cdiv(M, bm), cdiv(K // group, groups))](
            x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=bm, GROUPS=groups, GROUP=group,
            num_warps=4)
    return q, s


@triton.jit
def _insert_rows(x_ptr, slot_ptr, cache_ptr, T, stride_x, stride_c,
                 D: tl.constexpr, FMT: tl.constexpr, BLOCK_R: tl.constexpr):
    """FMT 0: window (FP8 + E8M0/32); 1: compressed (FP4 + e4m3/16); 2: index key (FP4 + E8M0/32)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    slots = tl.load(slot_ptr + rows, mask=rows < T, other=-1).to(tl.int64)
    ok = slots >= 0
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    base = cache_ptr + slots[:, None] * stride_c
    if FMT == 0:
        xg = tl.reshape(x, (BLOCK_R, D // 32, 32))
        e = e8m0_exponent(tl.max(tl.abs(xg), 2), 448.0, 1e-4)
        q = tl.reshape(xg * pow2(-e)[:, :, None], (BLOCK_R, D))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(base + cols[None, :], q, mask=ok[:, None])
        gs = tl.arange(0, D // 32)
        tl.store(base + D + gs[None, :], (e + 127).to(tl.uint8), mask=ok[:, None])
    else:
        G: tl.constexpr = 16 if FMT == 1 else 32
        xg = tl.reshape(x, (BLOCK_R, D // G, G))
        amax = tl.max(tl.abs(xg), 2)
        if FMT == 1:
            # IEEE division (Triton's ``/`` is approximate on GPUs): amax/6 often lies exactly on an
            # e4m3 rounding midpoint (bf16 inputs), where a 1-ulp error picks the other scale.
            a = tl.maximum(amax, 0.01171875)
            s8 = tl.div_rn(a, tl.zeros_like(a) + 6.0).to(tl.float8e4nv)
            s = s8.to(tl.float32)
            sbyte = s8.to(tl.uint8, bitcast=True)
            v = tl.div_rn(xg, s[:, :, None])
        else:
            e = e8m0_exponent(amax, 6.0, 7.052966104933725e-38)
            sbyte = (e + 127).to(tl.uint8)
            v = xg * pow2(-e)[:, :, None]
        code = tl.reshape(e2m1_code(v), (BLOCK_R, D // 2, 2))
        lo, hi = tl.split(code)
        tl.store(base + tl.arange(0, D // 2)[None, :], (lo | (hi << 4)).to(tl.uint8), mask=ok[:, None])
        gs = tl.arange(0, D // G)
        tl.store(base + D // 2 + gs[None, :], sbyte, mask=ok[:, None])


_FMT_CODE = {"window": 0, "compressed": 1, "index": 2}


def cache_insert_mx(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise rows x [T, D] into the uint8 byte cache [num_slots, row_bytes] at ``slots`` (-1 skips)."""
    if fmt not in _FMT_CODE:
        raise ValueError(f"fmt={fmt!r}: must be one of {sorted(_FMT_CODE)}")
    T, D = x.shape
    if D & (D - 1) or D < 32:
        raise ValueError(f"cache_insert_mx: head dim {D} must be a power of two >= 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if T:
        br = max(1, min(16, 8192 // D))
        _insert_rows[(cdiv(T, br),)](x, slots.contiguous(), cache, T, x.stride(0), cache.stride(0), D=D,
                                     FMT=_FMT_CODE[fmt], BLOCK_R=br, num_warps=4)
    return cache


@triton.jit
def _gather_rows(table_ptr, scale_ptr, ids_ptr, out_ptr, N, stride_t, stride_s, stride_o,
                 W: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < N
    ids = tl.load(ids_ptr + r, mask=ok, other=0).to(tl.int64)
    cols = tl.arange(0, W)
    q = tl.load(table_ptr + ids[:, None] * stride_t + cols[None, :], mask=ok[:, None], other=0)
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    sb = tl.load(scale_ptr + ids[:, None] * stride_s + tl.arange(0, W // 32)[None, :], mask=ok[:, None], other=127)
    v = tl.reshape(tl.reshape(v, (BLOCK_R, W // 32, 32)) * e8m0_decode(sb)[:, :, None], (BLOCK_R, W))
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_o + cols[None, :], v.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def engram_gather_mx(table: torch.Tensor, table_scale: torch.Tensor, ids: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """rows [T, n, W] of an e4m3 table [R, W] with E8M0 [R, W/32], read by the device directly
    (a pinned host table is read over the bus: zero-copy, only the chosen rows move)."""
    t_bytes = table.view(torch.uint8)
    flat = ids.reshape(-1).contiguous()
    W = table.shape[1]
    out = torch.empty(flat.numel(), W, dtype=dtype, device=ids.device)
    if flat.numel():
        br = 16
        _gather_rows[(cdiv(flat.numel(), br),)](t_bytes, table_scale, flat, out, flat.numel(), t_bytes.stride(0),
                                               table_scale.stride(0), out.stride(0), W=W, BLOCK_R=br, num_warps=4)
    return out.view(*ids.shape, W)
