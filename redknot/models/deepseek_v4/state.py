"""Incremental-inference state of V4 (device tensors).

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

from dataclasses import dataclass
from typing import List, Optional

import torch

from redknot.models.deepseek_v4.config import CSA, HCA, V4Config
from redknot.models.deepseek_v4.state_layout import StateLayout


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
