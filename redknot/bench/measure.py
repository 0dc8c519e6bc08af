"""Per-request timings from the engine's own clocks and counters.

All times come from ``RequestOutput.metrics`` (engine-side
``time.perf_counter()`` values taken after device synchronisation):

* TTFT = first token − arrival (arrival is when the harness admitted the
  request; with ``admission_batch_size=1`` nothing queues, so TTFT is one
  request's prefill);
* e2e = finish − arrival; queue = scheduled − arrival;
* prefill tok/s = prompt tokens / (first token − scheduled);
* decode tok/s = (output tokens − 1) / (finish − first token);
* acceptance length = (output tokens − 1) / decode steps, where each decode or
  verify step emits its accepted draft tokens plus one, so
  decode steps = output tokens − 1 − accepted drafts; None when nothing was
  drafted (1.00 would read as "every draft rejected").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Timings:
    """One request's timings (None where the engine did not get that far)."""
    ttft_s: Optional[float]
    e2e_s: Optional[float]
    queue_s: Optional[float]
    prefill_tok_s: Optional[float]
    decode_tok_s: Optional[float]
    draft_proposed: int
    draft_accepted: int
    accept_len: Optional[float]


def _span(start: Optional[float], end: Optional[float]) -> Optional[float]:
    if start is None or end is None:
        return None
    return end - start


def _rate(count: float, seconds: Optional[float]) -> Optional[float]:
    if seconds is None or seconds <= 0 or count <= 0:
        return None
    return count / seconds


def request_timings(metrics) -> Timings:
    """Timings of one finished request from its ``RequestMetrics`` (see the module docstring)."""
    if metrics is None:
        return Timings(None, None, None, None, None, 0, 0, None)
    outputs = int(metrics.num_output_tokens or 0)
    accepted = int(metrics.num_draft_accepted or 0)
    decode_tokens = max(outputs - 1, 0)
    decode_steps = decode_tokens - accepted
    decode_time = _span(metrics.first_token_time, metrics.finish_time)
    return Timings(
        ttft_s=_span(metrics.arrival_time, metrics.first_token_time),
        e2e_s=_span(metrics.arrival_time, metrics.finish_time),
        queue_s=_span(metrics.arrival_time, metrics.scheduled_time),
        prefill_tok_s=_rate(metrics.num_prompt_tokens, _span(metrics.scheduled_time, metrics.first_token_time)),
        decode_tok_s=_rate(decode_tokens, decode_time),
        draft_proposed=int(metrics.num_draft_proposed or 0),
        draft_accepted=accepted,
        accept_len=decode_tokens / decode_steps if decode_steps > 0 and metrics.num_draft_proposed else None,
    )
