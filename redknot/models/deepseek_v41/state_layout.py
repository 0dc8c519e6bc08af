"""Sizes of V4.1's incremental state, as plain numbers (no torch), reference §5.1.

Per-sequence **slots** (fixed size):

* the window ring of every backbone layer: one 528-byte row (FP8 e4m3 + E8M0 per 32,
  for a 512-wide latent) per position, at ``p % window_ring``;
* the ratio-2 compressor carry-over of each ratio-2 kv source: the raw fp32 ``wkv`` and
  ``wgate`` projections of the last positions, at ``p % compressor_ring`` (a group that
  straddles two steps is pooled from here);
* the Engram look-back: the compressed token ids of the last positions, at ``p % engram_ring``
  (look-back + 1 rows, so re-running a step at the same positions is harmless).

Paged **blocks** of ``block_size`` positions: for each kv source, its compressed entries
(288 B: FP4 e2m1 + E4M3 per 16) and index keys (68 B: FP4 e2m1 + E8M0 per 32); entry j of
ratio r belongs to the block holding position ``j*r``.

Rings carry ``max_backtrack`` extra rows, so a rollback of up to that many tokens never
needs a row that was overwritten; everything is addressed by absolute position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

COMPRESSOR_ROW_BYTES = 4   # raw ratio-2 projections are kept in fp32 (pooling runs in fp32)
ENGRAM_ID_BYTES = 8        # compressed token ids, int64


def window_row_bytes(d: int) -> int:
    return d + d // 32


def compressed_entry_bytes(d: int) -> int:
    return d // 2 + d // 16


def index_key_bytes(d: int) -> int:
    return d // 2 + d // 32


@dataclass(frozen=True)
class V41StateLayout:
    """Ring lengths and bytes per unit of the V4.1 state for one model + engine setting."""
    block_size: int
    max_backtrack: int
    window_ring: int                 # window + max_backtrack rows per layer
    compressor_ring: int             # 2 + max_backtrack raw rows per ratio-2 kv source
    engram_ring: int                 # (max_ngram - 1) + 1 + max_backtrack compressed ids
    num_layers: int
    kv_sources: Tuple[Tuple[int, int], ...]   # (layer, ratio) of every kv source
    head_dim: int
    index_head_dim: int
    window_bytes: int                # per row
    entry_bytes: int                 # per compressed entry
    key_bytes: int                   # per index key
    bytes_per_block: int
    bytes_per_slot: int

    @classmethod
    def create(cls, cfg, block_size: int = 256, max_backtrack: int = 0) -> "V41StateLayout":
        ratios = sorted({cfg.compress_ratios[s] for s in cfg.kv_source_layers})
        for ratio in ratios:
            if block_size <= 0 or block_size % ratio:
                raise ValueError(f"engine.scheduler.block_size={block_size}: must be a positive multiple of "
                                 f"every compress ratio {ratios}")
        if max_backtrack < 0:
            raise ValueError(f"max_backtrack={max_backtrack}: must be >= 0")
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        sources = tuple((s, cfg.compress_ratios[s]) for s in cfg.kv_source_layers)
        win, ent, key = window_row_bytes(hd), compressed_entry_bytes(hd), index_key_bytes(ihd)
        window_ring = cfg.window_size + max_backtrack
        comp_ring = 2 + max_backtrack
        # One id more than the look-back: the id a step stores at p never lands on p - lookback, which
        # that step reads, so a step run twice at the same positions (the CUDA-graph runner checks its
        # first replay against an eager run of the same step) reads the same history both times.
        engram_ring = max(cfg.engram_max_ngram_size - 1, 1) + 1 + max_backtrack
        per_block = sum((block_size // r) * (ent + key) for _, r in sources)
        n_ratio2 = sum(1 for _, r in sources if r == 2)
        per_slot = (cfg.n_layers * window_ring * win
                    + n_ratio2 * comp_ring * 2 * hd * COMPRESSOR_ROW_BYTES
                    + (engram_ring * ENGRAM_ID_BYTES if cfg.engram_layer_ids else 0))
        return cls(block_size=block_size, max_backtrack=max_backtrack, window_ring=window_ring,
                   compressor_ring=comp_ring, engram_ring=engram_ring, num_layers=cfg.n_layers,
                   kv_sources=sources, head_dim=hd, index_head_dim=ihd, window_bytes=win, entry_bytes=ent,
                   key_bytes=key, bytes_per_block=max(per_block, 1), bytes_per_slot=per_slot)

    def entries_per_block(self, ratio: int) -> int:
        return self.block_size // ratio

    def global_bytes_per_token(self) -> float:
        """Compressed KV + index keys per token over all kv sources (890 B for V4.1-Flash)."""
        return sum((self.entry_bytes + self.key_bytes) / r for _, r in self.kv_sources)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def describe(self, num_slots: Optional[int] = None, num_blocks: Optional[int] = None) -> str:
        text = (f"block_size={self.block_size} window_ring={self.window_ring} "
                f"compressor_ring={self.compressor_ring} global={self.global_bytes_per_token():.0f}B/token "
                f"bytes/block={self.bytes_per_block} bytes/slot={self.bytes_per_slot}")
        if num_slots is not None and num_blocks is not None:
            total = num_slots * self.bytes_per_slot + num_blocks * self.bytes_per_block
            text += f" total={total / 2**20:.1f} MiB"
        return text


def create_state_layout(cfg, *, block_size: int, max_backtrack: int, kv_bytes: int = 1) -> V41StateLayout:
    """The family's layout hook. ``kv_bytes`` (``hardware.kv_cache_dtype``) does not apply:
    V4.1 caches are stored in their trained byte formats whatever the compute dtype."""
    return V41StateLayout.create(cfg, block_size=block_size, max_backtrack=max_backtrack)
