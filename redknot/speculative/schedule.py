"""Confidence-scheduled verification: how many drafted tokens a request verifies (pure Python).

Each draft carries a confidence, the draft distribution's probability of its own
token, read as the chance the target accepts it. The product of the confidences
of drafts 1..j estimates the chance that all j are accepted; a request verifies
the longest prefix whose estimate stays at or above the threshold (varlen), or
every draft (fixed length). Confidences depend only on the request's own tokens,
so a request's verify length never depends on the rest of the batch.
"""
from __future__ import annotations

from typing import Sequence


def verify_length(confidences: Sequence[float], threshold: float, varlen: bool) -> int:
    """Drafts to verify: the longest prefix whose cumulative estimate is >= ``threshold`` (varlen),
    else all of them."""
    if not varlen:
        return len(confidences)
    estimate = 1.0
    for i, conf in enumerate(confidences):
        estimate *= conf
        if estimate < threshold:
            return i
    return len(confidences)


def keep_drafting(confidences: Sequence[float], threshold: float, varlen: bool, limit: int) -> bool:
    """Whether one more draft could still be verified: fewer than ``limit`` drafted and (varlen)
    every draft so far kept the estimate at or above the threshold."""
    if len(confidences) >= limit:
        return False
    return not varlen or verify_length(confidences, threshold, True) == len(confidences)


def draft_limit(max_draft: int, num_outputs_after: int, max_tokens: int, next_position: int,
                max_model_len: int) -> int:
    """Drafts worth proposing for the next step of a request that will have ``num_outputs_after``
    output tokens and feed its last token at ``next_position``: the verify step emits the
    accepted drafts plus one token, which must fit in ``max_tokens`` and ``max_model_len``."""
    by_tokens = max_tokens - num_outputs_after - 1
    by_length = max_model_len - 2 - next_position
    return max(0, min(max_draft, by_tokens, by_length))
