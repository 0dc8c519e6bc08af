"""Incremental-inference state of V4 (device tensors) and the per-step batch description.

Everything is addressed by absolute position, so rolling a sequence back by k
tokens is only "the sequence is k shorter": the next step's ``context_lens``
tells the model what is valid; rings are sized (see :class:`StateLayout`) so
that rows still needed are never overwritten by up to ``max_backtrack`` tokens.

* slot storage (one per running sequence, ``seq_slot``): per layer the SWA kv
  ring (row of position t at ``t % swa_ring``) and, for CSA/HCA layers, rings of
  raw projected compressor rows (kv and gate, fp32) at ``t % ring``;
* block storage (paged through ``block_tables``): per CSA layer the compressed
  entries and indexer keys, per HCA layer the compressed entries; entry w of
  ratio m sits in block ``block_table[w*m // block_size]`` at ``(w*m % block_size) // m``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from redknot.models.deepseek_v4.config import CSA, HCA, V4Config
from redknot.models.deepseek_v4.state_layout import StateLayout


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
        ids = [int(x) for t in token_ids for x in t]
        pos = [c + i for c, n in zip(context_lens, counts) for i in range(n)]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        if logits_indices is None:
            logits_indices = [s - 1 for s in starts[1:]]
        width = max(1, max(len(bt) for bt in block_tables))
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, bt in enumerate(block_tables):
            table[i, :len(bt)] = torch.tensor(list(bt), dtype=torch.int32)
        as_long = dict(dtype=torch.long, device=device)
        return cls(input_ids=torch.tensor(ids, **as_long), positions=torch.tensor(pos, **as_long),
                   query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                   seq_slots=torch.tensor(list(seq_slots), dtype=torch.int32, device=device),
                   block_tables=table.to(device), logits_indices=torch.tensor(list(logits_indices), **as_long),
                   num_tokens_per_seq=counts, context_lens=[int(c) for c in context_lens],
                   seq_slot_list=[int(s) for s in seq_slots], query_start_list=starts[:-1])


@dataclass
class LayerState:
    """Device storage of one layer (fields a layer type does not use are None)."""
    swa: torch.Tensor                            # [S, swa_ring, hd]
    kv_rows: Optional[torch.Tensor] = None       # [S, ring, C] fp32 raw compressor kv rows (CSA C=2hd, HCA hd)
    gate_rows: Optional[torch.Tensor] = None     # [S, ring, C] fp32 raw compressor gate rows (no ape)
    entries: Optional[torch.Tensor] = None       # [NB, E, hd] compressed entries
    idx_kv_rows: Optional[torch.Tensor] = None   # [S, csa_ring, 2*ihd] indexer compressor rows
    idx_gate_rows: Optional[torch.Tensor] = None
    idx_keys: Optional[torch.Tensor] = None      # [NB, E, ihd] indexer keys

    def tensors(self) -> List[torch.Tensor]:
        return [t for t in (self.swa, self.kv_rows, self.gate_rows, self.entries, self.idx_kv_rows,
                            self.idx_gate_rows, self.idx_keys) if t is not None]


class V4State:
    """All device tensors of the incremental state; allocated once by the model runner."""

    def __init__(self, cfg: V4Config, layout: StateLayout, layers: List[LayerState], mtp: List[LayerState],
                 num_slots: int, num_blocks: int):
        self.cfg, self.layout = cfg, layout
        self.layers, self.mtp = layers, mtp
        self.num_slots, self.num_blocks = num_slots, num_blocks

    @classmethod
    def allocate(cls, cfg: V4Config, layout: StateLayout, num_slots: int, num_blocks: int, device="cpu",
                 dtype: torch.dtype = torch.float32) -> "V4State":
        itemsize = torch.empty((), dtype=dtype).element_size()
        if itemsize != layout.kv_bytes:
            raise ValueError(f"V4State.allocate: dtype {dtype} has {itemsize} bytes per element but the layout "
                             f"was sized for kv_bytes={layout.kv_bytes}")
        if num_slots < 1 or num_blocks < 1:
            raise ValueError(f"V4State.allocate: num_slots={num_slots} and num_blocks={num_blocks} must be >= 1")
        hd, ihd, s, nb = cfg.head_dim, cfg.index_head_dim, num_slots, num_blocks
        kv = dict(dtype=dtype, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        layers = []
        for i, kind in enumerate(cfg.layer_types):
            st = LayerState(swa=torch.zeros(s, layout.swa_ring, hd, **kv))
            if kind == CSA:
                st.kv_rows = torch.zeros(s, layout.csa_ring, 2 * hd, **f32)
                st.gate_rows = torch.zeros(s, layout.csa_ring, 2 * hd, **f32)
                st.entries = torch.zeros(nb, layout.csa_entries_per_block, hd, **kv)
                st.idx_kv_rows = torch.zeros(s, layout.csa_ring, 2 * ihd, **f32)
                st.idx_gate_rows = torch.zeros(s, layout.csa_ring, 2 * ihd, **f32)
                st.idx_keys = torch.zeros(nb, layout.csa_entries_per_block, ihd, **kv)
            elif kind == HCA:
                st.kv_rows = torch.zeros(s, layout.hca_ring, hd, **f32)
                st.gate_rows = torch.zeros(s, layout.hca_ring, hd, **f32)
                st.entries = torch.zeros(nb, layout.hca_entries_per_block, hd, **kv)
            layers.append(st)
        n_mtp = layout.num_swa_layers - cfg.num_layers
        mtp = [LayerState(swa=torch.zeros(s, layout.swa_ring, hd, **kv)) for _ in range(n_mtp)]
        return cls(cfg, layout, layers, mtp, num_slots, num_blocks)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.layers + self.mtp for t in st.tensors())
