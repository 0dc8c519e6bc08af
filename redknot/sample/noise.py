"""Per-request random numbers keyed by (seed, output index).

A sampled token is ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per vocab
entry (the exponential form of the Gumbel-max trick). ``q`` for a request's
i-th output token comes from a generator seeded with ``mix(seed, i)``, so the
token depends only on the request's seed, its tokens so far and its
parameters: not on the batch, on preemption and recompute, or on how many
speculative tokens were rolled back before it.
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): well-spread 63-bit seeds for consecutive indices."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class NoiseSource:
    """Exponential noise rows; one reusable ``torch.Generator`` per device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._gen = torch.Generator(device=device)

    def exponential(self, seed: int, index: int, vocab: int) -> torch.Tensor:
        """``[vocab]`` Exp(1) draws for output ``index`` of a request seeded ``seed``."""
        self._gen.manual_seed(mix_seed(seed, index))
        q = torch.empty(vocab, dtype=torch.float32, device=self.device)  # [V]
        # An exact 0 draw would turn a zero-probability token into 0/0; keep q strictly positive.
        return q.exponential_(generator=self._gen).clamp_min_(1e-30)
