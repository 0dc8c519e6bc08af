"""Drafting-time sampling of a DSpark block (reference dspark.md §2.1 item 2, §3.1).

The block's base logits U_1..U_g come from one parallel forward; the Markov head chains them
left to right: ``logits_k = U_k + B(x_{k-1})`` with x_0 the anchor. Draft k is then

* ``greedy`` (``features.dspark.draft_sampling``) or a greedy request: argmax of logits_k; its
  draft distribution is the point mass on it (the verifier builds that itself);
* ``probabilistic``: drawn from q_k = the request's processed distribution of logits_k
  (temperature, top-k, top-p, min-p: exactly what ``Sampler.probs`` gives), with Exp(1) noise
  keyed by (request seed, position of the draft), so a run reproduces and a draft does not
  depend on the batch. q_k is kept for verification: never the base U_k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from redknot.config.schema import DraftSampling

# Keys draft noise apart from the target sampler's noise (same seed, same index space).
_DRAFT_SALT = 0xD5_9A_4B_0C


@dataclass
class DraftBlock:
    """One request's drafted block: tokens x_1..x_g, q_k (None for point-mass drafts)."""
    token_ids: List[int]
    probs: Optional[torch.Tensor]  # [g, V] or None


class MarkovSampler:
    """Chains the Markov bias through a block and samples each draft (see the module docstring)."""

    def __init__(self, sampler, mode: DraftSampling) -> None:
        self.sampler = sampler
        self.mode = DraftSampling(mode)

    def draft_noise(self, seed: int, position: int, vocab: int) -> torch.Tensor:
        return self.sampler.noise.exponential(seed ^ _DRAFT_SALT, int(position), vocab)

    def sample(self, base_logits: torch.Tensor, bias: Callable[[torch.Tensor], torch.Tensor],
               anchors: torch.Tensor, rows: Sequence, first_positions: Sequence[int]) -> List[DraftBlock]:
        """base_logits [B, g, V] fp32; ``bias(prev_ids [B]) -> [B, V]``; anchors [B]; ``rows``: each
        request's sampling row (params + seed); ``first_positions``: position of draft 1 per request."""
        b, g, vocab = base_logits.shape
        prev = anchors
        sampled = [i for i, r in enumerate(rows)
                   if self.mode == DraftSampling.probabilistic and not r.params.greedy]
        tokens = torch.empty(b, g, dtype=torch.long, device=base_logits.device)  # [B, g]
        probs = torch.zeros(b, g, vocab, dtype=torch.float32, device=base_logits.device) if sampled else None
        for k in range(g):
            logits = base_logits[:, k] + bias(prev)  # [B, V] Markov-corrected
            step = logits.argmax(dim=-1)
            if sampled:
                idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
                q = self.sampler.probs(logits[idx], [rows[i] for i in sampled])  # [S, V]
                noise = torch.stack([self.draft_noise(rows[i].seed, first_positions[i] + k, vocab) for i in sampled])
                step = step.index_copy(0, idx, (q / noise).argmax(dim=-1))
                probs[idx, k] = q
            tokens[:, k] = step
            prev = step
        ids = tokens.tolist()
        return [DraftBlock(ids[i], probs[i] if probs is not None and i in sampled else None) for i in range(b)]
