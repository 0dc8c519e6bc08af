"""Step inputs: the tensors of one engine step, built on the host from a SchedulerOutput."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from redknot.engine.messages import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput
from redknot.step.metadata import StepMetadata


@dataclass
class StepInputs:
    """Host-side ``StepMetadata`` of a step plus what the runner needs to finish it.

    ``placeholder_rows`` are input rows whose token is sampled by the step
    still in flight; ``fill_placeholders`` writes them once it has finished.
    ``logits_owners`` lists (req_id, rows) in ``logits_indices`` order.
    """
    sched: SchedulerOutput
    meta: Optional[StepMetadata]  # None for an empty step
    placeholder_rows: List[Tuple[int, str]] = field(default_factory=list)
    logits_owners: List[Tuple[str, int]] = field(default_factory=list)

    def fill_placeholders(self, prev: ModelRunnerOutput) -> None:
        for row, req_id in self.placeholder_rows:
            tokens = prev.sampled_token_ids.get(req_id)
            # No token (the request failed in that step): it has left the engine, this row is discarded.
            self.meta.input_ids[row] = tokens[-1] if tokens else 0
        self.placeholder_rows = []

    def to(self, device: torch.device) -> StepMetadata:
        """The metadata with its tensors on ``device`` (python-side lists are shared)."""
        if device.type == "cpu":
            return self.meta
        tensors = {f.name: getattr(self.meta, f.name).to(device, non_blocking=True)
                   for f in dataclasses.fields(self.meta) if isinstance(getattr(self.meta, f.name), torch.Tensor)}
        return dataclasses.replace(self.meta, **tensors)


def build_step_inputs(sched: SchedulerOutput) -> StepInputs:
    """Concatenate the scheduled requests' new tokens (varlen) in schedule order."""
    if sched.is_empty:
        return StepInputs(sched=sched, meta=None)
    token_ids, ctx, slots, tables, logits_rows = [], [], [], [], []
    placeholders: List[Tuple[int, str]] = []
    owners: List[Tuple[str, int]] = []
    row = 0
    for sr in sched.requests:
        if PLACEHOLDER_TOKEN in sr.token_ids:  # a scan in C first: a prefill chunk has none
            placeholders.extend((row + i, sr.req_id) for i, tok in enumerate(sr.token_ids)
                                if tok == PLACEHOLDER_TOKEN)
        token_ids.append(sr.token_ids)
        ctx.append(sr.start_pos)
        slots.append(sr.slot)
        tables.append(sr.block_table)
        row += sr.num_tokens
        if sr.num_logits:
            logits_rows.extend(range(row - sr.num_logits, row))
            owners.append((sr.req_id, sr.num_logits))
    meta = StepMetadata.build(token_ids, ctx, slots, tables, logits_indices=logits_rows)
    return StepInputs(sched=sched, meta=meta, placeholder_rows=placeholders, logits_owners=owners)
