"""What the engine hands back: per-request outputs and engine counters (pure Python)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from redknot.speculative.metrics import SpecDecodeStats


@dataclass
class RequestMetrics:
    """Engine-side ``time.perf_counter()`` values (after device synchronisation) and counts."""
    arrival_time: float
    scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """One request's result so far (``finished`` tells whether it is final).

    ``finish_reason`` is "stop" | "length" | "abort" | "error"; ``error`` holds
    the message for "error" (e.g. the grammar compiler's).
    """
    req_id: str
    prompt_token_ids: List[int]
    token_ids: List[int]
    text: str
    finished: bool
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    metrics: Optional[RequestMetrics] = None


@dataclass
class EngineStats:
    """Counters since the engine started."""
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_draft_proposed: int = 0
    num_draft_accepted: int = 0
    num_requests_finished: int = 0
    num_cuda_graph_steps: int = 0
    cuda_graphs: str = "off"               # "on: batch sizes [...]" or "off: <reason>"
    peak_memory_bytes: int = 0
    cache_blocks_total: int = 0
    cache_blocks_peak_used: int = 0
    execute_time_s: float = 0.0
    step_times_s: List[float] = field(default_factory=list, repr=False)
    # DSpark counters (acceptance, per-position acceptance, draft/verify times); None when drafting is
    # off. ``spec.as_metrics()`` gives them as flat numbers for MLflow.
    spec: Optional[SpecDecodeStats] = None
