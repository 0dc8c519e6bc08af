"""Sampling: decoding parameters, greedy / seeded sampling, logit filters, structured-output grammar masks.

``SamplingParams`` (params.py) is pure Python; the sampler and the grammar masks
need torch and are imported on first use, so the engine's pure-Python roles
(requests, scheduler) can import the parameters without torch.
"""
from __future__ import annotations

from redknot._lazy import lazy_getattr

_EXPORTS = {
    "SamplingParams": "redknot.sample.params",
    "Sampler": "redknot.sample.sampler",
    "SamplingRow": "redknot.sample.sampler",
    "apply_bitmask": "redknot.sample.sampler",
    "GrammarError": "redknot.sample.structured",
    "GrammarState": "redknot.sample.structured",
    "StructuredOutputManager": "redknot.sample.structured",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
