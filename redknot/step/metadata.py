"""``StepMetadata``: one engine step's batch as the model and its kernels read it.

The new tokens of B sequences, concatenated (varlen), with each sequence's
slot, block table and context length. Built on the host by the engine
(:func:`redknot.engine.inputs.build_step_inputs`), by speculative decoding for its
draft-model runs and by context parallel for each rank's share; read by every
model family's layers and by the kernels. See :mod:`redknot.step` for the whole step.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch


@dataclass
class StepMetadata:
    """One engine step: the new tokens of B sequences, concatenated (varlen)."""
    input_ids: torch.Tensor        # [T] token ids
    positions: torch.Tensor        # [T] absolute positions
    query_start_loc: torch.Tensor  # [B+1] row offsets of each sequence
    seq_slots: torch.Tensor        # [B] slot of each sequence
    block_tables: torch.Tensor     # [B, max_blocks] block ids (int32)
    logits_indices: torch.Tensor   # [N] rows to compute logits for
    num_tokens_per_seq: List[int]  # python copy of the row counts
    context_lens: List[int]        # tokens already in the state = first position of each sequence
    seq_slot_list: List[int] = field(default_factory=list)  # python copy of seq_slots
    query_start_list: List[int] = field(default_factory=list)  # python copy of query_start_loc[:-1]
    # Compact SWA replay: per sequence, the first position the window-only top layers compute
    # (rows below it are never read by a later query); None = every row.
    replay_from: Optional[List[int]] = None
    # A decode step (one new token per sequence) whose per-step values must be read from the
    # tensors only: the python lists above describe shapes, not this step's values. CUDA-graph
    # capture sets it, so a replay with fresh tensor contents computes the right step.
    tensor_only: bool = False
    # Values the ops derive from this step's tensors, kept for one forward (a tensor-only step's tensors change in
    # place between forwards and CUDA-graph captures): each ``StepContext`` empties it when the forward starts.
    forward_memo: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.seq_slot_list:
            self.seq_slot_list = [int(s) for s in self.seq_slots.tolist()]
        if not self.query_start_list:
            starts, acc = [], 0
            for n in self.num_tokens_per_seq:
                starts.append(acc)
                acc += n
            self.query_start_list = starts
        b = len(self.num_tokens_per_seq)
        if not (len(self.context_lens) == len(self.seq_slot_list) == b == self.block_tables.shape[0]):
            raise ValueError(f"StepMetadata: {b} sequences but {len(self.context_lens)} context_lens, "
                             f"{len(self.seq_slot_list)} seq_slots, {self.block_tables.shape[0]} block tables")
        if self.tensor_only and any(n != 1 for n in self.num_tokens_per_seq):
            raise ValueError("StepMetadata: tensor_only is for decode steps (one new token per sequence), "
                             f"got num_tokens_per_seq={self.num_tokens_per_seq}")
        if sum(self.num_tokens_per_seq) != self.input_ids.shape[0]:
            raise ValueError(f"StepMetadata: num_tokens_per_seq sums to {sum(self.num_tokens_per_seq)}, "
                             f"input_ids has {self.input_ids.shape[0]} rows")

    @property
    def num_seqs(self) -> int:
        return len(self.num_tokens_per_seq)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def suffix(self, first_positions: Sequence[int]) -> Tuple[torch.Tensor, Optional["StepMetadata"]]:
        """Rows of each sequence at positions >= ``first_positions[b]``: (their row ids in this
        step [R], a StepMetadata of just those rows). Sequences with no such row are left out;
        the metadata is None when no row is left. Its logits rows are each sequence's last row."""
        rows: List[int] = []
        keep, counts, ctx = [], [], []
        for b, (s, n, c) in enumerate(zip(self.query_start_list, self.num_tokens_per_seq, self.context_lens)):
            skip = min(n, max(0, int(first_positions[b]) - c))
            if skip == n:
                continue
            rows.extend(range(s + skip, s + n))
            keep.append(b)
            counts.append(n - skip)
            ctx.append(c + skip)
        device = self.input_ids.device
        idx = torch.tensor(rows, dtype=torch.long, device=device)  # [R]
        if not rows:
            return idx, None
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        seqs = torch.tensor(keep, dtype=torch.long, device=device)  # [B']
        sub = StepMetadata(
            input_ids=self.input_ids[idx], positions=self.positions[idx],
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_slots=self.seq_slots[seqs], block_tables=self.block_tables[seqs],
            logits_indices=torch.tensor(starts[1:], dtype=torch.long, device=device) - 1,
            num_tokens_per_seq=counts, context_lens=ctx, seq_slot_list=[self.seq_slot_list[b] for b in keep],
            query_start_list=starts[:-1])
        return idx, sub

    @classmethod
    def build(cls, token_ids: Sequence[Sequence[int]], context_lens: Sequence[int], seq_slots: Sequence[int],
              block_tables: Sequence[Sequence[int]], logits_indices: Optional[Sequence[int]] = None,
              device="cpu") -> "StepMetadata":
        """From python lists; ``logits_indices`` defaults to the last row of every sequence."""
        counts = [len(t) for t in token_ids]
        if any(n == 0 for n in counts):
            raise ValueError("StepMetadata.build: every sequence needs at least one new token")
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        # the per-token work in C (a 32K-token chunk: ~2 ms here, ~10 ms as python comprehensions)
        ids = torch.tensor(list(itertools.chain.from_iterable(token_ids)), dtype=torch.long)
        shift = torch.tensor([int(c) - s for c, s in zip(context_lens, starts)], dtype=torch.long)
        pos = torch.arange(starts[-1], dtype=torch.long) + torch.repeat_interleave(
            shift, torch.tensor(counts, dtype=torch.long), output_size=starts[-1])
        if logits_indices is None:
            logits_indices = [s - 1 for s in starts[1:]]
        width = max(1, max(len(bt) for bt in block_tables))
        table = torch.tensor([list(bt) + [0] * (width - len(bt)) for bt in block_tables], dtype=torch.int32)
        as_long = dict(dtype=torch.long, device=device)
        return cls(input_ids=ids.to(device), positions=pos.to(device),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                   seq_slots=torch.tensor(list(seq_slots), dtype=torch.int32, device=device),
                   block_tables=table.to(device), logits_indices=torch.tensor(list(logits_indices), **as_long),
                   num_tokens_per_seq=counts, context_lens=[int(c) for c in context_lens],
                   seq_slot_list=[int(s) for s in seq_slots], query_start_list=starts[:-1])
