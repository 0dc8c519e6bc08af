"""Row-wise memory-bound ops: RMSNorm and interleaved partial RoPE, one pass each, fp32 math."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, interpreting, next_pow2


@triton.jit
def _rms_norm(x_ptr, w_ptr, out_ptr, M, N, eps, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, out_ptr, M, D, rows_per_token, HALF: tl.constexpr, INVERSE: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    base = rows[:, None].to(tl.int64) * D
    x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0)
    first = D - 2 * HALF
    is_rot = (cols >= first)[None, :] & mask
    partner = tl.load(x_ptr + base + (cols ^ 1)[None, :], mask=is_rot, other=0.0).to(tl.float32)
    pair = tl.maximum(cols - first, 0) // 2
    tok = (rows // rows_per_token).to(tl.int64)
    c = tl.load(cos_ptr + tok[:, None] * HALF + pair[None, :], mask=is_rot, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * HALF + pair[None, :], mask=is_rot, other=0.0)
    # forward: even column a·cos − b·sin, odd column a·sin + b·cos (b / a = the pair partner)
    sign = tl.where(cols % 2 == 0, -1.0, 1.0)
    if INVERSE:
        sign = -sign
    rot = x.to(tl.float32) * c + sign[None, :] * partner * s
    y = tl.where(is_rot, rot.to(out_ptr.dtype.element_ty), x)
    tl.store(out_ptr + base + cols[None, :], y, mask=mask)


@triton.jit
def _rope_tail(x_ptr, cos_ptr, sin_ptr, M, rows_per_token, stride_x, first, HALF: tl.constexpr,
               INVERSE: tl.constexpr, BLOCK_M: tl.constexpr):
    """``_rope``'s rotation of the last HALF pairs of BLOCK_M rows, in place: only those 2·HALF columns are read
    and written (row ``r`` at ``x_ptr + r·stride_x``, its rotated columns from ``first``)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, 2 * HALF)
    mask = (rows < M)[:, None]
    base = x_ptr + rows[:, None].to(tl.int64) * stride_x + first
    x = tl.load(base + cols[None, :], mask=mask, other=0.0)
    partner = tl.load(base + (cols ^ 1)[None, :], mask=mask, other=0.0).to(tl.float32)
    tok = (rows // rows_per_token).to(tl.int64)
    pair = cols // 2
    c = tl.load(cos_ptr + tok[:, None] * HALF + pair[None, :], mask=mask, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * HALF + pair[None, :], mask=mask, other=0.0)
    sign = tl.where(cols % 2 == 0, -1.0, 1.0)   # as ``_rope``: even a·cos − b·sin, odd a·sin + b·cos
    if INVERSE:
        sign = -sign
    rot = x.to(tl.float32) * c + sign[None, :] * partner * s
    tl.store(base + cols[None, :], rot.to(x_ptr.dtype.element_ty), mask=mask)


def rope_inplace_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """``rope_inplace``'s launch: rows of x viewable as [M, D] with unit column stride, a power-of-two pair count."""
    half = cos.shape[-1]
    if x.dim() < 2 or x.stride(-1) != 1 or half < 1 or half & (half - 1) or 2 * half > x.shape[-1]:
        return False
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return x.is_cuda or interpreting()


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``rope``'s values written into x's trailing ``2·cos.shape[-1]`` columns, in one launch that moves only
    those columns; returns x (see ``rope_inplace_supported``)."""
    d, half = x.shape[-1], cos.shape[-1]
    rows = x.view(-1, d)
    m, t = rows.shape[0], x.shape[0]
    if m == 0:
        return x
    block_m = max(1, min(64, 2048 // (2 * half)))
    _rope_tail[(cdiv(m, block_m),)](rows, cos.float().contiguous(), sin.float().contiguous(), m, m // t,
                                    rows.stride(0), d - 2 * half, HALF=half, INVERSE=inverse, BLOCK_M=block_m,
                                    num_warps=4)
    return x


@triton.jit
def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, M, rows_per_token, eps, N: tl.constexpr, HALF: tl.constexpr,
               HAS_W: tl.constexpr, BLOCK_M: tl.constexpr):
    """``_rms_norm`` of BLOCK_M rows of N (a power of two), rounded to the output dtype, then ``_rope``'s rotation
    of their last HALF pairs in the same pass (a row's pairs split out of its registers, not loaded again)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, N)
    rmask = rows < M
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 1) / N + eps)[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols).to(tl.float32)[None, :]
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    a, b = tl.split(tl.reshape(y, (BLOCK_M, N // 2, 2)))
    pair = tl.arange(0, N // 2)
    first: tl.constexpr = N // 2 - HALF
    rot = (pair >= first)[None, :] & rmask[:, None]
    j = tl.where(pair >= first, pair - first, 0)
    tok = (rows // rows_per_token).to(tl.int64)
    c = tl.load(cos_ptr + tok[:, None] * HALF + j[None, :], mask=rot, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * HALF + j[None, :], mask=rot, other=0.0)
    out = tl.reshape(tl.join(tl.where(rot, a * c - b * s, a), tl.where(rot, a * s + b * c, b)), (BLOCK_M, N))
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


def norm_rope_supported(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``norm_rope`` takes x [T, ..., N]: N a power of two from 4 to 4096 holding the rotated pairs."""
    n = x.shape[-1]
    return 4 <= n <= 4096 and n & (n - 1) == 0 and 0 < 2 * cos.shape[-1] <= n and x.shape[0] == cos.shape[0]


def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """``rope(rms_norm(x, weight, eps), cos, sin)`` in one launch (x [T, ..., N]; see ``norm_rope_supported``)."""
    n = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc)
    m = xc.numel() // n
    if m == 0:
        return out
    block_m = max(1, min(16, 2048 // n))
    _norm_rope[(cdiv(m, block_m),)](xc, weight if weight is not None else xc, cos.float().contiguous(),
                                    sin.float().contiguous(), out, m, m // x.shape[0], eps, N=n, HALF=cos.shape[-1],
                                    HAS_W=weight is not None, BLOCK_M=block_m, num_warps=4 if n <= 1024 else 8)
    return out


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x · rsqrt(mean(x²) + eps) (· weight)`` over the last dim, fp32 math, x's dtype out."""
    n = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc) if out is None else out
    m = xc.numel() // max(n, 1)
    if m == 0:
        return out
    block_n = next_pow2(n)
    block_m = max(1, min(16, 4096 // block_n))
    _rms_norm[(cdiv(m, block_m),)](xc, weight if weight is not None else xc, out, m, n, eps,
                                   HAS_W=weight is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                                   num_warps=4 if block_n <= 2048 else 8)
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rotate interleaved pairs of the trailing ``2·cos.shape[-1]`` dims of ``x [T, ..., D]`` by the
    per-token angles (cos/sin ``[T, r/2]`` fp32); ``inverse`` rotates back."""
    d = x.shape[-1]
    xc = x.contiguous()
    out = torch.empty_like(xc) if out is None else out
    t = x.shape[0]
    m = xc.numel() // max(d, 1)
    if m == 0:
        return out
    block_d = next_pow2(d)
    block_m = max(1, min(32, 4096 // block_d))
    _rope[(cdiv(m, block_m),)](xc, cos.float().contiguous(), sin.float().contiguous(), out, m, d, m // t,
                               HALF=cos.shape[-1], INVERSE=inverse, BLOCK_M=block_m, BLOCK_D=block_d,
                               num_warps=4)
    return out
