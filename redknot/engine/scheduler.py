"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

Pure Python (never imports torch). Each ``schedule()`` fills one step under
a token budget: running requests first, in arrival order (their decode token,
or the next chunk of their prompt), then waiting requests in arrival order
while there is budget, a free sequence slot and room in the cache. The head
of the waiting queue is never skipped, so no request starves. When a running
request needs a block and none is free, the most recently arrived running
request is preempted: its state is dropped and it is recomputed later from
its prompt and the tokens it had produced.

``schedule()`` advances ``num_computed_tokens`` at once and counts a pending
output token per sampling request, so the next step can be scheduled while
this one is still executing (asynchronous scheduling).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from redknot.cache import StateCacheManager
from redknot.config.schema import SchedulerConfig
from redknot.engine.messages import PLACEHOLDER_TOKEN, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from redknot.engine.request import FinishReason, Request, RequestStatus


@dataclass
class RequestUpdate:
    """New tokens of one request after a step (and whether it finished)."""
    request: Request
    new_token_ids: List[int] = field(default_factory=list)


class Scheduler:
    """FCFS continuous batching over a :class:`StateCacheManager`."""

    def __init__(self, config: SchedulerConfig, cache: StateCacheManager, *, max_model_len: int,
                 eos_token_id: Optional[int]) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk"):
            if getattr(config, name) < 1:
                raise ValueError(f"engine.scheduler.{name}={getattr(config, name)}: must be >= 1")
        self.config = config
        self.cache = cache
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.requests: Dict[str, Request] = {}
        self.waiting: List[Request] = []   # sorted by arrival_seq
        self.running: List[Request] = []   # sorted by arrival_seq
        self._finished_since_step: List[str] = []
        self._step_id = 0

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"request id {req.req_id!r} is already in the engine")
        if req.num_tokens >= self.max_model_len:
            raise ValueError(f"request {req.req_id!r}: prompt of {req.num_tokens} tokens leaves no room to "
                             f"generate within model.max_position={self.max_model_len}")
        self.requests[req.req_id] = req
        self._insert_waiting(req)

    def finish_request(self, req_id: str, reason: FinishReason, error: Optional[str] = None) -> Optional[Request]:
        """Remove a request (stop string, abort, error); returns it, or None if it already left."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.error = error
        req.draft_token_ids = []
        self._finished_since_step.append(req_id)
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        budget = self.config.max_num_batched_tokens
        scheduled: List[ScheduledRequest] = []
        preempted: List[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._num_new_tokens(req, budget)
            if n == 0:
                i += 1
                continue
            if not self._allocate_or_preempt(req, n, preempted):
                break  # req preempted itself: it was the last running request
            scheduled.append(self._schedule(req, n))
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit(budget, scheduled)
        out = SchedulerOutput(step_id=self._step_id, requests=scheduled,
                              finished_req_ids=self._finished_since_step, preempted_req_ids=preempted)
        self._finished_since_step = []
        return out

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        if len(req.output_token_ids) + req.num_output_placeholders >= req.params.max_tokens:
            return 0  # its last token is in flight; it finishes when that arrives
        if req.num_tokens + req.num_output_placeholders >= self.max_model_len:
            return 0
        remaining = req.num_tokens_with_pending - req.num_computed_tokens
        if remaining > 1 + len(req.draft_token_ids):  # prefill (or recompute) chunk
            remaining = min(remaining, self.config.long_prefill_chunk)
        return max(0, min(remaining, budget))

    def _allocate_or_preempt(self, req: Request, n: int, preempted: List[str]) -> bool:
        while not self.cache.allocate(req.req_id, req.num_computed_tokens + n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.req_id)
            if victim is req:
                return False
        return True

    def _admit(self, budget: int, scheduled: List[ScheduledRequest]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # its in-flight token must arrive before it is recomputed
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.long_prefill_chunk)
            if not self.cache.allocate(req.req_id, n):
                break  # FCFS: later requests wait behind the head, so the head cannot starve
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: r.arrival_seq)
            scheduled.append(self._schedule(req, n))
            budget -= n
        return budget

    def _schedule(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = req.num_tokens
        token_ids = [req.token_at(p) if p < known else PLACEHOLDER_TOKEN
                     for p in range(start, min(start + n, known + req.num_output_placeholders))]
        drafts = list(req.draft_token_ids)
        token_ids += drafts[:max(0, n - len(token_ids))]
        end = start + n
        num_logits = end - (req.num_tokens + req.num_output_placeholders) + 1
        num_logits = max(0, num_logits)
        seq_len = known + req.num_output_placeholders
        req.num_computed_tokens = end
        if num_logits:
            req.num_output_placeholders += 1
        return ScheduledRequest(req_id=req.req_id, slot=self.cache.slot(req.req_id),
                                block_table=self.cache.block_table(req.req_id), start_pos=start,
                                token_ids=token_ids, num_logits=num_logits,
                                draft_token_ids=drafts[:max(0, num_logits - 1)],
                                seq_len=seq_len,
                                next_token_id=req.token_at(end) if end < known else None)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req.req_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.num_preemptions += 1
        self._insert_waiting(req)

    def _insert_waiting(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.arrival_seq)

    # ------------------------------------------------------------------ results
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> List[RequestUpdate]:
        """Apply a finished step: append sampled tokens, roll back rejected drafts, finish requests."""
        updates: List[RequestUpdate] = []
        for sr in sched.requests:
            req = self.requests.get(sr.req_id)
            if req is None or sr.num_logits == 0:
                continue  # left the engine meanwhile, or a prefill chunk that samples nothing
            req.num_output_placeholders -= 1
            if sr.req_id in out.errors:
                self.finish_request(sr.req_id, FinishReason.ERROR, out.errors[sr.req_id])
                updates.append(RequestUpdate(req))
                continue
            tokens = out.sampled_token_ids.get(sr.req_id, [])
            self._rollback_rejected(req, sr, len(tokens))
            updates.append(RequestUpdate(req, self._append_tokens(req, tokens)))
            if req.status is RequestStatus.RUNNING:
                req.draft_token_ids = list(out.draft_token_ids.get(sr.req_id, ()))
        return updates

    def _rollback_rejected(self, req: Request, sr: ScheduledRequest, num_sampled: int) -> None:
        """A verify step feeds 1 + d tokens and keeps ``num_sampled`` <= 1 + d of them."""
        rejected = len(sr.draft_token_ids) + 1 - num_sampled
        req.num_draft_proposed += len(sr.draft_token_ids)
        req.num_draft_accepted += max(0, num_sampled - 1)
        req.draft_token_ids = []
        if rejected > 0 and req.status is RequestStatus.RUNNING:
            req.num_computed_tokens -= rejected
            self.cache.truncate(req.req_id, req.num_computed_tokens)

    def _append_tokens(self, req: Request, tokens: Iterable[int]) -> List[int]:
        new: List[int] = []
        for tok in tokens:
            req.output_token_ids.append(tok)
            new.append(tok)
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self.finish_request(req.req_id, reason)
                break
        return new

    def _stop_reason(self, req: Request, tok: int) -> Optional[FinishReason]:
        p = req.params
        if (not p.ignore_eos and tok == self.eos_token_id) or (p.stop_token_ids and tok in p.stop_token_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Cache accounting matches the request states (used by tests after every step)."""
        self.cache.check()
        for req in self.running:
            assert self.cache.has(req.req_id), f"running {req.req_id!r} holds no cache state"
            assert self.cache.num_tokens(req.req_id) >= req.num_computed_tokens
        for req in self.waiting:
            assert not self.cache.has(req.req_id), f"waiting {req.req_id!r} still holds cache state"
            assert req.num_computed_tokens == 0
        assert len(self.running) <= self.config.max_num_seqs
