"""Per-step values every layer needs, derived once from the ``StepMetadata`` per model forward.

Model-independent: the per-sequence spans of the step, its rotary tables at the
step's positions (the family's own tables, looked up by kind) and the rows a
step writes into per-slot rings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import torch

from redknot.step.metadata import StepMetadata


class RopeTable(Protocol):
    """A model's rotary tables: cos/sin [T, r/2] at ``positions`` for a table kind (e.g. "main")."""

    def cos_sin(self, kind: str, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class SeqSpan:
    """Rows [start, start+num_tokens) of the step belong to one sequence at positions
    context_len .. context_len+num_tokens-1."""
    index: int
    start: int
    num_tokens: int
    context_len: int
    slot: int

    @property
    def end_pos(self) -> int:  # one past the last position of the step
        return self.context_len + self.num_tokens


class StepContext:
    """The step's metadata plus rope tables at its positions and the per-sequence spans."""

    def __init__(self, meta: StepMetadata, rope: RopeTable, compute_dtype: torch.dtype):
        self.meta = meta
        self.rope = rope
        self.dtype = compute_dtype
        self.spans: List[SeqSpan] = [
            SeqSpan(b, s, n, c, slot) for b, (s, n, c, slot) in enumerate(
                zip(meta.query_start_list, meta.num_tokens_per_seq, meta.context_lens, meta.seq_slot_list))]
        self._memo: Dict[Hashable, Any] = {}
        meta.forward_memo.clear()  # the kernels' per-forward values of the metadata (step_index) start afresh

    def memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()`` once per step and ``key``: values every layer (or every compressor) of the step would
        otherwise redo from the same metadata, each op a launch of its own."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def cos_sin(self, kind: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, r/2] at the step's positions for one of the model's rotary tables."""
        return self.memo(("cos_sin", kind), lambda: self.rope.cos_sin(kind, self.meta.positions))

    @property
    def direct_ring_writes(self) -> bool:
        """Whether row b of the step goes to ring row ``seq_slots[b] · R + positions[b] mod R`` with no row left
        out (a tensor-only decode step: one row per sequence), as the ``ring_write`` op writes it."""
        return self.meta.tensor_only

    def ring_write_rows(self, ring: int) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        """(rows of the step, or None for all of them in order; flat ring index slot*ring + pos % ring) for
        writing this step's rows into per-slot rings of length ``ring``; only each sequence's last ``ring`` rows
        are kept, so no ring index is written twice."""
        return self.memo(("ring rows", ring), lambda: self._ring_rows(ring))

    def _ring_rows(self, ring: int) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
        meta = self.meta
        if meta.tensor_only:  # decode: row b is sequence b's token
            return None, meta.seq_slots.long() * ring + meta.positions % ring
        rows, dest = [], []
        for sp in self.spans:
            first = max(sp.context_len, sp.end_pos - ring)
            pos = torch.arange(first, sp.end_pos)
            rows.append(pos - sp.context_len + sp.start)
            dest.append(sp.slot * ring + pos % ring)
        return torch.cat(rows).to(meta.positions.device), torch.cat(dest).to(meta.positions.device)


def write_ring(ring_tensor: torch.Tensor, ctx: StepContext, values: torch.Tensor, ks=None) -> None:
    """Store this step's rows values [T, C] into ring_tensor [S, R, C] at their positions. A tensor-only decode
    step with a kernel set ``ks``: its ``ring_write`` op (one launch, no index tensors)."""
    if ks is not None and ctx.direct_ring_writes:
        ks.ring_write(values, ring_tensor, ctx.meta.seq_slots, ctx.meta.positions)
        return
    rows, dest = ctx.ring_write_rows(ring_tensor.shape[1])
    src = values if rows is None else values[rows]
    ring_tensor.view(-1, ring_tensor.shape[-1]).index_copy_(0, dest, src.to(ring_tensor.dtype))


__all__ = ["RopeTable", "SeqSpan", "StepContext", "write_ring"]
