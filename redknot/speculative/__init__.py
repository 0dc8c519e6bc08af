"""Speculative decoding (DSpark: MTP drafting with confidence-scheduled verification) and
SWA bounded replay.

Roles: ``MTPDrafter`` (drafter.py) runs the MTP layer after each target step and
drafts; ``schedule`` picks each request's verify length from the draft
confidences; ``Verifier`` (verifier.py, math in rejection.py) keeps the accepted
drafts; ``DSpark`` (dspark.py) is what the model runner calls; ``CompactReplay``
(replay.py) bounds the window-only layers' prefill; ``SpecDecodeStats`` counts.
Torch-free names (schedule, replay, metrics) import without torch.
"""
from __future__ import annotations

from redknot._lazy import lazy_getattr

_EXPORTS = {
    "DSpark": "redknot.speculative.dspark",
    "Draft": "redknot.speculative.drafter",
    "MTPDrafter": "redknot.speculative.drafter",
    "Verifier": "redknot.speculative.verifier",
    "CompactReplay": "redknot.speculative.replay",
    "required_keep_tokens": "redknot.speculative.replay",
    "SpecDecodeStats": "redknot.speculative.metrics",
    "verify_length": "redknot.speculative.schedule",
    "speculative_sample": "redknot.speculative.rejection",
    "greedy_accept": "redknot.speculative.rejection",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
