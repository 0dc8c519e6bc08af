"""V4.1 prefill rows: the PyTorch work between the registry ops of a prefill chunk, in one pass each.

At 8192 rows and V4.1 widths (D 5120, 4 streams, 64 heads x 512) the eager layer's elementwise steps move
gigabytes per layer through HBM; these kernels do the same arithmetic with one read and one write:

* :func:`rope_cols_` rotates, in place, only the last ``2·half`` dims of each row (the q rows after
  ``wq_b`` and the attention output before ``wo_a``): ``step_rope_v41.rope_rows`` (no norm, no grid) reads
  and writes every column, 1.07 GB per [8192, 64, 512] tensor; the rotated 64 columns are 134 MB. The same
  products (``mul.rn``) and casts as ``rope_rows``, so the same bits as ``ref_math.apply_rope``.
* :func:`swiglu_rows` is ``moe.swiglu_expert``'s activation (fp32 clamp, SiLU by libdevice ``exp`` and a
  correctly rounded division, the product, the optional routing weight, the cast): PyTorch runs seven
  fp32 passes over [T, inter] (0.95 GB per layer for the shared expert at 8192 rows), this reads the two
  bf16 inputs and writes the bf16 activation (113 MB).
* :func:`add_post` is ``mhc_post(bf16(routed + shared), h, post, comb)``: the MoE's combine (fp32 sum of two
  bf16 rows, one cast) and the mHC post mix of the ffn site (``mhc._mhc_post``'s code) in one pass; the
  PyTorch combine alone moves 1.26 GB per layer at 8192 rows.
* :func:`collapse_rows` is ``mhc.hc_collapse``: bf16(Σ_c pre[c]·h_c) in fp32, one read of the streams
  (PyTorch: an fp32 copy of the streams, the products, the sum, the cast: 3.4 GB at 8192 rows).

Bits: ``rope_cols_`` and ``add_post`` equal the PyTorch path exactly (``add_post``: the sum of two bf16 values
is exact in fp32 before its one rounding; the post mix is ``_mhc_post``'s code). ``swiglu_rows`` uses the
transcendental and division PyTorch's CUDA kernels call (on a GPU; Triton's interpreter substitutes numpy's
``exp``). ``collapse_rows`` sums the streams in another order than PyTorch (one bf16 ulp at most after the
cast). None of this is measured on the H200 yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, interpreting, next_pow2
from redknot.kernels.triton.mhc import _post_mix
from redknot.kernels.triton.step_moe_v41 import _LIBDEVICE, _exp
from redknot.kernels.triton.step_rope_v41 import _mul_rn


# ---------------------------------------------------------------------- RoPE of the rotated columns, in place
@triton.jit
def _rope_cols(x_ptr, cos_ptr, sin_ptr, T, heads, stride_t, stride_h, stride_c, col0,
               HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
               INVERSE: tl.constexpr, ASM: tl.constexpr):
    """Program (i, j): tokens [i·BLOCK_T, +BLOCK_T) x heads [j·BLOCK_H, +BLOCK_H). Each row's 2·HALF rotated
    columns are one contiguous (vectorised) load and store; the interleaved pairs are split in registers
    (reshape to [..., HALF_P, 2] + split, join + reshape back), and cos/sin are read once per token for all
    the program's heads."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cc = tl.arange(0, 2 * HALF_P)
    j = tl.arange(0, HALF_P)
    tm = tok < T
    m = (tm[:, None, None] & (hh < heads)[None, :, None]) & (cc < 2 * HALF)[None, None, :]
    ptr = (x_ptr + tok.to(tl.int64)[:, None, None] * stride_t + hh.to(tl.int64)[None, :, None] * stride_h
           + col0 + cc[None, None, :])
    x = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    re, im = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, HALF_P, 2]))
    cm = tm[:, None] & (j < HALF)[None, :]
    crow = cos_ptr + tok.to(tl.int64)[:, None] * stride_c + j[None, :]
    c = tl.load(crow, mask=cm, other=1.0)[:, None, :]
    s = tl.load(sin_ptr + tok.to(tl.int64)[:, None] * stride_c + j[None, :], mask=cm, other=0.0)[:, None, :]
    if INVERSE:
        s = -s
    new_re = _mul_rn(re, c, ASM) - _mul_rn(im, s, ASM)
    new_im = _mul_rn(re, s, ASM) + _mul_rn(im, c, ASM)
    y = tl.reshape(tl.join(new_re, new_im), [BLOCK_T, BLOCK_H, 2 * HALF_P])
    tl.store(ptr, y.to(x_ptr.dtype.element_ty), mask=m)


def rope_cols_shape(t: int, heads: int, half: int, elems: int = 4096):
    """(BLOCK_T, BLOCK_H, HALF_P) of :func:`rope_cols_`: all heads of a token in one program up to ``elems``
    columns of x, then as many tokens as fill ``elems`` (at 64 heads x 64 rotated columns: one token)."""
    half_p = next_pow2(max(half, 1))
    block_h = min(next_pow2(max(heads, 1)), max(1, elems // (2 * half_p)))
    block_t = max(1, min(next_pow2(max(t, 1)), elems // (2 * half_p * block_h)))
    return block_t, block_h, half_p


def rope_cols_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate, in place, the interleaved pairs of the last ``2·half`` dims of x [T, D] or [T, H, D] (last dim
    contiguous) by cos/sin [T, half] (``inverse``: the conjugate rotation); the other columns are not touched.
    Returns x: ``step_rope_v41.rope_rows(x, cos, sin, inverse=inverse)``'s values. One contiguous load and
    store per row's rotated columns, cos/sin once per token (not measured on a GPU yet: the stride-2 form
    before it took 0.57 ms a call at [8192, 64, 512] on an H100, slower than ``rope_rows``'s full pass)."""
    t, d = x.shape[0], x.shape[-1]
    half = cos.shape[-1]
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or d % 2 or 2 * half > d or cos.shape != (t, half):
        raise ValueError(f"rope_cols_: x {tuple(x.shape)} (strides {x.stride()}) and cos {tuple(cos.shape)}: "
                         f"need [T, (H,) D] with a unit last stride, D even >= 2*half")
    heads = x.shape[1] if x.dim() == 3 else 1
    if t * heads == 0 or half == 0:
        return x
    stride_h = x.stride(1) if x.dim() == 3 else 0
    c, s = cos.contiguous(), sin.contiguous()
    block_t, block_h, half_p = rope_cols_shape(t, heads, half)
    _rope_cols[(cdiv(t, block_t), cdiv(heads, block_h))](
        x, c, s, t, heads, x.stride(0), stride_h, c.stride(0), d - 2 * half, HALF=half, HALF_P=half_p,
        BLOCK_T=block_t, BLOCK_H=block_h, INVERSE=inverse, ASM=not interpreting() and x.is_cuda, num_warps=4)
    return x


# ---------------------------------------------------------------------- SwiGLU activation
@triton.jit
def _swiglu_rows(g_ptr, u_ptr, w_ptr, out_ptr, N, stride_g, stride_u, stride_o, limit,
                 WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cm = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=cm, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=cm, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    act = tl.div_rn(g, 1.0 + _exp(-g, LIBDEVICE)) * u
    if WEIGHT:
        act = act * tl.load(w_ptr + row).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=cm)


def swiglu_rows(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(silu(clamp(gate, max=limit)) · clamp(up, ±limit) [· weight[:, None]])`` in fp32, cast to ``dtype``
    (default gate's): gate, up [T, N] (rows with a unit last stride), weight [T] or None."""
    if gate.dim() != 2 or up.shape != gate.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"swiglu_rows: gate {tuple(gate.shape)} / up {tuple(up.shape)} must be equal [T, N] rows")
    t, n = gate.shape
    out = torch.empty(t, n, dtype=dtype or gate.dtype, device=gate.device)
    if weight is not None and weight.shape != (t,):
        raise ValueError(f"swiglu_rows: weight {tuple(weight.shape)} must be [{t}]")
    if t and n:
        bn = min(1024, next_pow2(n))
        w = weight.contiguous() if weight is not None else gate
        _swiglu_rows[(t, cdiv(n, bn))](gate, up, w, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                       float(limit), WEIGHT=weight is not None, BLOCK_N=bn, LIBDEVICE=_LIBDEVICE,
                                       num_warps=4)
    return out


# ---------------------------------------------------------------------- combine + mHC post mix
@triton.jit
def _add_post(a_ptr, b_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, D, stride_a, stride_b, stride_st, stride_sn,
              stride_ot, stride_on, N: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    offs_n = tl.arange(0, N)
    a = tl.load(a_ptr + tok * stride_a + dd, mask=dmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + tok * stride_b + dd, mask=dmask, other=0.0).to(tl.float32)
    y = (a + b).to(a_ptr.dtype.element_ty).to(tl.float32)        # the combine, rounded once
    # then mhc._mhc_post's mix: out[k] = post[k]·y + Σ_j C[j, k]·h[j]
    _post_mix(y, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dd, dmask, offs_n, stride_st, stride_sn, stride_ot,
              stride_on, N)


def add_post(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``mhc_post((a.float() + b.float()).to(a.dtype), h, post, comb)``: a, b [T, D] rows, h [T, n, D] (n a power of
    two), post [T, n], comb [T, n, n] -> h' [T, n, D] in h.dtype."""
    T, n, D = h.shape
    if a.shape != (T, D) or b.shape != (T, D) or n & (n - 1) or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError(f"add_post: a {tuple(a.shape)}, b {tuple(b.shape)}, h {tuple(h.shape)}")
    s = h.contiguous()
    out = torch.empty_like(s)
    if T:
        bd = min(512, next_pow2(D))
        _add_post[(T, cdiv(D, bd))](a, b, s, post.float().contiguous(), comb.float().contiguous(), out, D,
                                    a.stride(0), b.stride(0), s.stride(0), s.stride(1), out.stride(0), out.stride(1),
                                    N=n, BLOCK_D=bd, num_warps=4)
    return out


# ---------------------------------------------------------------------- page rows of selected entries
@triton.jit
def _page_entries(sel_ptr, seg_ptr, live_ptr, table_ptr, out_ptr, K, stride_s, stride_b, stride_o, ratio, block_size,
                  per, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    jm = j < K
    e = tl.load(sel_ptr + row * stride_s + j, mask=jm, other=-1)
    b = tl.load(seg_ptr + row)
    alive = tl.load(live_ptr + b).to(tl.int32)
    ok = (e >= 0) & (tl.zeros_like(j) + alive > 0)
    pos = tl.maximum(e, 0) * ratio
    blk = tl.load(table_ptr + b * stride_b + pos // block_size, mask=jm & ok, other=0)
    tl.store(out_ptr + row * stride_o + j, tl.where(ok, blk * per + (pos % block_size) // ratio, -1), mask=jm)


def page_entries(sel: torch.Tensor, seg: torch.Tensor, live: torch.Tensor, table: torch.Tensor, ratio: int,
                 block_size: int) -> torch.Tensor:
    """``kernel_ops.attend_spans``' compressed-entry rows in one pass: for entry ids sel [T, K] (int64, -1 pad) of
    rows whose span is ``seg`` [T], ``where((sel >= 0) & live[seg], page_rows(table, seg, sel, ratio, block_size),
    -1)`` (``live`` [B] bool, ``table`` [B, blocks] int64 block tables) -> int64 [T, K]. Integer arithmetic: the
    same values as the PyTorch ops (about ten passes over [T, K] int64 there)."""
    if sel.dim() != 2 or seg.shape != (sel.shape[0],) or table.dim() != 2 or block_size % ratio:
        raise ValueError(f"page_entries: sel {tuple(sel.shape)}, seg {tuple(seg.shape)}, table {tuple(table.shape)}, "
                         f"ratio {ratio}, block_size {block_size}")
    T, K = sel.shape
    s = sel if sel.stride(-1) == 1 else sel.contiguous()
    t = table if table.stride(-1) == 1 else table.contiguous()
    out = torch.empty(T, K, dtype=torch.int64, device=sel.device)
    if T and K:
        bk = min(1024, next_pow2(K))
        _page_entries[(T, cdiv(K, bk))](s, seg.contiguous(), live.to(torch.int8).contiguous(), t, out, K, s.stride(0),
                                        t.stride(0), out.stride(0), ratio, block_size, block_size // ratio,
                                        BLOCK_K=bk, num_warps=4)
    return out


# ---------------------------------------------------------------------- the streams' collapse
@triton.jit
def _collapse(s_ptr, pre_ptr, out_ptr, D, stride_st, stride_sn, stride_ot, N: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    offs_n = tl.arange(0, N)
    x = tl.load(s_ptr + tok * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dmask[None, :],
                other=0.0).to(tl.float32)
    p = tl.load(pre_ptr + tok * N + offs_n).to(tl.float32)
    u = tl.sum(p[:, None] * x, 0)
    tl.store(out_ptr + tok * stride_ot + dd, u.to(out_ptr.dtype.element_ty), mask=dmask)


def collapse_rows(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``mhc.hc_collapse``: h [T, n, D] (n a power of two), pre [T, n] -> bf16/h.dtype(Σ_c pre[c]·h_c) [T, D]."""
    T, n, D = h.shape
    if n & (n - 1) or pre.shape != (T, n):
        raise ValueError(f"collapse_rows: h {tuple(h.shape)}, pre {tuple(pre.shape)}")
    s = h if h.stride(-1) == 1 else h.contiguous()
    out = torch.empty(T, D, dtype=h.dtype, device=h.device)
    if T:
        bd = min(1024, next_pow2(D))
        _collapse[(T, cdiv(D, bd))](s, pre.float().contiguous(), out, D, s.stride(0), s.stride(1), out.stride(0),
                                    N=n, BLOCK_D=bd, num_warps=4)
    return out
