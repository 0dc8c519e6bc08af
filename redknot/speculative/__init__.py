"""Speculative decoding (DSpark drafting, token-wise or block verification,
confidence-scheduled verify lengths) and SWA bounded replay.

Roles: ``DSparkDrafter`` (dspark_drafter.py) fills the DSpark stages' context
rings from the target's taps and drafts one block per request; ``MTPDrafter``
(drafter.py) runs a classic MTP layer (the June V4-Flash); ``MarkovSampler``
(draft_sampling.py) draws drafts and keeps their q; ``VerifyScheduler``
(schedule.py) picks each request's verify length; ``Verifier`` (verifier.py,
math in rejection.py) keeps the accepted drafts; ``DSparkSpeculator``
(dspark.py) is what the model runner calls; ``CompactReplay`` (replay.py)
bounds the window-only layers' prefill; ``SpecDecodeStats`` counts.
Torch-free names (schedule, replay, metrics) import without torch.
"""
from __future__ import annotations

from redknot._lazy import lazy_getattr

_EXPORTS = {
    "DSparkSpeculator": "redknot.speculative.dspark",
    "DSparkDrafter": "redknot.speculative.dspark_drafter",
    "VerifyGraphs": "redknot.speculative.varlen",
    "VerifyScheduler": "redknot.speculative.schedule",
    "MarkovSampler": "redknot.speculative.draft_sampling",
    "Draft": "redknot.speculative.drafter",
    "MTPDrafter": "redknot.speculative.drafter",
    "Verifier": "redknot.speculative.verifier",
    "CompactReplay": "redknot.speculative.replay",
    "required_keep_tokens": "redknot.speculative.replay",
    "SpecDecodeStats": "redknot.speculative.metrics",
    "allocate": "redknot.speculative.schedule",
    "choose_budget": "redknot.speculative.schedule",
    "CostModel": "redknot.speculative.schedule",
    "speculative_sample": "redknot.speculative.rejection",
    "block_sample": "redknot.speculative.rejection",
    "greedy_accept": "redknot.speculative.rejection",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
