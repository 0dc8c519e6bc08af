"""Cache sizing: how many per-sequence slots and paged blocks fit in a memory budget.

Pure Python. The numbers come from the model family's state layout (bytes per
block, bytes per slot, tokens per block); the budget comes from the model
runner (free device memory on a GPU) or from the configuration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheSpec:
    """The per-unit costs of a model's decode-time state.

    * a *slot* is one sequence's fixed-size storage (V4: the SWA kv ring of every
      layer, window + speculative backtrack, and the compressor rings);
    * a *block* holds ``block_size`` tokens' worth of paged storage (V4: CSA
      entries, indexer keys and HCA entries for those tokens).
    """
    block_size: int
    bytes_per_block: int
    bytes_per_slot: int

    def __post_init__(self) -> None:
        for name in ("block_size", "bytes_per_block", "bytes_per_slot"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheSpec.{name}={value!r}: must be a positive integer")

    @classmethod
    def from_layout(cls, layout: Any) -> "CacheSpec":
        """Read the three numbers from a family's state layout (:class:`redknot.models.family.StateSizes`)."""
        return cls(block_size=int(layout.block_size), bytes_per_block=int(layout.bytes_per_block),
                   bytes_per_slot=int(layout.bytes_per_slot))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens occupies."""
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True)
class CachePlan:
    """The result of sizing: what the model runner allocates."""
    num_slots: int
    num_blocks: int
    bytes_total: int

    def describe(self) -> str:
        return (f"{self.num_slots} sequence slots + {self.num_blocks} blocks "
                f"({self.bytes_total / 2**20:.1f} MiB)")


def plan_cache(spec: CacheSpec, *, max_num_seqs: int, max_model_len: int,
               budget_bytes: Optional[int] = None, num_blocks: Optional[int] = None) -> CachePlan:
    """Size the cache.

    ``num_blocks`` (``engine.scheduler.num_cache_blocks``) wins when given.
    Otherwise the cache holds every running sequence at ``max_model_len``
    (more blocks would never be used), shrunk to ``budget_bytes`` when one is
    given. Every running sequence always gets its slot; at least one
    maximum-length sequence must fit in the blocks, else no request could ever
    finish.
    """
    if max_num_seqs <= 0:
        raise ValueError(f"engine.scheduler.max_num_seqs={max_num_seqs}: must be >= 1")
    if max_model_len <= 0:
        raise ValueError(f"model.max_position={max_model_len}: must be >= 1")
    slots_bytes = max_num_seqs * spec.bytes_per_slot
    per_seq_blocks = spec.blocks_for(max_model_len)
    if num_blocks is not None:
        budget_bytes = None  # the configured count wins; the budget plays no part
    if num_blocks is None:
        num_blocks = max_num_seqs * per_seq_blocks
        if budget_bytes is not None:
            num_blocks = min(num_blocks, (budget_bytes - slots_bytes) // spec.bytes_per_block)
    elif num_blocks <= 0:
        raise ValueError(f"engine.scheduler.num_cache_blocks={num_blocks}: must be >= 1 or null")
    if num_blocks < per_seq_blocks:
        need = slots_bytes + per_seq_blocks * spec.bytes_per_block
        budget = "" if budget_bytes is None else f" in a budget of {budget_bytes / 2**20:.1f} MiB"
        raise ValueError(
            f"cache too small: {max(num_blocks, 0)} blocks{budget}, but one sequence of model.max_position="
            f"{max_model_len} tokens needs {per_seq_blocks} blocks of {spec.block_size} tokens "
            f"(with engine.scheduler.max_num_seqs={max_num_seqs} slots: {need / 2**20:.1f} MiB); lower "
            f"engine.scheduler.max_num_seqs or model.max_position, or raise hardware.memory_utilization / "
            f"engine.scheduler.num_cache_blocks")
    return CachePlan(num_slots=max_num_seqs, num_blocks=int(num_blocks),
                     bytes_total=slots_bytes + int(num_blocks) * spec.bytes_per_block)
