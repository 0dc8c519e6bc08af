"""One request's bookkeeping inside the engine (pure Python)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import List, Optional

from redknot.sample.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # never scheduled, or preempted (state dropped, to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"      # EOS, a stop token id, a stop string, or a completed grammar
    LENGTH = "length"  # max_tokens or the model's maximum length
    ABORT = "abort"
    ERROR = "error"    # e.g. a structured-output grammar that does not compile


@dataclass
class RequestTimes:
    """Engine-side ``time.perf_counter()`` stamps (taken after device synchronisation)."""
    arrival: float
    scheduled: Optional[float] = None
    first_token: Optional[float] = None
    finish: Optional[float] = None


@dataclass
class Request:
    """A request's tokens and progress.

    ``num_computed_tokens`` counts tokens whose state is in the cache (or will be
    once the step that scheduled them finishes). ``num_output_placeholders``
    counts tokens being sampled by a step still in flight (asynchronous
    scheduling); ``draft_token_ids`` are speculative tokens to verify next step.
    """
    req_id: str
    prompt_token_ids: List[int]
    params: SamplingParams
    arrival_seq: int
    times: RequestTimes
    seed: int = 0
    output_token_ids: List[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    draft_token_ids: List[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    finish_reason: Optional[FinishReason] = None
    error: Optional[str] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + sampled output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Tokens the state will hold once in-flight and draft tokens are fed."""
        return self.num_tokens + self.num_output_placeholders + len(self.draft_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_tokens - 1

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]
