"""Sizes of V4's incremental-inference state, as plain numbers (no torch).

Two kinds of storage (see :class:`redknot.models.deepseek_v4.state.V4State`):

* per-sequence **slots**, fixed size: the SWA kv ring of every layer (incl. the
  MTP layer) and the compressor rings of raw projected rows;
* paged **blocks** of ``block_size`` token positions: CSA entries, indexer keys
  and HCA entries of those positions (entry ``w`` of ratio ``m`` belongs to the
  block holding position ``w*m``).

Ring sizes make rollback free: after the engine shortens a sequence by up to
``max_backtrack`` tokens, every row the next step reads is still in its ring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from redknot.models.deepseek_v4.config import CSA, HCA, V4Config

COMPRESSOR_ROW_BYTES = 4  # compressor rings hold raw projections in fp32 (pooling is done in fp32)


@dataclass(frozen=True)
class StateLayout:
    """Ring lengths, entries per block and bytes per unit for one model + engine setting."""
    block_size: int          # token positions per paged block (multiple of every compress ratio)
    max_backtrack: int       # tokens the engine may roll back (speculative draft length)
    swa_ring: int            # window + max_backtrack rows per layer
    csa_ring: int            # 2*m_csa + max_backtrack raw rows (overlapping windows need the previous one)
    hca_ring: int            # m_hca + max_backtrack raw rows
    csa_entries_per_block: int
    hca_entries_per_block: int
    num_swa_layers: int      # layers with a SWA ring (all main layers + MTP layers)
    num_csa_layers: int
    num_hca_layers: int
    head_dim: int
    index_head_dim: int
    kv_bytes: int            # bytes per element of SWA rings and block entries
    bytes_per_block: int
    bytes_per_slot: int

    @classmethod
    def create(cls, cfg: V4Config, block_size: int = 256, max_backtrack: int = 0, kv_bytes: int = 2,
               include_mtp: bool = True) -> "StateLayout":
        for ratio in cfg.ratios:
            if block_size <= 0 or block_size % ratio:
                raise ValueError(f"engine.scheduler.block_size={block_size}: must be a positive multiple of "
                                 f"every compress ratio {list(cfg.ratios)}")
        if max_backtrack < 0:
            raise ValueError(f"max_backtrack={max_backtrack}: must be >= 0")
        n_csa, n_hca = len(cfg.layers_of(CSA)), len(cfg.layers_of(HCA))
        n_swa = cfg.num_layers + (cfg.num_mtp_layers if include_mtp else 0)
        hd, ihd = cfg.head_dim, cfg.index_head_dim
        csa_ring = 2 * cfg.csa_ratio + max_backtrack
        hca_ring = cfg.hca_ratio + max_backtrack
        csa_epb, hca_epb = block_size // cfg.csa_ratio, block_size // cfg.hca_ratio
        per_block = (n_csa * csa_epb * (hd + ihd) + n_hca * hca_epb * hd) * kv_bytes
        swa_ring = cfg.sliding_window + max_backtrack
        # Rings hold [kv | gate] rows: CSA main 2*hd wide each, CSA indexer 2*ihd, HCA hd.
        per_slot = (n_swa * swa_ring * hd * kv_bytes
                    + n_csa * csa_ring * 2 * (2 * hd + 2 * ihd) * COMPRESSOR_ROW_BYTES
                    + n_hca * hca_ring * 2 * hd * COMPRESSOR_ROW_BYTES)
        return cls(block_size=block_size, max_backtrack=max_backtrack, swa_ring=swa_ring,
                   csa_ring=csa_ring, hca_ring=hca_ring, csa_entries_per_block=csa_epb,
                   hca_entries_per_block=hca_epb, num_swa_layers=n_swa, num_csa_layers=n_csa,
                   num_hca_layers=n_hca, head_dim=hd, index_head_dim=ihd, kv_bytes=kv_bytes,
                   bytes_per_block=max(per_block, 1), bytes_per_slot=per_slot)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` positions needs."""
        return -(-num_tokens // self.block_size)

    def describe(self, num_slots: Optional[int] = None, num_blocks: Optional[int] = None) -> str:
        text = (f"block_size={self.block_size} swa_ring={self.swa_ring} csa_ring={self.csa_ring} "
                f"hca_ring={self.hca_ring} bytes/block={self.bytes_per_block} bytes/slot={self.bytes_per_slot}")
        if num_slots is not None and num_blocks is not None:
            total = num_slots * self.bytes_per_slot + num_blocks * self.bytes_per_block
            text += f" total={total / 2**20:.1f} MiB"
        return text
