"""Device-side per-token / per-sequence indices of one step, shared by the fast backends (pure torch).

Derived from ``StepMetadata``'s tensors (``positions``, ``query_start_loc``) without a host sync, once
per step object, so CUDA-graph replays and every layer of a step reuse them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, Tuple

import torch


@dataclass(frozen=True)
class StepTensors:
    """Index tensors of one step."""
    token_seq: torch.Tensor     # [T] int32 sequence index of each row
    context_lens: torch.Tensor  # [B] int32 first position of each sequence in the step
    query_start: torch.Tensor   # [B] int32 first row of each sequence
    positions: torch.Tensor     # [T] int32 position of each row


_CACHE: Dict[int, Tuple[weakref.ref, StepTensors]] = {}


def step_tensors(meta) -> StepTensors:
    """The :class:`StepTensors` of ``meta`` (computed on its first use). A ``tensor_only`` step's
    tensors change in place between uses (CUDA-graph buffers), so its indices are kept for one forward only
    (``meta.forward_memo``, emptied by each forward's ``StepContext``): a captured graph records their
    computation once, and every layer of the step reads it."""
    if getattr(meta, "tensor_only", False):
        memo = getattr(meta, "forward_memo", None)
        if memo is None:
            return _compute(meta)
        st = memo.get("step_tensors")
        if st is None:
            st = memo["step_tensors"] = _compute(meta)
        return st
    hit = _CACHE.get(id(meta))
    if hit is not None and hit[0]() is meta:
        return hit[1]
    st = _compute(meta)
    if len(_CACHE) > 64:
        for key in [k for k, (r, _) in _CACHE.items() if r() is None]:
            del _CACHE[key]
    _CACHE[id(meta)] = (weakref.ref(meta), st)
    return st


def _compute(meta) -> StepTensors:
    qsl = meta.query_start_loc
    if getattr(meta, "tensor_only", False):
        # one row per sequence (StepMetadata checks it): row b is sequence b's only token, so the sequence of a
        # row and the first row of a sequence are both 0..B-1 (query_start_loc[:-1]), and a sequence's first
        # position is its row's position: two casts at most, where the general form takes about seven launches
        starts = qsl[:-1].to(torch.int32)
        pos = meta.positions.to(torch.int32)
        return StepTensors(starts, pos, starts, pos)
    rows = torch.arange(meta.positions.shape[0], device=qsl.device, dtype=qsl.dtype)
    token_seq = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).to(torch.int32)
    starts = qsl[:-1].to(torch.int32)
    last = max(meta.positions.shape[0] - 1, 0)
    pos = meta.positions.to(torch.int32)
    ctx = pos.index_select(0, starts.clamp(max=last).long())
    return StepTensors(token_seq, ctx, starts, pos)
