"""Incremental-inference state of V4.1 (device tensors), laid out by :class:`V41StateLayout`.

Caches are stored in their trained byte formats (uint8 rows packed by
:mod:`redknot.kernels.mx_formats`): window rows 528 B, compressed entries 288 B,
index keys 68 B for the real dimensions. Reading a row back yields exactly the
quantise-dequantised value the reference computes, so a chunk boundary is invisible.
Everything is addressed by absolute position: rolling back k tokens is only "the
sequence is k shorter" (rings keep ``max_backtrack`` extra rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from redknot.models.deepseek_v41.state_layout import V41StateLayout


@dataclass
class SourceState:
    """Paged global caches of one kv source, plus its ratio-2 carry-over."""
    ratio: int
    entries: torch.Tensor                       # [NB, E, entry_bytes] uint8
    keys: torch.Tensor                          # [NB, E, key_bytes] uint8
    kv_rows: Optional[torch.Tensor] = None      # [S, compressor_ring, hd] fp32 raw wkv (ratio 2)
    gate_rows: Optional[torch.Tensor] = None    # [S, compressor_ring, hd] fp32 raw wgate (ratio 2)


class V41State:
    """All device tensors of the incremental state; allocated once by the model runner."""

    def __init__(self, cfg, layout: V41StateLayout, windows: List[torch.Tensor], sources: Dict[int, SourceState],
                 engram_ids: Optional[torch.Tensor], num_slots: int, num_blocks: int):
        self.cfg, self.layout = cfg, layout
        self.windows = windows          # per layer [S, window_ring, window_bytes] uint8
        self.sources = sources          # kv source layer -> SourceState
        self.engram_ids = engram_ids    # [S, engram_ring] int64 compressed ids (None: no Engram)
        self.num_slots, self.num_blocks = num_slots, num_blocks

    @classmethod
    def allocate(cls, cfg, layout: V41StateLayout, num_slots: int, num_blocks: int, device="cpu",
                 carry_dtype: torch.dtype = torch.float32) -> "V41State":
        """``carry_dtype``: the ratio-2 carry-over rows (fp32; fp64 when the model computes in fp64)."""
        if num_slots < 1 or num_blocks < 1:
            raise ValueError(f"V41State.allocate: num_slots={num_slots} and num_blocks={num_blocks} must be >= 1")
        u8 = dict(dtype=torch.uint8, device=device)
        f32 = dict(dtype=carry_dtype, device=device)
        windows = [torch.zeros(num_slots, layout.window_ring, layout.window_bytes, **u8)
                   for _ in range(layout.num_layers)]
        sources = {}
        for layer, ratio in layout.kv_sources:
            per = layout.entries_per_block(ratio)
            st = SourceState(ratio, torch.zeros(num_blocks, per, layout.entry_bytes, **u8),
                             torch.zeros(num_blocks, per, layout.key_bytes, **u8))
            if ratio == 2:
                st.kv_rows = torch.zeros(num_slots, layout.compressor_ring, layout.head_dim, **f32)
                st.gate_rows = torch.zeros(num_slots, layout.compressor_ring, layout.head_dim, **f32)
            sources[layer] = st
        engram = (torch.zeros(num_slots, layout.engram_ring, dtype=torch.long, device=device)
                  if cfg.engram_layer_ids else None)
        return cls(cfg, layout, windows, sources, engram, num_slots, num_blocks)

    def tensors(self) -> List[torch.Tensor]:
        out = list(self.windows)
        for st in self.sources.values():
            out += [t for t in (st.entries, st.keys, st.kv_rows, st.gate_rows) if t is not None]
        if self.engram_ids is not None:
            out.append(self.engram_ids)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def allocate_state(cfg, layout: V41StateLayout, *, num_slots: int, num_blocks: int, device, dtype) -> V41State:
    """The family's allocation hook; ``dtype`` only sets the ratio-2 carry-over precision
    (fp32, fp64 for an fp64 model); the caches are uint8 rows."""
    carry = torch.float64 if dtype == torch.float64 else torch.float32
    return V41State.allocate(cfg, layout, num_slots, num_blocks, device=device, carry_dtype=carry)
