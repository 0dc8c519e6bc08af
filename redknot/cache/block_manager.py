"""Block manager for the decode-time state (pure Python; the tensors live in the model runner).

Each running sequence owns one *slot* (its fixed-size storage, e.g. V4's SWA
and compressor rings) and a *block table*: the paged blocks that hold its
position-indexed storage (V4: CSA entries, indexer keys and HCA entries),
``block_size`` tokens per block. All state is
addressed by absolute position, so a sequence that becomes ``k`` tokens
shorter (speculative rollback) only gives back the blocks past its new length.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List

from redknot.cache.spec import CacheSpec


class CacheLeakError(AssertionError):
    """The accounting lost or duplicated a block or slot."""


@dataclass
class _SeqState:
    slot: int
    num_tokens: int = 0
    block_table: List[int] = field(default_factory=list)


class FreeList:
    """Free ids ``0..n-1``. Freed ids join the back of the queue, so recently freed
    state is reused as late as possible (easier to spot use-after-free in tests)."""

    def __init__(self, n: int) -> None:
        self.capacity = n
        self._free: Deque[int] = deque(range(n))

    def __len__(self) -> int:
        return len(self._free)

    def take(self, k: int) -> List[int]:
        if k > len(self._free):
            raise RuntimeError(f"asked for {k} ids, {len(self._free)} free")
        return [self._free.popleft() for _ in range(k)]

    def give(self, ids: List[int]) -> None:
        self._free.extend(ids)

    def free_ids(self) -> List[int]:
        return list(self._free)


class StateCacheManager:
    """Accounts slots and blocks per request id.

    ``allocate(req_id, num_tokens)`` makes room for a sequence of ``num_tokens``
    tokens in total (all or nothing); ``truncate``/``rollback`` shrink it;
    ``free`` returns everything. ``check()`` verifies that every block and slot
    is owned exactly once or free.
    """

    def __init__(self, spec: CacheSpec, num_slots: int, num_blocks: int) -> None:
        if num_slots <= 0 or num_blocks <= 0:
            raise ValueError(f"StateCacheManager needs >= 1 slot and block, got {num_slots} slots, "
                             f"{num_blocks} blocks")
        self.spec = spec
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self._slots = FreeList(num_slots)
        self._blocks = FreeList(num_blocks)
        self._seqs: Dict[str, _SeqState] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._slots)

    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._blocks) / self.num_blocks

    def has(self, req_id: str) -> bool:
        return req_id in self._seqs

    def slot(self, req_id: str) -> int:
        return self._seqs[req_id].slot

    def block_table(self, req_id: str) -> List[int]:
        return list(self._seqs[req_id].block_table)

    def num_tokens(self, req_id: str) -> int:
        return self._seqs[req_id].num_tokens

    def blocks_needed(self, req_id: str, num_tokens: int) -> int:
        """Extra blocks ``allocate(req_id, num_tokens)`` would take."""
        held = len(self._seqs[req_id].block_table) if req_id in self._seqs else 0
        return max(0, self.spec.blocks_for(num_tokens) - held)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        if req_id not in self._seqs and not len(self._slots):
            return False
        return self.blocks_needed(req_id, num_tokens) <= len(self._blocks)

    # ------------------------------------------------------------------ updates
    def allocate(self, req_id: str, num_tokens: int) -> bool:
        """Grow ``req_id`` to hold ``num_tokens`` tokens; False (and no change) if it does not fit."""
        if not self.can_allocate(req_id, num_tokens):
            return False
        seq = self._seqs.get(req_id)
        if seq is None:
            seq = self._seqs[req_id] = _SeqState(slot=self._slots.take(1)[0])
        seq.block_table.extend(self._blocks.take(self.blocks_needed(req_id, num_tokens)))
        seq.num_tokens = max(seq.num_tokens, num_tokens)
        return True

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Shrink ``req_id`` to its first ``num_tokens`` tokens, freeing blocks past them."""
        seq = self._seqs[req_id]
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"truncate({req_id!r}, {num_tokens}): sequence holds {seq.num_tokens} tokens")
        keep = self.spec.blocks_for(num_tokens)
        self._blocks.give(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_tokens = num_tokens

    def rollback(self, req_id: str, k: int) -> None:
        """Forget the last ``k`` tokens of ``req_id`` (rejected speculative tokens)."""
        if k < 0:
            raise ValueError(f"rollback({req_id!r}, k={k}): k must be >= 0")
        self.truncate(req_id, self._seqs[req_id].num_tokens - k)

    def free(self, req_id: str) -> None:
        """Give back the slot and every block of ``req_id`` (no-op if it holds none)."""
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return
        self._blocks.give(seq.block_table)
        self._slots.give([seq.slot])

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise CacheLeakError unless every block/slot is free or owned exactly once."""
        self._check_ids("block", self._blocks, [b for s in self._seqs.values() for b in s.block_table],
                        self.num_blocks)
        self._check_ids("slot", self._slots, [s.slot for s in self._seqs.values()], self.num_slots)
        for req_id, seq in self._seqs.items():
            if len(seq.block_table) != self.spec.blocks_for(seq.num_tokens):
                raise CacheLeakError(f"{req_id!r} holds {len(seq.block_table)} blocks for {seq.num_tokens} tokens")

    def assert_empty(self) -> None:
        """Raise CacheLeakError if any request still holds state (call when the engine is idle)."""
        self.check()
        if self._seqs:
            raise CacheLeakError(f"requests still hold cache state: {sorted(self._seqs)}")

    @staticmethod
    def _check_ids(kind: str, free: FreeList, owned: List[int], capacity: int) -> None:
        ids = free.free_ids() + owned
        if sorted(ids) != list(range(capacity)):
            seen: Dict[int, int] = {}
            for i in ids:
                seen[i] = seen.get(i, 0) + 1
            dup = sorted(i for i, c in seen.items() if c > 1)
            lost = sorted(set(range(capacity)) - set(seen))
            raise CacheLeakError(f"{kind} accounting broken: duplicated {dup[:10]}, lost {lost[:10]}")
