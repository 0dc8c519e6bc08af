"""V4.1's lagged hyper-connection sites in three launches instead of a few dozen small ones.

A V4.1 sublayer site (reference §3.3) computes its own (pre, post, C) from the stream it sees, but
collapses the stream with the *previous* site's ``pre`` and normalises the collapse::

    pre, post, C = hc_mixes(h)                      # one (2+n)·n mixing GEMV, sigmoids, 20 Sinkhorn rounds
    u = rms_norm(bf16(Σ_c pre_in[c]·h_c), w)        # the sublayer's input
    h' = bf16(post[j]·y + Σ_i C[i, j]·h_i)          # after the sublayer (y its output)

In PyTorch each Sinkhorn round is two reductions and two divisions, so one site is ~60 launches; at
decode sizes each costs its launch, not its bytes. Here: :func:`site_pre` = the split mixing GEMV of
:mod:`redknot.kernels.triton.mhc` (``_mhc_mix``: partial dots and ``Σ h²`` over slices of the ``n·D``
values) + one program per token that sums the partials, runs the sigmoids and Sinkhorn in registers
(the reference's order: softmax + eps, a column normalisation, then ``iters - 1`` row/column rounds)
and writes the collapse with ``pre_in``, normalised (two passes over the token's streams: sum of
squares of the bf16-rounded collapse, then the scaled output). :func:`site_post` is ``mhc_post``.
Every sum is fp32, as in :mod:`redknot.models.deepseek_v41.mhc`; only summation orders differ.
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2, sm_count
from redknot.kernels.triton.mhc import _mhc_mix, mhc_post


@triton.jit
def _site_finish(s_ptr, part_ptr, ssq_ptr, base_ptr, scale_ptr, pre_in_ptr, norm_ptr, u_ptr, pre_ptr, post_ptr,
                 comb_ptr, T, D, nsplit, stride_st, stride_sn, stride_ut, iters, hc_eps, norm_eps, rms_eps,
                 N: tl.constexpr, NMIX: tl.constexpr, G_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    MIXP: tl.constexpr = G_P2 * N
    tok = tl.program_id(0)
    t64 = tok.to(tl.int64)
    offs_m = tl.arange(0, MIXP)
    mix = tl.zeros([MIXP], tl.float32)
    ssq = 0.0
    for sp in range(nsplit):
        row = (sp * T + tok).to(tl.int64)
        mix += tl.load(part_ptr + row * MIXP + offs_m)
        ssq += tl.load(ssq_ptr + row)
    mix = mix * tl.rsqrt(ssq / (N * D) + norm_eps)
    x = tl.reshape(mix, [G_P2, N])
    g = tl.arange(0, G_P2)[:, None]
    col = tl.arange(0, N)[None, :]
    flat = g * N + col
    base = tl.load(base_ptr + flat, mask=flat < NMIX, other=0.0)
    sc = tl.load(scale_ptr + tl.minimum(g, 2))              # scale[0] pre, [1] post, [2] comb
    x = x * sc + base
    offs_n = tl.arange(0, N)
    pre = tl.sum(tl.where(g == 0, tl.sigmoid(x), 0.0), 0) + hc_eps          # [N]
    post = tl.sum(tl.where(g == 1, 2.0 * tl.sigmoid(x), 0.0), 0)
    is_c = (g >= 2) & (g < 2 + N)                                          # rows 2..: C[i, :], i = g - 2
    e = tl.where(is_c, tl.exp(x - tl.max(tl.where(is_c, x, float("-inf")), 1)[:, None]), 0.0)
    c = tl.where(is_c, e / tl.where(is_c, tl.sum(e, 1)[:, None], 1.0) + hc_eps, 0.0)
    c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = tl.where(is_c, c / (tl.sum(c, 1)[:, None] + hc_eps), 0.0)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    tl.store(pre_ptr + t64 * N + offs_n, pre)
    tl.store(post_ptr + t64 * N + offs_n, post)
    tl.store(comb_ptr + t64 * (N * N) + (g - 2) * N + col, c, mask=is_c)
    # The collapse with the previous site's pre, rounded to the stream dtype, then RMS-normalised.
    pin = tl.load(pre_in_ptr + t64 * N + offs_n)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < D
        xs = tl.load(s_ptr + t64 * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)
        u = tl.sum(pin[:, None] * xs, 0).to(u_ptr.dtype.element_ty).to(tl.float32)
        acc += u * u
    r = tl.rsqrt(tl.sum(acc, 0) / D + rms_eps)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < D
        xs = tl.load(s_ptr + t64 * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dm[None, :],
                     other=0.0).to(tl.float32)
        u = tl.sum(pin[:, None] * xs, 0).to(u_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(norm_ptr + dd, mask=dm, other=0.0).to(tl.float32)
        tl.store(u_ptr + t64 * stride_ut + dd, (w * (u * r)).to(u_ptr.dtype.element_ty), mask=dm)


def site_pre(h: torch.Tensor, pre_in: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             norm_w: torch.Tensor, iters: int, hc_eps: float, norm_eps: float
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, n, D] (bf16 or fp32), pre_in [T, n] -> (u = rms_norm(collapse(h, pre_in), norm_w) [T, D] in
    h.dtype, pre [T, n], post [T, n], C [T, n, n] fp32). ``norm_eps`` is the eps of the mixing RMS factor
    and of the norm (the model uses one ``norm_eps`` for both)."""
    T, n, D = h.shape
    if n & (n - 1):
        raise ValueError(f"site_pre: hc_mult={n} must be a power of two")
    s = h.contiguous()
    dev = h.device
    u = torch.empty(T, D, dtype=h.dtype, device=dev)
    pre = torch.empty(T, n, dtype=torch.float32, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return u, pre, post, comb
    groups = 2 + n
    g_p2 = max(next_pow2(groups), cdiv(16, n))                  # the mixing dot needs >= 16 columns
    mixp, K = g_p2 * n, n * D
    split_fn = h.dtype in (torch.bfloat16, torch.float16)
    block_t = 16 if T <= 256 or not split_fn else 64
    block_k = 128 if split_fn else 64
    tiles = cdiv(T, block_t)
    k_blocks = cdiv(K, block_k)
    nsplit = max(1, min(cdiv(2 * sm_count(h), tiles), k_blocks, 64))   # fill the device at decode sizes
    k_chunk = cdiv(k_blocks, nsplit) * block_k
    nsplit = cdiv(K, k_chunk)
    part = torch.empty(nsplit * T, mixp, dtype=torch.float32, device=dev)
    ssq = torch.empty(nsplit * T, dtype=torch.float32, device=dev)
    _mhc_mix[(tiles, nsplit)](s, fn.float().contiguous(), part, ssq, T, K, s.stride(0), k_chunk, NMIX=groups * n,
                              MIXP=mixp, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT_FN=split_fn, num_warps=4)
    block_d = min(1024, next_pow2(D))
    _site_finish[(T,)](s, part, ssq, base.float().contiguous(), scale.float().contiguous(),
                       pre_in.float().contiguous(), norm_w.contiguous(), u, pre, post, comb, T, D, nsplit,
                       s.stride(0), s.stride(1), u.stride(0), iters, hc_eps, norm_eps, norm_eps, N=n,
                       NMIX=groups * n, G_P2=g_p2, BLOCK_D=block_d, num_warps=4)
    return u, pre, post, comb


def site_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h'[:, j] = post[:, j]·y + Σ_i C[:, i, j]·h[:, i] (fp32 mix, h.dtype out): -> [T, n, D]."""
    return mhc_post(y, h, post, comb)
