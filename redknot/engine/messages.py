"""Typed messages between the scheduler, the model runner and the facade (pure Python)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# Input id of a token sampled by the step still in flight; the engine fills it in before launch.
PLACEHOLDER_TOKEN = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` are fed at absolute positions ``start_pos ..`` and may begin
    with ``PLACEHOLDER_TOKEN``. ``num_logits`` trailing rows get logits and are
    sampled (0 for a prefill chunk that does not reach the end of the prompt;
    1 for a plain step; 1 + number of draft tokens for a verify step).
    ``seq_len`` is the number of tokens known when scheduled (incl. in-flight
    ones): the length a prefill is heading to (compact SWA replay measures its
    kept tail from it). ``next_token_id`` is the known token right after this
    chunk (None when the chunk ends at the last known token); the MTP layer
    pairs it with the chunk's last row.
    """
    req_id: str
    slot: int
    block_table: List[int]
    start_pos: int
    token_ids: List[int]
    num_logits: int
    draft_token_ids: List[int] = field(default_factory=list)
    seq_len: int = 0
    next_token_id: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """What one engine step computes.

    ``finished_req_ids`` lists requests that left the engine since the previous
    step (the runner drops their generators and grammar matchers);
    ``preempted_req_ids`` those whose state was dropped by this schedule.
    """
    step_id: int
    requests: List[ScheduledRequest]
    finished_req_ids: List[str] = field(default_factory=list)
    preempted_req_ids: List[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def is_decode_only(self) -> bool:
        return all(r.num_tokens == 1 and r.num_logits == 1 for r in self.requests)


@dataclass
class ModelRunnerOutput:
    """What the runner produced for a step.

    ``sampled_token_ids[req_id]`` holds the tokens sampled for a request whose
    step reached the end of its known tokens: one for a plain step; for a
    verify step the accepted drafts followed by the bonus token. ``errors``
    fails single requests (e.g. a grammar with no allowed token).
    ``logits`` (only when the runner records them) maps req_id to its logits rows.
    ``draft_token_ids`` (speculative decoding) are the drafts to verify in a
    request's next step, proposed after this step's tokens.
    """
    step_id: int
    sampled_token_ids: Dict[str, List[int]] = field(default_factory=dict)
    draft_token_ids: Dict[str, List[int]] = field(default_factory=dict)
    errors: Dict[str, str] = field(default_factory=dict)
    logits: Optional[Dict[str, Any]] = None
    finish_time: float = 0.0
    execute_time: float = 0.0
