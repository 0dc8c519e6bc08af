"""EngineCore: one engine step = schedule -> prepare -> execute -> update -> outputs.

With ``features.async_scheduling`` the device step N runs on a worker thread
while the host schedules and prepares step N+1 and, after launching it,
detokenizes step N's tokens. Step N+1 is scheduled before step N's tokens are
known: decode inputs are placeholders filled in just before launch, a request
that step N finishes is computed once more and that token discarded, and the
grammar masks of step N+1 are built after step N's tokens reached the
matchers. Tokens are therefore identical with the pipeline on or off.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional, Tuple

from redknot.engine.inputs import build_step_inputs
from redknot.engine.messages import ModelRunnerOutput, SchedulerOutput
from redknot.engine.model_runner import ModelRunner, StepBatch
from redknot.engine.output_processor import OutputProcessor
from redknot.engine.outputs import EngineStats, RequestOutput
from redknot.engine.scheduler import RequestUpdate, Scheduler
from redknot.sample import SamplingRow, StructuredOutputManager
from redknot.sample.params import SamplingParams

_InFlight = Tuple[SchedulerOutput, Future]
_DISCARDED = SamplingParams()  # sampling parameters for rows whose token nobody will read


class EngineCore:
    """Drives scheduler, runner and output processor; see the module docstring for the pipeline."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, outputs: OutputProcessor,
                 structured: Optional[StructuredOutputManager], async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.outputs = outputs
        self.structured = structured
        self.stats = EngineStats(cache_blocks_total=scheduler.cache.num_blocks)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="redknot-step") if async_scheduling else None
        self._inflight: Optional[_InFlight] = None
        self._pending: List[RequestOutput] = []  # finished outside a step (abort, grammar error)

    # ------------------------------------------------------------------ public
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None or bool(self._pending)

    def report(self, output: RequestOutput) -> None:
        """Queue an output produced outside a step; returned by the next ``step()``."""
        self._pending.append(output)

    def step(self) -> List[RequestOutput]:
        results, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self._count(sched)
        inputs = build_step_inputs(sched)
        if self._executor is None:
            if not sched.is_empty:
                out = self.runner.execute(self._batch(inputs))
                results += self._finish_step(sched, out)
            return results
        prev = self._inflight
        self._inflight = None
        prev_out = prev[1].result() if prev is not None else None
        updates: List[RequestUpdate] = []
        if prev_out is not None:
            updates = self.scheduler.update_from_output(prev[0], prev_out)
            self.outputs.advance_grammars(updates)
            inputs.fill_placeholders(prev_out)
        if not sched.is_empty:
            self._inflight = (sched, self._executor.submit(self.runner.execute, self._batch(inputs)))
        if prev_out is not None:
            results += self._after_update(updates, prev_out)
        return results

    def close(self) -> None:
        if self._inflight is not None:
            self._inflight[1].result()
            self._inflight = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ------------------------------------------------------------------ internals
    def _finish_step(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> List[RequestOutput]:
        updates = self.scheduler.update_from_output(sched, out)
        self.outputs.advance_grammars(updates)
        return self._after_update(updates, out)

    def _after_update(self, updates: List[RequestUpdate], out: ModelRunnerOutput) -> List[RequestOutput]:
        self.stats.step_times_s.append(out.execute_time)
        self.stats.execute_time_s += out.execute_time
        results = self.outputs.process(updates, out.finish_time)
        for r in results:
            if r.finished:
                self.stats.num_requests_finished += 1
                self.stats.num_draft_proposed += r.metrics.num_draft_proposed
                self.stats.num_draft_accepted += r.metrics.num_draft_accepted
        return results

    def _batch(self, inputs) -> StepBatch:
        """Sampling rows and grammar masks, built from the requests' current tokens."""
        rows: List[SamplingRow] = []
        grammars = []
        for sr in inputs.sched.requests:
            if not sr.num_logits:
                continue
            req = self.scheduler.requests.get(sr.req_id)
            if req is None:  # finished by the previous step's tokens: sampled, then discarded
                rows += [SamplingRow(sr.req_id, _DISCARDED, 0, 0)] * sr.num_logits
                grammars += [None] * sr.num_logits
                continue
            end = sr.start_pos + sr.num_tokens
            history = list(req.output_token_ids) if req.params.logits_processors else ()
            for j in range(sr.num_logits):
                index = end - sr.num_logits + j + 1 - req.num_prompt_tokens
                rows.append(SamplingRow(sr.req_id, req.params, req.seed, index, history))
                grammars.append(self.outputs.grammar_of(sr.req_id))
        bitmask = self.structured.bitmask(grammars) if self.structured is not None else None
        return StepBatch(inputs=inputs, rows=rows, bitmask=bitmask)

    def _count(self, sched: SchedulerOutput) -> None:
        if sched.is_empty:
            return
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted_req_ids)
        now = time.perf_counter()
        for sr in sched.requests:
            req = self.scheduler.requests[sr.req_id]
            if req.times.scheduled is None:
                req.times.scheduled = now
            prefill = max(0, min(sr.num_tokens, req.num_prompt_tokens - sr.start_pos))
            self.stats.num_prefill_tokens += prefill
            self.stats.num_decode_tokens += sr.num_tokens - prefill
        used = self.scheduler.cache.num_blocks - self.scheduler.cache.num_free_blocks
        self.stats.cache_blocks_peak_used = max(self.stats.cache_blocks_peak_used, used)
