"""Hyper-connections of V4.1, single pass with the lagged ``pre`` (reference §3.3).

Each sublayer site computes (pre, post, C) from the stream it sees; its input is
the collapse of the streams with the *previous* site's ``pre`` (one-hot for layer
0's attention). Sinkhorn runs the exact order of the reference: softmax + eps, a
column normalisation, then ``iters - 1`` (row, column) rounds, ending on a column
normalisation, so rows are only approximately stochastic. Do not "fix" that.
"""
from __future__ import annotations

from typing import Tuple

import torch

from redknot.models.deepseek_v41.ref_math import acc_dtype


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
             iters: int, hc_eps: float, norm_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, D] -> pre [T, hc], post [T, hc], C [T, hc, hc] in the accumulation dtype."""
    a = acc_dtype(h.dtype)
    x = h.flatten(1).to(a)                                                  # [T, hc*D]
    mix = (x @ fn.to(a).t()) * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)  # [T, (2+hc)*hc]
    base, scale = base.to(a), scale.to(a)
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_c pre[c]·h_c summed in fp32, one cast: [T, hc, D] -> [T, D]."""
    a = acc_dtype(h.dtype)
    return (pre.to(a).unsqueeze(-1) * h.to(a)).sum(1).to(h.dtype)


def hc_expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[j] = post[j]·y + Σ_i C[i, j]·h_i, cast to h.dtype: -> [T, hc, D]."""
    a = acc_dtype(h.dtype)
    mixed = torch.einsum("tij,tid->tjd", comb.to(a), h.to(a))
    return (post.to(a).unsqueeze(-1) * y.to(a).unsqueeze(1) + mixed).to(h.dtype)


def one_hot_pre(num_tokens: int, hc: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Layer 0's attention collapses with stream 0 (all streams equal the embedding)."""
    pre = torch.zeros(num_tokens, hc, dtype=acc_dtype(dtype), device=device)
    pre[:, 0] = 1
    return pre
