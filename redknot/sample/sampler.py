"""Sampler: logits rows -> token ids, greedy or seeded, with grammar masks and logits processors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from redknot.sample.filters import apply_min_p, apply_temperature, apply_top_k, apply_top_p
from redknot.sample.noise import NoiseSource
from redknot.sample.params import SamplingParams


@dataclass
class SamplingRow:
    """One logits row to sample: whose, with which parameters, and which output index it fills."""
    req_id: str
    params: SamplingParams
    seed: int
    output_index: int          # index of the sampled token among the request's outputs (keys the noise)
    output_token_ids: Sequence[int] = ()


class Sampler:
    """Turns ``[N, V]`` fp32 logits into N token ids.

    Order per row: user logits processors, grammar bitmask, then greedy
    argmax or temperature -> top-k -> top-p -> min-p -> seeded draw. With
    ``row_by_row`` every row is filtered alone (shapes independent of the
    batch), which batch-invariant / deterministic mode uses.
    """

    def __init__(self, device: torch.device, row_by_row: bool = False) -> None:
        self.device = torch.device(device)
        self.row_by_row = row_by_row
        self.noise = NoiseSource(self.device)

    def sample(self, logits: torch.Tensor, rows: List[SamplingRow],
               bitmask: Optional[torch.Tensor] = None) -> List[int]:
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = self._process(logits, rows, bitmask)
        tokens = logits.argmax(dim=1)  # [N]; greedy rows keep this
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            part = [logits[idx], [rows[i] for i in sampled]]
            if self.row_by_row:
                drawn = torch.cat([self._draw(part[0][j:j + 1], [r]) for j, r in enumerate(part[1])])
            else:
                drawn = self._draw(*part)
            tokens = tokens.index_copy(0, idx, drawn)
        return tokens.tolist()

    def _process(self, logits: torch.Tensor, rows: List[SamplingRow], bitmask: Optional[torch.Tensor]):
        if any(r.params.logits_processors for r in rows):
            logits = logits.clone()
            for i, r in enumerate(rows):
                for proc in r.params.logits_processors or ():
                    logits[i] = proc(list(r.output_token_ids), logits[i])
        if bitmask is not None:
            logits = apply_bitmask(logits, bitmask)
        return logits

    def probs(self, logits: torch.Tensor, rows: List[SamplingRow]) -> torch.Tensor:
        """[n, V] distribution each (sampled, already processed) row draws from: temperature,
        top-k, top-p, min-p, softmax. Speculative verification uses it as the target distribution."""
        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=logits.device)  # [n]
        p = [r.params for r in rows]
        logits = apply_temperature(logits, col([x.temperature for x in p], torch.float32))
        logits = apply_top_k(logits, col([x.top_k for x in p], torch.long))
        logits = apply_top_p(logits, col([x.top_p for x in p], torch.float32))
        logits = apply_min_p(logits, col([x.min_p for x in p], torch.float32))
        return logits.softmax(dim=1)  # [n, V]

    def _draw(self, logits: torch.Tensor, rows: List[SamplingRow]) -> torch.Tensor:
        probs = self.probs(logits, rows)  # [n, V]
        q = torch.stack([self.noise.exponential(r.seed, r.output_index, logits.shape[1]) for r in rows])
        return (probs / q).argmax(dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set logits of tokens whose bit is 0 to -inf; ``bitmask`` is ``[N, ceil(V/32)]`` int32 (xgrammar layout)."""
    vocab = logits.shape[1]
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)          # [32]
    allowed = ((bitmask.to(logits.device).unsqueeze(2) >> bits) & 1).bool()  # [N, W, 32]
    allowed = allowed.flatten(1)[:, :vocab]                                   # [N, V]
    return logits.masked_fill(~allowed, float("-inf"))
