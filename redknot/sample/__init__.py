"""Sampling: greedy / seeded sampling, logit filters, structured-output grammar masks."""
from redknot.sample.sampler import Sampler, SamplingRow, apply_bitmask
from redknot.sample.structured import GrammarError, GrammarState, StructuredOutputManager

__all__ = ["GrammarError", "GrammarState", "Sampler", "SamplingRow", "StructuredOutputManager", "apply_bitmask"]
