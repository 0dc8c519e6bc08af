"""Run one sequence through the model over a private 1-slot state (tests, simple callers)."""
from __future__ import annotations

import math
import random
from typing import List, Optional, Sequence, Tuple

import torch

from redknot.models.deepseek_v4.state import V4State
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.step.metadata import StepMetadata


class SingleSequence:
    """Feeds chunks of one sequence (prefill or decode) to ``model.forward``; ``rollback(k)``
    forgets the last k tokens (the state is position-addressed, so nothing is undone)."""

    def __init__(self, model, max_tokens: int, block_size: Optional[int] = None, max_backtrack: int = 0,
                 dtype: Optional[torch.dtype] = None, shuffle_blocks: Optional[int] = None):
        cfg = model.cfg
        self.model = model
        dtype = dtype or model.dtype
        if block_size is None:  # smallest legal block: exercises the paging
            block_size = math.lcm(*cfg.ratios) if cfg.ratios else 16
        self.layout = StateLayout.create(cfg, block_size=block_size, max_backtrack=max_backtrack,
                                         kv_bytes=torch.empty((), dtype=dtype).element_size())
        num_blocks = self.layout.blocks_for(max_tokens)
        self.state = V4State.allocate(cfg, self.layout, 1, num_blocks, model.device, dtype)
        self.block_table = list(range(num_blocks))
        if shuffle_blocks is not None:
            random.Random(shuffle_blocks).shuffle(self.block_table)
        self.max_tokens = max_tokens
        self.tokens: List[int] = []
        self.mtp_len = 0  # positions the MTP layer has seen

    @property
    def length(self) -> int:
        return len(self.tokens)

    def metadata(self, ids: Sequence[int], start: int, all_rows: bool) -> StepMetadata:
        if start + len(ids) > self.max_tokens:
            raise ValueError(f"sequence would reach {start + len(ids)} tokens; allocated for {self.max_tokens}")
        rows = list(range(len(ids))) if all_rows else [len(ids) - 1]
        return StepMetadata.build([list(ids)], [start], [0], [self.block_table], rows, device=self.model.device)

    def step(self, ids: Sequence[int], all_logits: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append ``ids``; -> (pre-head streams [n, hc, D], fp32 logits of the last or all rows)."""
        meta = self.metadata(ids, self.length, all_logits)
        streams = self.model(meta, self.state)
        self.tokens.extend(int(i) for i in ids)
        return streams, self.model.compute_logits(streams[meta.logits_indices])

    def mtp_step(self, prev_streams: torch.Tensor, next_ids: Sequence[int], all_logits: bool = True
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
        """MTP over positions mtp_len.. (row i: target streams at that position + token i+1)."""
        targets = self.tokens[self.mtp_len:self.mtp_len + len(next_ids)]
        if len(targets) != len(next_ids):
            raise ValueError(f"mtp_step needs the target to have run positions {self.mtp_len}.."
                             f"{self.mtp_len + len(next_ids) - 1}; it has {self.length} tokens")
        meta = self.metadata(targets, self.mtp_len, all_logits)
        out = self.model.mtp_forward(meta, self.state, prev_streams,
                                     torch.tensor(list(next_ids), dtype=torch.long, device=self.model.device))
        self.mtp_len += len(next_ids)
        return out

    def rollback(self, k: int) -> None:
        if not 0 <= k <= min(self.layout.max_backtrack, self.length):
            raise ValueError(f"rollback({k}): allowed 0..{min(self.layout.max_backtrack, self.length)}")
        del self.tokens[self.length - k:]
        self.mtp_len = min(self.mtp_len, self.length)


def full_logits(model, ids: Sequence[int], **kw) -> torch.Tensor:
    """All-row logits of one sequence computed in a single step."""
    return SingleSequence(model, len(ids), **kw).step(ids, all_logits=True)[1]
