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
    "DSpark": "redknot.spec.dspark",
    "Draft": "redknot.spec.drafter",
    "MTPDrafter": "redknot.spec.drafter",
    "Verifier": "redknot.spec.verifier",
    "CompactReplay": "redknot.spec.replay",
    "required_keep_tokens": "redknot.spec.replay",
    "SpecDecodeStats": "redknot.spec.metrics",
    "verify_length": "redknot.spec.schedule",
    "speculative_sample": "redknot.spec.rejection",
    "greedy_accept": "redknot.spec.rejection",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
