"""Logit filters: temperature, top-k, top-p, min-p. Every op works row by row.

Each function takes logits ``[N, V]`` (fp32) and per-row parameters as
tensors ``[N]`` and returns filtered logits where excluded tokens are -inf.
A row's result depends only on that row (no cross-row reductions), so the
same row gives the same bits in any batch.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature.unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the k-th value are kept); 0 = off."""
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if bool((k == vocab).all()):
        return logits
    kmax = int(k.max())
    top = torch.topk(logits, kmax, dim=1).values  # [N, kmax], sorted descending
    kth = top.gather(1, (k - 1).unsqueeze(1))     # [N, 1]
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``; 1 = off."""
    if bool((top_p >= 1).all()):
        return logits
    sorted_logits, order = logits.sort(dim=1, descending=True)
    probs = sorted_logits.softmax(dim=1)
    mass_before = probs.cumsum(dim=1) - probs          # probability of strictly more likely tokens
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False                          # the most likely token always survives
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability; 0 = off."""
    if bool((min_p <= 0).all()):
        return logits
    probs = logits.softmax(dim=1)
    threshold = probs.max(dim=1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, NEG_INF)
