"""The q and kv row epilogues of a V4.1 attention layer in one launch.

Every layer rotates its query heads (``RoPE(wq_b(qr))``) and normalises and rotates its kv latent
(``RoPE(rms_norm(wkv(u)))``) by the same positions and RoPE table: two launches of
``step_rope_v41.rope_rows``. :func:`rope_q_kv` does both in one launch, the first ``T·H`` programs on the
query rows and the last ``T`` on the kv rows, each program the same per-row math as ``rope_rows`` (the
same expressions, shapes and warps: the same bits, which the tests check).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import interpreting, next_pow2
from redknot.kernels.triton.step_rope_v41 import _rotate_pairs


@triton.jit
def _rope_row(x_ptr, out_ptr, row, tok, cos_ptr, sin_ptr, w_ptr, stride_xr, stride_or, stride_c, eps,
              D: tl.constexpr, D2P: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, ASM: tl.constexpr):
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
                                   False, out_ptr.dtype.element_ty, ASM)
    y = tl.reshape(tl.join(new_re, new_im), (2 * D2P,))
    cols = tl.arange(0, 2 * D2P)
    tl.store(out_ptr + row * stride_or + cols, y.to(out_ptr.dtype.element_ty), mask=cols < D)


@triton.jit
def _rope_q_kv(q_ptr, qo_ptr, kv_ptr, kvo_ptr, cos_ptr, sin_ptr, w_ptr, heads, n_q, stride_q, stride_qo, stride_kv,
               stride_kvo, stride_c, eps, D: tl.constexpr, D2P: tl.constexpr, HALF: tl.constexpr,
               ASM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    if pid < n_q:
        _rope_row(q_ptr, qo_ptr, pid, pid // heads, cos_ptr, sin_ptr, w_ptr, stride_q, stride_qo, stride_c, eps,
                  D, D2P, HALF, False, ASM)
    else:
        tok = pid - n_q
        _rope_row(kv_ptr, kvo_ptr, tok, tok, cos_ptr, sin_ptr, w_ptr, stride_kv, stride_kvo, stride_c, eps,
                  D, D2P, HALF, True, ASM)


def rope_q_kv(q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm_w: torch.Tensor,
              eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(RoPE(q), RoPE(rms_norm(kv, norm_w))): q [T, H, D], kv [T, D] (16-bit, D even), cos/sin [T, half] (the
    step's table, ``step_rope_v41.rope_table``) -> the same as ``rope_rows(q, cos, sin)`` and
    ``rope_rows(kv, cos, sin, norm_w=norm_w, eps=eps)``, in one launch."""
    t, heads, d = q.shape
    half = cos.shape[-1]
    if kv.shape != (t, d) or d % 2 or 2 * half > d or kv.dtype != q.dtype:
        raise ValueError(f"rope_q_kv: q {tuple(q.shape)} and kv {tuple(kv.shape)} ({q.dtype}, {kv.dtype}) need "
                         f"kv [{t}, {d}] of q's dtype, D even and >= 2*half ({2 * half})")
    qr = q.reshape(t * heads, d)
    qr = qr if qr.stride(-1) == 1 else qr.contiguous()
    kvr = kv if kv.stride(-1) == 1 else kv.contiguous()
    q_out = torch.empty(t * heads, d, dtype=q.dtype, device=q.device)
    kv_out = torch.empty(t, d, dtype=kv.dtype, device=kv.device)
    if t:
        cos, sin = cos.contiguous(), sin.contiguous()
        _rope_q_kv[(t * heads + t,)](qr, q_out, kvr, kv_out, cos, sin, norm_w, heads, t * heads, qr.stride(0),
                                      q_out.stride(0), kvr.stride(0), kv_out.stride(0), cos.shape[-1], eps, D=d,
                                      D2P=next_pow2(d // 2), HALF=half, ASM=not interpreting() and q.is_cuda,
                                      num_warps=1 if d <= 128 else 4)
    return q_out.view(t, heads, d), kv_out
