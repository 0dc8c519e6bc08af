"""One case at a time: hot-TTFT repetitions, the scored run, and the record it leaves.

Hot TTFT (``suite.warmup_repeats`` / ``suite.measured_repeats``): each case first runs
``warmup_repeats`` times unmeasured, then ``measured_repeats - 1`` times with one output token
(TTFT only), then once with its full generation length, which is scored; the TTFTs of the
measured runs (the scored one included) give the case's p50 (``ttft_s``) and p95. Everything
runs through the public engine API with one active request, so no TTFT includes queueing;
loading, input building and first-use compilation happen before any measured repetition.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np

from redknot.bench.measure import request_timings
from redknot.bench.records import RequestRecord
from redknot.bench.runner import CaseJob, CaseOutcome, Runner
from redknot.bench.scoring import score_prediction


@dataclass(frozen=True)
class RecordContext:
    """What every record of one run (or one arm) shares."""
    suite: str
    config_hash: str
    inputs_address: str
    git_sha: str
    arm: Optional[str] = None


def build_record(outcome: CaseOutcome, ctx: RecordContext, ttft_repeats: Optional[List[float]] = None
                 ) -> RequestRecord:
    """The record of one finished case (scored when it finished ok)."""
    entry, out = outcome.entry, outcome.output
    timings = request_timings(getattr(out, "metrics", None))
    raw = out.text if out is not None else ""
    record = RequestRecord(
        case_id=entry.case_id, dataset=entry.dataset, row_id=entry.row_id, suite=ctx.suite,
        status=outcome.status, prompt_tokens=entry.num_tokens, max_new_tokens=entry.max_new_tokens,
        ids_sha256=entry.ids_sha256, inputs_address=ctx.inputs_address, config_hash=ctx.config_hash,
        git_sha=ctx.git_sha, completion_tokens=len(out.token_ids) if out is not None else 0,
        finish_reason=getattr(out, "finish_reason", None), error=outcome.error, dp_rank=outcome.dp_rank,
        ttft_s=timings.ttft_s, e2e_s=timings.e2e_s, queue_s=timings.queue_s,
        prefill_tok_s=timings.prefill_tok_s, decode_tok_s=timings.decode_tok_s,
        draft_proposed=timings.draft_proposed, draft_accepted=timings.draft_accepted,
        accept_len=timings.accept_len, peak_memory_bytes=outcome.peak_memory_bytes, prediction_raw=raw,
        metric=entry.metric, finished_unix=time.time(), role=getattr(entry, "role", "short"), arm=ctx.arm)
    metrics = getattr(out, "metrics", None)
    if metrics is not None and metrics.num_prompt_tokens:
        record.prompt_tokens = int(metrics.num_prompt_tokens)  # what the engine saw; validate compares
    if ttft_repeats is not None:  # hot TTFT: the repetitions' TTFTs, then the scored run's
        measured = list(ttft_repeats) + ([timings.ttft_s] if timings.ttft_s is not None else [])
        record.ttft_repeats_s = measured
        if measured:
            record.ttft_s = float(np.percentile(measured, 50))
            record.ttft_p95_s = float(np.percentile(measured, 95))
    if outcome.status == "ok":
        scored = score_prediction(raw, entry.answers, entry.metric, entry.first_line_only)
        record.prediction, record.score, record.scores = scored.prediction, scored.primary, scored.metrics
    return record


def is_hot(suite) -> bool:
    return suite.warmup_repeats > 0 or suite.measured_repeats > 1


class CaseExecutor:
    """Runs single cases on one engine, sequentially (see the module docstring)."""

    def __init__(self, engine: Any, params_for: Callable[[int], Any], suite, timeout_s: float):
        self.suite = suite
        self.runner = Runner(engine, params_for, admission_batch_size=1, dp_size=1, timeout_s=timeout_s)

    def _once(self, job: CaseJob, max_tokens: Optional[int]) -> CaseOutcome:
        done: List[CaseOutcome] = []
        self.runner.run([job], done.append, max_tokens)
        return done[0]

    def repetitions(self, job: CaseJob) -> List[float]:
        """Warm-up repetitions (discarded), then the TTFT-only measured ones; their TTFTs."""
        for r in range(self.suite.warmup_repeats):
            self._once(CaseJob(job.entry, job.prompt_ids, f"#warm{r}"), 1)
        ttfts = []
        for r in range(max(self.suite.measured_repeats - 1, 0)):
            outcome = self._once(CaseJob(job.entry, job.prompt_ids, f"#rep{r}"), 1)
            ttft = request_timings(getattr(outcome.output, "metrics", None)).ttft_s
            if outcome.status != "ok" or ttft is None:
                break  # the scored run below reports the failure
            ttfts.append(ttft)
        return ttfts

    def run(self, job: CaseJob) -> tuple:
        """(outcome of the scored run, TTFTs of the measured repetitions before it; None when not hot)."""
        ttfts = self.repetitions(job) if is_hot(self.suite) else None
        return self._once(job, None), ttfts
