"""Reference codecs for the V4 checkpoint weight formats.

* FP8: e4m3fn values, one ue8m0 (power-of-two) scale per 128x128 block:
  ``W[n, k] = float(q[n, k]) * S[n // 128, k // 128]``.
* FP4 (routed experts of some releases): e2m1 codes packed two per byte, element
  ``2i`` in the low nibble and ``2i+1`` in the high nibble, one ue8m0 scale per
  32 consecutive elements of a row: ``W[n, k] = e2m1(code) * S[n, k // 32]``.

Scales are handled as float32 powers of two in memory; the checkpoint stores
them as F8_E8M0 (``torch.float8_e8m0fnu``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

FP8_BLOCK = 128
FP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 magnitudes by 3-bit code; bit 3 of a nibble is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def is_fp4_packed(t: torch.Tensor) -> bool:
    return t.dtype in (torch.int8, torch.uint8)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (1 for all-zero groups)."""
    amax = amax.float()
    exp = torch.ceil(torch.log2(torch.where(amax > 0, amax / qmax, torch.ones_like(amax))))
    return torch.exp2(exp.clamp(-127, 127))


def _block_view(w: torch.Tensor, block: int) -> Tuple[torch.Tensor, int, int]:
    n, k = w.shape
    nb, kb = _cdiv(n, block), _cdiv(k, block)
    padded = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    return padded.view(nb, block, kb, block), nb, kb


def quantize_fp8_block(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3fn [N, K], fp32 power-of-two scales [ceil(N/128), ceil(K/128)])."""
    n, k = w.shape
    blocks, nb, kb = _block_view(w, FP8_BLOCK)
    scale = _pow2_scale(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)  # [nb, kb]
    q = (blocks / scale[:, None, :, None]).view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    n, k = q.shape
    s = scale.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:n, :k]
    return (q.float() * s).to(dtype)


def _e2m1_table(device) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])  # [16] value of each 4-bit code


def _e2m1_codes(a: torch.Tensor) -> torch.Tensor:
    """Scaled values (|a| <= 6) -> 4-bit codes: nearest e2m1 value, exact ties to the even code."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=a.device)
    odd = (torch.arange(8, device=a.device) % 2).double()
    dist = (a.double().abs()[..., None] - mags).abs() + 1e-12 * odd
    mag = dist.argmin(-1).to(torch.uint8)
    return mag | (((a < 0) & (mag != 0)).to(torch.uint8) << 3)  # no negative zero


def quantize_fp4(w: torch.Tensor, rows_per_chunk: int = 256) -> Tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float (K % 32 == 0) -> (int8 packed [N, K/2], fp32 power-of-two scales [N, K/32])."""
    n, k = w.shape
    if k % FP4_GROUP:
        raise ValueError(f"FP4 needs the inner dimension to be a multiple of {FP4_GROUP}, got {k}")
    groups = w.float().view(n, k // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=-1), E2M1_MAX)  # [N, K/32]
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    for r0 in range(0, n, rows_per_chunk):
        a = (groups[r0:r0 + rows_per_chunk] / scale[r0:r0 + rows_per_chunk, :, None]).flatten(1)
        code = _e2m1_codes(a)
        packed[r0:r0 + rows_per_chunk] = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [N, K/2] -> e2m1 values as float32 [N, K] (unscaled)."""
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2).long()
    return _e2m1_table(packed.device)[codes]


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    vals = unpack_fp4(packed)
    return (vals * scale.float().repeat_interleave(FP4_GROUP, -1)).to(dtype)


def dequantize(weight: torch.Tensor, scale: Optional[torch.Tensor], dtype) -> torch.Tensor:
    """Any stored weight form (float, FP8 + block scales, packed FP4 + group scales) -> float ``dtype``."""
    if is_fp8(weight):
        if scale is None:
            raise ValueError("an FP8 weight needs its block scale")
        return dequantize_fp8_block(weight, scale, dtype)
    if is_fp4_packed(weight):
        if scale is None:
            raise ValueError("a packed FP4 weight needs its group scale")
        return dequantize_fp4(weight, scale, dtype)
    return weight.to(dtype)


def logical_shape(weight: torch.Tensor) -> Tuple[int, int]:
    """[N, K] of the matrix a stored weight represents."""
    n, k = weight.shape[-2:]
    return (n, 2 * k) if is_fp4_packed(weight) else (n, k)
