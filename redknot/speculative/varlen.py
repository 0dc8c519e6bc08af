"""Variable-length verification inside CUDA graphs: the step layout, built on the device.

A verify step feeds each request its anchor plus the drafts the scheduler admitted: query
lengths 1..g+1 that differ per request and per step. One captured graph per *total token* tier
serves every mix: the step's T real rows are front-packed and padded up to the smallest tier
>= T, and every per-row value the model reads (positions, slots, which request a row belongs
to, query starts, logits rows) is computed here from device tensors holding the per-request
query lengths and start positions, with fixed shapes and no host synchronisation, so a graph
replays it as captured. Padding rows point at the engine's spare slot and block.

The V4 model's tensor-only forward handles one token per sequence today; until its attention,
compressor and indexer read the per-request query starts from these tensors, verify steps run
eagerly and only the plain decode steps replay graphs (``VerifyGraphs.status`` says so).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch


def verify_tiers(max_num_seqs: int, block: int) -> List[int]:
    """Captured total-token tiers of verify steps: every request feeds 1..block+1 tokens, so totals
    run up to ``max_num_seqs * (block + 1)``; powers of two and their 1.5x below it, and the top."""
    top = max_num_seqs * (block + 1)
    tiers, n = {top}, 1
    while n < top:
        tiers.add(n)
        if n >= 2 and n * 3 // 2 < top:
            tiers.add(n * 3 // 2)
        n *= 2
    return sorted(tiers)


def tier_for(total: int, tiers: List[int]) -> int:
    """The smallest captured tier holding ``total`` rows (ValueError when none does)."""
    for t in tiers:
        if t >= total:
            return t
    raise ValueError(f"a verify step of {total} tokens exceeds the largest captured tier {tiers[-1]}")


@dataclass
class VarlenLayout:
    """Per-row tensors of one padded verify step (all on the device, length = the tier)."""
    query_start_loc: torch.Tensor  # [R+1] int32: request r's rows are [qsl[r], qsl[r+1])
    row_request: torch.Tensor      # [tier] long: the request of each row (R for padding rows)
    positions: torch.Tensor        # [tier] long: start_pos[r] + offset in the request (0 for padding)
    slots: torch.Tensor            # [tier] int32: request slot (the spare slot for padding)
    valid: torch.Tensor            # [tier] bool: real rows
    logits_rows: torch.Tensor      # [tier] long: every row gets logits (verify rows); padding rows too


def varlen_layout(query_lens: torch.Tensor, start_pos: torch.Tensor, slots: torch.Tensor, tier: int,
                  padding_slot: int) -> VarlenLayout:
    """Layout of a step whose R requests feed ``query_lens`` [R] tokens from ``start_pos`` [R] on.
    Only tensor ops with shapes fixed by R and ``tier``: capturable, and no host synchronisation
    (the total is never read back; rows past it are padding)."""
    r = query_lens.shape[0]
    device = query_lens.device
    lens = query_lens.long()
    qsl = torch.zeros(r + 1, dtype=torch.long, device=device)
    qsl[1:] = torch.cumsum(lens, dim=0)
    rows = torch.arange(tier, device=device)
    # request of each row: how many request ends lie at or before it (R for rows past the total)
    row_request = torch.searchsorted(qsl[1:], rows, right=True)  # [tier] in 0..R
    valid = row_request < r
    req = row_request.clamp(max=max(r - 1, 0))
    offset = rows - qsl[req]
    positions = torch.where(valid, start_pos.long()[req] + offset, torch.zeros_like(rows))
    slot = torch.where(valid, slots.long()[req], torch.full_like(rows, padding_slot)).to(torch.int32)
    return VarlenLayout(query_start_loc=qsl.to(torch.int32), row_request=row_request, positions=positions,
                        slots=slot, valid=valid, logits_rows=rows)


class VerifyGraphs:
    """Graphs of verify steps keyed by total-token tier (see the module docstring). Capture needs a
    model whose tensor-only forward reads per-request query lengths (``supports_varlen_graphs``)."""

    def __init__(self, runner, max_num_seqs: int, block: int) -> None:
        self.runner = runner
        self.tiers = verify_tiers(max_num_seqs, block)
        self.disabled_reason = None
        if not getattr(runner.model, "supports_varlen_graphs", False):
            self.disabled_reason = ("the model's tensor-only forward handles one token per sequence (its "
                                    "attention, compressor and indexer do not read per-request query lengths); "
                                    "verify steps run eagerly")
        else:
            # The layout above is what a captured verify step reads; capturing and replaying one graph per
            # tier (with the draft's taps refreshed on replay) is not written yet.
            self.disabled_reason = ("verify-step capture is not implemented (the model's tensor-only step takes "
                                    "per-request query lengths); verify steps run eagerly")

    @property
    def status(self) -> str:
        return f"off: {self.disabled_reason}" if self.disabled_reason else f"on: total-token tiers {self.tiers}"
