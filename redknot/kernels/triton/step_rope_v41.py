"""V4.1's row epilogues in one launch each: RMS norm, interleaved RoPE, FP4 quantise-dequantise.

The PyTorch path (``ref_math.rms_norm`` / ``apply_rope`` / ``index_qdq``) spends 8 + 15 + ~30 small
launches on the q / kv / indexer-query rows of every layer. :func:`rope_rows` does the same per row in one
program: optional RMS norm (fp32, weight multiplied before the cast to the row dtype), rotation of the
interleaved pairs of the last ``2·half`` dims by the angles' cos/sin (a table the caller computes once per
step exactly as ``apply_rope`` does: fp64 angles rounded to fp32), the cast to the row dtype, and
optionally the FP4 e2m1 grid with an E8M0 scale per 32 (the index-query grid of ``index_qdq``).

Bits: the rotation ``re·cos − im·sin`` rounds both products before the difference, as PyTorch's separate
kernels do (on a GPU the products go through ``mul.rn``, which the compiler cannot contract into an FMA),
so RoPE and the FP4 grid equal the PyTorch path exactly; only the norm's mean sums in another order.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import interpreting, next_pow2
from redknot.kernels.triton.quant_mx import e2m1_code, e2m1_value, e8m0_exponent, pow2


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """a·b rounded on its own (never fused into an FMA with a following add)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _rotate_pairs(re, im, i, cos_row, sin_row, FIRST, D2, INVERSE: tl.constexpr, OUT: tl.constexpr,
                  ASM: tl.constexpr):
    """Pairs ``i`` (re, im: fp32 values of the ``OUT`` dtype) rotated by the angles at ``cos_row`` / ``sin_row``
    (entry ``i - FIRST``) where ``FIRST <= i < D2``, conjugate with ``INVERSE``: each product rounded on its own,
    each result rounded to ``OUT``; other pairs as they are."""
    rot = (i >= FIRST) & (i < D2)
    j = tl.maximum(i - FIRST, 0)
    c = tl.load(cos_row + j, mask=rot, other=1.0)
    s = tl.load(sin_row + j, mask=rot, other=0.0)
    if INVERSE:
        s = -s
    new_re = _mul_rn(re, c, ASM) - _mul_rn(im, s, ASM)
    new_im = _mul_rn(re, s, ASM) + _mul_rn(im, c, ASM)
    new_re = tl.where(rot, new_re.to(OUT).to(tl.float32), re)
    new_im = tl.where(rot, new_im.to(OUT).to(tl.float32), im)
    return new_re, new_im


@triton.jit
def _rope_rows(x_ptr, out_ptr, cos_ptr, sin_ptr, w_ptr, heads, stride_xr, stride_or, stride_c, eps,
               D: tl.constexpr, D2P: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, QDQ: tl.constexpr,
               INVERSE: tl.constexpr, ASM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tok = row // heads
    D2: tl.constexpr = D // 2
    FIRST: tl.constexpr = D2 - HALF                     # first rotated pair
    i = tl.arange(0, D2P)                               # pairs, padded to a power of two
    two = tl.arange(0, 2)
    offs = i[:, None] * 2 + two[None, :]                # [D2P, 2]: (re, im) of pair i
    inside = (i < D2)[:, None] & (two[None, :] < 2)
    x = tl.load(x_ptr + row * stride_xr + offs, mask=inside, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        x = (w * (x * r)).to(out_ptr.dtype.element_ty).to(tl.float32)
    re, im = tl.split(x)
    new_re, new_im = _rotate_pairs(re, im, i, cos_ptr + tok * stride_c, sin_ptr + tok * stride_c, FIRST, D2,
                                   INVERSE, out_ptr.dtype.element_ty, ASM)
    y = tl.reshape(tl.join(new_re, new_im), (2 * D2P,))
    if QDQ:                                             # e2m1 grid, E8M0 scale per 32 (the reference's fp4)
        g = tl.reshape(y, (2 * D2P // 32, 32))          # (D is a power of two here: D2P = D / 2)
        e = e8m0_exponent(tl.max(tl.abs(g), 1), 6.0, 7.052966104933725e-38)
        code = e2m1_code(g * pow2(-e)[:, None])
        y = tl.reshape(e2m1_value(code) * pow2(e)[:, None], (2 * D2P,))
    cols = tl.arange(0, 2 * D2P)
    tl.store(out_ptr + row * stride_or + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _rope_table(pos_ptr, inv_ptr, cos_ptr, sin_ptr, N, HALF: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)   # flat (token, pair)
    ok = i < N
    p = tl.load(pos_ptr + i // HALF, mask=ok, other=0).to(tl.float64)
    ang = p * tl.load(inv_ptr + i % HALF, mask=ok, other=0.0)     # fp64, as torch's promoted product
    tl.store(cos_ptr + i, tl.cos(ang).to(cos_ptr.dtype.element_ty), mask=ok)
    tl.store(sin_ptr + i, tl.sin(ang).to(sin_ptr.dtype.element_ty), mask=ok)


def rope_table(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32):
    """(cos, sin) [T, half] in ``dtype`` of angles pos·θ computed in fp64, as ``apply_rope`` computes them.
    Integer positions [T] and fp64 θ on a GPU or under the interpreter: one launch (``_rope_table``: the fp64
    product, fp64 cos / sin, each rounded once to ``dtype``; compiled, cos / sin are CUDA's double-precision
    math functions, the ones torch's kernels call), the bits of ``apply_rope``'s PyTorch form, which runs
    elsewhere."""
    inv = inv_freq.to(pos.device)
    if (inv.dtype == torch.float64 and not pos.is_floating_point() and not pos.is_complex() and pos.dim() == 1
            and (pos.is_cuda or interpreting()) and dtype in (torch.float32, torch.float64)):
        half = inv.shape[0]
        cos = torch.empty(pos.shape[0], half, dtype=dtype, device=pos.device)
        sin = torch.empty_like(cos)
        n = cos.numel()
        if n:
            block = min(1024, next_pow2(n))
            _rope_table[(triton.cdiv(n, block),)](pos.contiguous(), inv.contiguous(), cos, sin, n, HALF=half,
                                                  BLOCK=block, num_warps=4 if block >= 512 else 1)
        return cos, sin
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_w: Optional[torch.Tensor] = None,
              eps: float = 0.0, qdq: bool = False, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D] (D even; a power of two >= 32 with qdq) -> same shape and dtype: optional RMS
    norm (``norm_w`` [D]), RoPE of the last ``2·half`` dims by cos/sin [T, half] (``inverse``: conjugate;
    half may be 0: the norm alone), optional FP4 QDQ per 32."""
    shape = x.shape
    t, d = shape[0], shape[-1]
    heads = x.numel() // max(t * d, 1)
    half = cos.shape[-1]
    if d % 2 or 2 * half > d or (qdq and (d & (d - 1) or d < 32)):
        raise ValueError(f"rope_rows: last dim {d} must be even and >= 2*half ({2 * half})"
                         + (", a power of two >= 32 with qdq" if qdq else ""))
    xr = x.reshape(t * heads, d)
    if xr.stride(-1) != 1:
        xr = xr.contiguous()
    out = torch.empty(t * heads, d, dtype=x.dtype, device=x.device)
    if t * heads:
        w = norm_w if norm_w is not None else cos      # unread without NORM
        _rope_rows[(t * heads,)](xr, out, cos.contiguous(), sin.contiguous(), w, heads, xr.stride(0), out.stride(0),
                                 cos.shape[-1], eps, D=d, D2P=next_pow2(d // 2), HALF=half,
                                 NORM=norm_w is not None, QDQ=qdq,
                                 INVERSE=inverse, ASM=not interpreting() and x.is_cuda, num_warps=1 if d <= 128 else 4)
    return out.view(shape)
