"""Manifold-constrained hyper-connections (mHC) fused per token tile.

``mhc_pre`` in two launches. ``_mhc_mix``: a program takes a tile of tokens and a slice of their ``n·D``
stream values and accumulates ``Σ z²`` and the ``(2+n)·n`` mixing logits ``z · fnᵀ`` (the RMS factor is
applied afterwards: it is a per-token scalar). For 16-bit streams the dot runs on the tensor cores with
``fn`` split into three bf16 parts (hi + mid + lo carry its 24 significant bits; the stream values are
exact in bf16, so the products are exact and only the fp32 accumulation rounds, as in the fp32
reference); fp32 streams use an exact FMA dot. Few tokens (decode) split the ``n·D`` values over
programs so the device fills. ``_mhc_finish``: sums the partials in fixed order, builds pre / post / the
Sinkhorn-normalised ``n×n`` comb in registers (laid out as ``[BLOCK_T, groups, n]``: group 0 = pre,
1 = post, 2.. = comb rows) and collapses one ``D`` slice of the streams with ``pre``. ``mhc_head`` is
the same without post, comb and Sinkhorn. ``mhc_post`` mixes the streams and adds the sub-block output
in one pass.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2, sm_count


@triton.jit
def _split3_dot(mix, z, f):
    """``mix + z · f`` with ``f = hi + mid + lo`` in bf16 (24 significant bits): three tensor-core dots with fp32
    accumulation; ``z`` must be exact in bf16."""
    hi = f.to(tl.bfloat16)
    rest = f - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    zb = z.to(tl.bfloat16)
    mix += tl.dot(zb, hi)
    mix += tl.dot(zb, mid)
    mix += tl.dot(zb, lo)
    return mix


@triton.jit
def _post_mix(y, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dd, dmask, offs_n, stride_st, stride_sn, stride_ot,
              stride_on, N: tl.constexpr):
    """The mHC post mix of one token's column block ``dd`` (``y``: fp32 [BLOCK_D], ``offs_n = arange(0, N)``):
    out[k] = post[k]·y + Σ_j C[j, k]·h[j]."""
    x = tl.load(s_ptr + tok * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dmask[None, :],
                other=0.0).to(tl.float32)  # [N(j), BLOCK_D]
    cm = tl.load(comb_ptr + tok * N * N + offs_n[:, None] * N + offs_n[None, :])  # [N(j), N(k)]
    p = tl.load(post_ptr + tok * N + offs_n)
    mixed = tl.sum(cm[:, :, None] * x[:, None, :], 0)  # [N(k), BLOCK_D]
    o = p[:, None] * y[None, :] + mixed
    tl.store(out_ptr + tok * stride_ot + offs_n[:, None] * stride_on + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=dmask[None, :])


@triton.jit
def _mhc_mix(s_ptr, fn_ptr, part_ptr, ssq_ptr, T, K, stride_st, k_chunk, NMIX: tl.constexpr, MIXP: tl.constexpr,
             BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_FN: tl.constexpr):
    """Partial ``(z · fnᵀ, Σ z²)`` of a token tile over one slice of the ``n·D`` values.

    ``SPLIT_FN`` (16-bit streams): ``fn = hi + mid + lo`` in bf16 (24 significant bits, i.e. fp32 exactly
    enough), three tensor-core dots with fp32 accumulation; the stream values are exact in bf16. Else
    (fp32 streams): one exact FMA dot."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    k_lo = tl.program_id(1) * k_chunk
    k_hi = tl.minimum(k_lo + k_chunk, K)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, MIXP)
    mix = tl.zeros([BLOCK_T, MIXP], tl.float32)
    ssq = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < k_hi
        z = tl.load(s_ptr + toks[:, None].to(tl.int64) * stride_st + kk[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_T, BLOCK_K]
        f = tl.load(fn_ptr + offs_m[None, :].to(tl.int64) * K + kk[:, None],
                    mask=(offs_m[None, :] < NMIX) & kmask[:, None], other=0.0)  # [BLOCK_K, MIXP] fp32
        zf = z.to(tl.float32)
        ssq += tl.sum(zf * zf, 1)
        if SPLIT_FN:
            mix = _split3_dot(mix, z, f)
        else:
            mix += tl.dot(zf, f, input_precision="ieee")
    row = tl.program_id(1) * T + toks
    tl.store(part_ptr + row[:, None].to(tl.int64) * MIXP + offs_m[None, :], mix, mask=tmask[:, None])
    tl.store(ssq_ptr + row, ssq, mask=tmask)


@triton.jit
def _mhc_finish(s_ptr, part_ptr, ssq_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr, T, D, nsplit,
                stride_st, stride_sn, stride_ot, iters, hc_eps, norm_eps, N: tl.constexpr, NMIX: tl.constexpr,
                G_P2: tl.constexpr, HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Sum the partials (fixed order), RMS factor, pre / post / Sinkhorn comb, and the collapse of one
    ``BLOCK_D`` slice (every slice recomputes the tiny ``n×n`` mixing; slice 0 stores post and comb)."""
    MIXP: tl.constexpr = G_P2 * N
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    pid_d = tl.program_id(1)
    offs_m = tl.arange(0, MIXP)
    mix = tl.zeros([BLOCK_T, MIXP], tl.float32)
    ssq = tl.zeros([BLOCK_T], tl.float32)
    for sp in range(nsplit):
        row = (sp * T + toks).to(tl.int64)
        mix += tl.load(part_ptr + row[:, None] * MIXP + offs_m[None, :], mask=tmask[:, None], other=0.0)
        ssq += tl.load(ssq_ptr + row, mask=tmask, other=0.0)
    mix = mix * tl.rsqrt(ssq / (N * D) + norm_eps)[:, None]
    x = tl.reshape(mix, [BLOCK_T, G_P2, N])
    g = tl.arange(0, G_P2)[None, :, None]
    col = tl.arange(0, N)[None, None, :]
    flat = g * N + col
    base = tl.load(base_ptr + flat, mask=flat < NMIX, other=0.0)
    sc = tl.load(scale_ptr + tl.minimum(g, 2))  # scale[0] pre, [1] post, [2] comb
    x = x * sc + base
    pre = tl.sum(tl.where(g == 0, tl.sigmoid(x), 0.0), 1) + hc_eps  # [BLOCK_T, N]
    if not HEAD:
        post = tl.sum(tl.where(g == 1, 2.0 * tl.sigmoid(x), 0.0), 1)
        is_c = (g >= 2) & (g < 2 + N)
        e = tl.where(is_c, tl.exp(x - tl.max(tl.where(is_c, x, float("-inf")), 2)[:, :, None]), 0.0)
        c = tl.where(is_c, e / tl.where(is_c, tl.sum(e, 2)[:, :, None], 1.0) + hc_eps, 0.0)
        c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
        for _ in range(iters - 1):
            c = tl.where(is_c, c / (tl.sum(c, 2)[:, :, None] + hc_eps), 0.0)
            c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
        first = tmask & (tl.zeros_like(toks) + pid_d == 0)  # a tensor test: scalar & tensor masks are not int1 everywhere
        offs_n = tl.arange(0, N)
        tl.store(post_ptr + toks[:, None].to(tl.int64) * N + offs_n[None, :], post, mask=first[:, None])
        tl.store(comb_ptr + toks[:, None, None].to(tl.int64) * (N * N) + (g - 2) * N + col, c,
                 mask=first[:, None, None] & is_c)
    offs_n = tl.arange(0, N)
    dd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m3 = tmask[:, None, None] & (dd[None, None, :] < D)
    xs = tl.load(s_ptr + toks[:, None, None].to(tl.int64) * stride_st + offs_n[None, :, None] * stride_sn
                 + dd[None, None, :], mask=m3, other=0.0).to(tl.float32)  # [BLOCK_T, N, BLOCK_D]
    u = tl.sum(pre[:, :, None] * xs, 1)
    tl.store(out_ptr + toks[:, None].to(tl.int64) * stride_ot + dd[None, :], u.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & (dd[None, :] < D))


@triton.jit
def _mhc_post(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, D, stride_y, stride_st, stride_sn, stride_ot,
              stride_on, N: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    offs_n = tl.arange(0, N)
    y = tl.load(y_ptr + tok * stride_y + dd, mask=dmask, other=0.0).to(tl.float32)
    _post_mix(y, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dd, dmask, offs_n, stride_st, stride_sn, stride_ot,
              stride_on, N)


def _launch_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, head: bool, outs=None):
    T, n, D = streams.shape
    s = streams.contiguous()
    if outs is None:
        outs = (torch.empty(T, D, dtype=streams.dtype, device=streams.device),  # [T, D]
                torch.empty(T, n, dtype=torch.float32, device=streams.device),  # [T, n]
                torch.empty(T, n, n, dtype=torch.float32, device=streams.device))  # [T, n, n]
    out, post, comb = outs
    if T == 0:
        return out, post, comb
    groups = 1 if head else 2 + n
    g_p2 = max(next_pow2(groups), cdiv(16, n))  # the mixing dot needs >= 16 columns
    mixp, K = g_p2 * n, n * D
    split_fn = streams.dtype in (torch.bfloat16, torch.float16)
    block_t = 16 if T <= 256 or not split_fn else 64
    block_k = 128 if split_fn else 64
    tiles = cdiv(T, block_t)
    k_blocks = cdiv(K, block_k)
    nsplit = max(1, min(cdiv(2 * sm_count(streams), tiles), k_blocks, 64))  # fill the device at decode sizes
    k_chunk = cdiv(k_blocks, nsplit) * block_k
    nsplit = cdiv(K, k_chunk)
    part = torch.empty(nsplit * T, mixp, dtype=torch.float32, device=streams.device)  # [S*T, MIXP]
    ssq = torch.empty(nsplit * T, dtype=torch.float32, device=streams.device)  # [S*T]
    _mhc_mix[(tiles, nsplit)](s, fn.float().contiguous(), part, ssq, T, K, s.stride(0), k_chunk,
                              NMIX=groups * n, MIXP=mixp, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT_FN=split_fn,
                              num_warps=4)
    block_d = min(256, next_pow2(D))
    _mhc_finish[(cdiv(T, 16), cdiv(D, block_d))](
        s, part, ssq, base.float().contiguous(), scale.float().contiguous(), out, post, comb, T, D, nsplit,
        s.stride(0), s.stride(1), out.stride(0), iters, hc_eps, norm_eps,
        N=n, NMIX=groups * n, G_P2=g_p2, HEAD=head, BLOCK_T=16, BLOCK_D=block_d, num_warps=4)
    return out, post, comb


def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            sinkhorn_iters: int, hc_eps: float, norm_eps: float, outs=None):
    """streams ``[T, n, D]`` → (collapsed ``[T, D]``, post ``[T, n]`` fp32, comb ``[T, n, n]`` fp32)."""
    return _launch_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, head=False, outs=outs)


def mhc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse ``[T, n, D]`` → ``[T, D]`` with sigmoid weights."""
    return _launch_pre(streams, fn, base, scale.reshape(1).expand(3), 1, hc_eps, norm_eps, head=True)[0]


def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[:, k] = post[:, k] · y + Σ_j comb[:, j, k] · streams[:, j]`` (fp32 mix)."""
    T, n, D = streams.shape
    s = streams.contiguous()
    yc = y.contiguous()
    out = torch.empty_like(s) if out is None else out
    if T:
        bd = min(512, next_pow2(D))
        _mhc_post[(T, cdiv(D, bd))](yc, s, post.float().contiguous(), comb.float().contiguous(), out, D,
                                    yc.stride(0), s.stride(0), s.stride(1), out.stride(0), out.stride(1),
                                    N=n, BLOCK_D=bd, num_warps=4)
    return out
