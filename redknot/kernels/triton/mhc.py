"""Manifold-constrained hyper-connections (mHC) fused per token tile.

``mhc_pre``: one program takes ``BLOCK_T`` tokens' ``n`` streams, accumulates ``Σ z²`` and the
``(2+n)·n`` mixing logits ``fn · z`` in one pass over the ``n·D`` values (exact fp32 dot; ``fn`` is read
once per tile), applies the RMS factor, builds pre / post / the Sinkhorn-normalised ``n×n`` comb in
registers (laid out as ``[BLOCK_T, groups, n]``: group 0 = pre, 1 = post, 2.. = comb rows), then
re-reads the streams tile to collapse them with ``pre``. ``mhc_head`` is the same without post, comb
and Sinkhorn. ``mhc_post`` mixes the streams and adds the sub-block output in one pass.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2


@triton.jit
def _mix_logits(s_ptr, fn_ptr, t0, T, K, stride_st, NMIX: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_K: tl.constexpr, MIX_P2: tl.constexpr):
    """(fn · z, Σ z²) for the tile's tokens: [BLOCK_T, MIX_P2] and [BLOCK_T] fp32."""
    toks = t0 + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, MIX_P2)
    mix = tl.zeros([BLOCK_T, MIX_P2], tl.float32)
    ssq = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        z = tl.load(s_ptr + toks[:, None].to(tl.int64) * stride_st + kk[None, :],
                    mask=(toks[:, None] < T) & (kk[None, :] < K), other=0.0).to(tl.float32)
        f = tl.load(fn_ptr + offs_m[None, :].to(tl.int64) * K + kk[:, None],
                    mask=(offs_m[None, :] < NMIX) & (kk[:, None] < K), other=0.0)  # [BLOCK_K, MIX_P2]
        ssq += tl.sum(z * z, 1)
        mix += tl.dot(z, f, input_precision="ieee")
    return mix, ssq


@triton.jit
def _collapse(s_ptr, out_ptr, pre, t0, T, D, stride_st, stride_sn, stride_ot, N: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = Σ_j pre[t, j] · streams[t, j] for the tile's tokens (pre: [BLOCK_T, N])."""
    toks = t0 + tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, N)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        m3 = (toks[:, None, None] < T) & (dd[None, None, :] < D)
        x = tl.load(s_ptr + toks[:, None, None].to(tl.int64) * stride_st + offs_n[None, :, None] * stride_sn
                    + dd[None, None, :], mask=m3, other=0.0).to(tl.float32)  # [BLOCK_T, N, BLOCK_D]
        u = tl.sum(pre[:, :, None] * x, 1)
        tl.store(out_ptr + toks[:, None].to(tl.int64) * stride_ot + dd[None, :], u.to(out_ptr.dtype.element_ty),
                 mask=(toks[:, None] < T) & (dd[None, :] < D))


@triton.jit
def _mhc_pre(s_ptr, fn_ptr, base_ptr, scale_ptr, out_ptr, post_ptr, comb_ptr, T, D, stride_st, stride_sn,
             stride_ot, iters, hc_eps, norm_eps, N: tl.constexpr, NMIX: tl.constexpr, G_P2: tl.constexpr,
             HEAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_T
    K = N * D
    mix, ssq = _mix_logits(s_ptr, fn_ptr, t0, T, K, stride_st, NMIX, BLOCK_T, BLOCK_K, G_P2 * N)
    mix = mix * tl.rsqrt(ssq / K + norm_eps)[:, None]
    x = tl.reshape(mix, [BLOCK_T, G_P2, N])
    g = tl.arange(0, G_P2)[None, :, None]
    col = tl.arange(0, N)[None, None, :]
    flat = g * N + col
    base = tl.load(base_ptr + flat, mask=flat < NMIX, other=0.0)
    sc = tl.load(scale_ptr + tl.minimum(g, 2))  # scale[0] pre, [1] post, [2] comb
    x = x * sc + base
    pre = tl.sum(tl.where(g == 0, tl.sigmoid(x), 0.0), 1) + hc_eps  # [BLOCK_T, N]
    toks = t0 + tl.arange(0, BLOCK_T)
    tmask = toks < T
    if not HEAD:
        post = tl.sum(tl.where(g == 1, 2.0 * tl.sigmoid(x), 0.0), 1)
        is_c = (g >= 2) & (g < 2 + N)
        e = tl.where(is_c, tl.exp(x - tl.max(tl.where(is_c, x, float("-inf")), 2)[:, :, None]), 0.0)
        c = tl.where(is_c, e / tl.where(is_c, tl.sum(e, 2)[:, :, None], 1.0) + hc_eps, 0.0)
        c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
        for _ in range(iters - 1):
            c = tl.where(is_c, c / (tl.sum(c, 2)[:, :, None] + hc_eps), 0.0)
            c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
        offs_n = tl.arange(0, N)
        tl.store(post_ptr + toks[:, None].to(tl.int64) * N + offs_n[None, :], post, mask=tmask[:, None])
        tl.store(comb_ptr + toks[:, None, None].to(tl.int64) * (N * N) + (g - 2) * N + col, c,
                 mask=tmask[:, None, None] & is_c)
    _collapse(s_ptr, out_ptr, pre, t0, T, D, stride_st, stride_sn, stride_ot, N, BLOCK_T, BLOCK_D)


@triton.jit
def _mhc_post(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, D, stride_y, stride_st, stride_sn, stride_ot,
              stride_on, N: tl.constexpr, BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    offs_n = tl.arange(0, N)
    y = tl.load(y_ptr + tok * stride_y + dd, mask=dmask, other=0.0).to(tl.float32)
    x = tl.load(s_ptr + tok * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dmask[None, :],
                other=0.0).to(tl.float32)  # [N(j), BLOCK_D]
    cm = tl.load(comb_ptr + tok * N * N + offs_n[:, None] * N + offs_n[None, :])  # [N(j), N(k)]
    p = tl.load(post_ptr + tok * N + offs_n)
    mixed = tl.sum(cm[:, :, None] * x[:, None, :], 0)  # [N(k), BLOCK_D]
    o = p[:, None] * y[None, :] + mixed
    tl.store(out_ptr + tok * stride_ot + offs_n[:, None] * stride_on + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=dmask[None, :])


def _launch_pre(streams, fn, base, scale, iters, hc_eps, norm_eps, head: bool, outs=None):
    T, n, D = streams.shape
    s = streams.contiguous()
    if outs is None:
        outs = (torch.empty(T, D, dtype=streams.dtype, device=streams.device),  # [T, D]
                torch.empty(T, n, dtype=torch.float32, device=streams.device),  # [T, n]
                torch.empty(T, n, n, dtype=torch.float32, device=streams.device))  # [T, n, n]
    out, post, comb = outs
    if T:
        groups = 1 if head else 2 + n
        g_p2 = max(next_pow2(groups), cdiv(16, n))  # the mixing dot needs >= 16 columns
        block_t = 16
        _mhc_pre[(cdiv(T, block_t),)](
            s, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(), out, post, comb,
            T, D, s.stride(0), s.stride(1), out.stride(0), iters, hc_eps, norm_eps,
            N=n, NMIX=groups * n, G_P2=g_p2, HEAD=head, BLOCK_T=block_t, BLOCK_K=64,
            BLOCK_D=min(256, next_pow2(D)), num_warps=4)
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
