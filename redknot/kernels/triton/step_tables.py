"""Per-step tables of a V4 step in one launch each: the rotary cos / sin at the step's positions
(``rope_cos_sin``), a decode step's window-ring write (``ring_write``) and the compressed entries every row sees
(``visible_entries``). Each replaces a handful of PyTorch elementwise launches (a cast, the angle product, cos,
sin; a cast, two products, a remainder, a sum and the ``index_copy``; an arange, a sum, a division, a fill and a
select) that a batch-1 step in a CUDA graph pays one launch latency each for."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, interpreting, next_pow2
from redknot.kernels.triton.step_compress_v41 import _LIBDEVICE, _cos_sin


@triton.jit
def _cos_sin_rows(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, HALF, BLOCK_T: tl.constexpr, HALF_P2: tl.constexpr,
                  LIBDEVICE: tl.constexpr):
    """Rows ``BLOCK_T`` at a time: angle = fp32(position) · inv (one fp32 product, as the reference), then cos, sin."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, HALF_P2)
    tm, im = t < T, i < HALF
    p = tl.load(pos_ptr + t, mask=tm, other=0).to(tl.float32)
    inv = tl.load(inv_ptr + i, mask=im, other=0.0)
    c, s = _cos_sin(p[:, None] * inv[None, :], LIBDEVICE)
    at = t.to(tl.int64)[:, None] * HALF + i[None, :]
    m = tm[:, None] & im[None, :]
    tl.store(cos_ptr + at, c, mask=m)
    tl.store(sin_ptr + at, s, mask=m)


def cos_sin_rows(positions: torch.Tensor, inv: torch.Tensor):
    """``reference.rope_cos_sin``: cos, sin [T, half] fp32 at ``positions`` [T] (any integer dtype)."""
    T, half = positions.shape[0], inv.shape[0]
    cos = torch.empty(T, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if T and half:
        block_t = max(1, min(64, 4096 // next_pow2(half)))
        _cos_sin_rows[(cdiv(T, block_t),)](positions, inv.float().contiguous(), cos, sin, T, half, BLOCK_T=block_t,
                                           HALF_P2=next_pow2(half), LIBDEVICE=_LIBDEVICE and not interpreting(),
                                           num_warps=4 if block_t * half >= 2048 else 1)
    return cos, sin


@triton.jit
def _ring_write(val_ptr, ring_ptr, slot_ptr, pos_ptr, C, R, stride_v, BLOCK_C: tl.constexpr):
    """Row b of the values into the ring row ``slot_b · R + pos_b mod R`` (the values cast to the ring's dtype)."""
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < C
    dest = tl.load(slot_ptr + b).to(tl.int64) * R + tl.load(pos_ptr + b).to(tl.int64) % R
    v = tl.load(val_ptr + b.to(tl.int64) * stride_v + cols, mask=cm)
    tl.store(ring_ptr + dest * C + cols, v.to(ring_ptr.dtype.element_ty), mask=cm)


def supported_ring_write(values: torch.Tensor, ring: torch.Tensor, seq_slots: torch.Tensor,
                         positions: torch.Tensor) -> bool:
    return (values.dim() == 2 and ring.dim() == 3 and ring.is_contiguous() and values.stride(-1) == 1
            and values.shape[1] == ring.shape[2] and seq_slots.shape[0] == positions.shape[0] == values.shape[0]
            and (values.is_cuda or interpreting()))


def ring_write(values: torch.Tensor, ring: torch.Tensor, seq_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """``reference.ring_write`` in one launch."""
    B, C = values.shape
    if B:
        block_c = min(1024, next_pow2(C))
        _ring_write[(B, cdiv(C, block_c))](values, ring, seq_slots, positions, C, ring.shape[1], values.stride(0),
                                           BLOCK_C=block_c, num_warps=4)


@triton.jit
def _visible_entries(pos_ptr, out_ptr, width, ratio, BLOCK: tl.constexpr):
    """Row t, ``BLOCK`` ids at a time: w where w < (p_t + 1) // ratio, else -1."""
    t = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seen = (tl.load(pos_ptr + t).to(tl.int64) + 1) // ratio
    tl.store(out_ptr + t * width + w, tl.where(w < seen, w, -1).to(tl.int64), mask=w < width)


def visible_entries(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """``reference.visible_entries`` in one launch."""
    T = positions.shape[0]
    out = torch.empty(T, width, dtype=torch.long, device=positions.device)
    if T and width:
        block = min(1024, next_pow2(width))
        _visible_entries[(T, cdiv(width, block))](positions, out, width, ratio, BLOCK=block, num_warps=4)
    return out
