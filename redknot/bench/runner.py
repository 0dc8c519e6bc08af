"""Drive the engine through a suite: admit token-id requests, step, collect finished outputs.

Admission: at most ``admission_batch_size`` requests are active per
data-parallel rank (each request is assigned to the least-loaded rank; with
``admission_batch_size=1`` every TTFT is one request's prefill with nothing
queued). The runner uses only the public engine API — ``add_request``,
``step``, ``abort``, ``has_unfinished_requests``, ``stats`` — and never
imports the engine: the caller passes the ``LLM`` and a factory for its
``SamplingParams``.

Failures stay per case: an output finished with ``error`` (``oom`` when the
message says out of memory), a request past ``timeout_s`` (aborted), an
exception from ``add_request`` or ``step`` (every active request fails with
it) — each becomes that case's outcome and the run goes on.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

from redknot.bench.suite import CaseEntry

MAX_IDLE_STEPS = 1000  # steps in a row without output while the engine says nothing is unfinished


@dataclass
class CaseJob:
    """One case to run: its manifest entry and prompt ids (``repeat`` tells repetitions of a case apart)."""
    entry: CaseEntry
    prompt_ids: List[int]
    repeat: str = ""


@dataclass
class CaseOutcome:
    """How one case ended: ``status`` is ok / error / timeout / oom; ``output`` is the engine's last output."""
    entry: CaseEntry
    status: str
    output: Any
    dp_rank: int
    error: Optional[str]
    peak_memory_bytes: Optional[int]


@dataclass
class _Active:
    job: CaseJob
    rank: int
    admitted_at: float


def _is_oom(message: str) -> bool:
    lowered = message.lower()
    return "out of memory" in lowered or "outofmemory" in lowered


def _peak_memory(llm) -> Optional[int]:
    """The engine's peak device memory; None where the device keeps no such counter (0 on CPU)."""
    stats = llm.stats()
    value = getattr(stats, "peak_memory_bytes", None)
    return int(value) if value else None


class Runner:
    """Runs case jobs through an ``LLM`` with per-rank admission caps (see the module docstring)."""

    def __init__(self, llm, params_for: Callable[[int], Any], admission_batch_size: int, dp_size: int = 1,
                 timeout_s: float = 3600.0, clock: Callable[[], float] = time.perf_counter):
        if admission_batch_size < 1:
            raise ValueError(f"suite.admission_batch_size={admission_batch_size}: must be >= 1")
        if dp_size < 1:
            raise ValueError(f"features.parallel.dp={dp_size}: must be >= 1")
        self.llm = llm
        self.params_for = params_for
        self.admission_batch_size = admission_batch_size
        self.dp_size = dp_size
        self.timeout_s = timeout_s
        self.clock = clock
        self._prefix = "case"

    def warmup(self, jobs: Sequence[CaseJob], max_tokens: int = 4) -> int:
        """Run ``jobs`` with short generations and discard them (kernels, caches, allocator warm)."""
        self._prefix = "warmup"
        done: List[CaseOutcome] = []
        try:
            self._loop(list(jobs), done.append, max_tokens)
        finally:
            self._prefix = "case"
        return len(done)

    def run(self, jobs: Sequence[CaseJob], on_outcome: Callable[[CaseOutcome], None],
            max_tokens: Optional[int] = None) -> None:
        """Run every job; ``on_outcome`` is called once per job as soon as it ends (``max_tokens``
        replaces each case's generation length, e.g. 1 for a TTFT-only repetition)."""
        self._loop(list(jobs), on_outcome, max_tokens)

    # ------------------------------------------------------------------ loop

    def _req_id(self, job: CaseJob) -> str:
        return f"{self._prefix}:{job.entry.case_id}{job.repeat}"

    def _free_rank(self, active: Dict[str, _Active]) -> Optional[int]:
        load = [0] * self.dp_size
        for item in active.values():
            load[item.rank] += 1
        rank = min(range(self.dp_size), key=lambda r: (load[r], r))
        return rank if load[rank] < self.admission_batch_size else None

    def _finish(self, active: Dict[str, _Active], req_id: str, status: str, output: Any, error: Optional[str],
                on_outcome: Callable[[CaseOutcome], None]) -> None:
        item = active.pop(req_id)
        on_outcome(CaseOutcome(item.job.entry, status, output, item.rank, error, _peak_memory(self.llm)))

    def _admit(self, pending: Deque[CaseJob], active: Dict[str, _Active], max_tokens: Optional[int],
               on_outcome: Callable[[CaseOutcome], None]) -> None:
        while pending:
            rank = self._free_rank(active)
            if rank is None:
                return
            job = pending.popleft()
            req_id = self._req_id(job)
            active[req_id] = _Active(job, rank, self.clock())
            try:
                params = self.params_for(max_tokens or job.entry.max_new_tokens)
                self.llm.add_request(req_id, job.prompt_ids, params)
            except Exception as err:  # a request the engine refuses fails alone
                message = f"{type(err).__name__}: {err}"
                self._finish(active, req_id, "oom" if _is_oom(message) else "error", None, message, on_outcome)

    def _fail_all(self, active: Dict[str, _Active], err: BaseException,
                  on_outcome: Callable[[CaseOutcome], None]) -> None:
        message = f"{type(err).__name__}: {err}"
        for req_id in list(active):
            try:
                self.llm.abort(req_id)
            except Exception:  # the engine is already failing; the outcome below is what matters
                pass
            self._finish(active, req_id, "oom" if _is_oom(message) else "error", None, message, on_outcome)

    def _expire(self, active: Dict[str, _Active], on_outcome: Callable[[CaseOutcome], None]) -> None:
        now = self.clock()
        for req_id, item in list(active.items()):
            if now - item.admitted_at > self.timeout_s:
                self.llm.abort(req_id)
                self._finish(active, req_id, "timeout", None,
                             f"no result after {self.timeout_s:.0f} s (suite.request_timeout_s)", on_outcome)

    def _collect(self, outputs: Sequence[Any], active: Dict[str, _Active],
                 on_outcome: Callable[[CaseOutcome], None]) -> int:
        finished = 0
        for out in outputs:
            if not out.finished or out.req_id not in active:
                continue
            finished += 1
            if out.finish_reason in ("stop", "length"):
                self._finish(active, out.req_id, "ok", out, None, on_outcome)
            else:
                message = out.error or f"finish_reason={out.finish_reason}"
                status = "oom" if _is_oom(message) else "error"
                self._finish(active, out.req_id, status, out, message, on_outcome)
        return finished

    def _loop(self, jobs: List[CaseJob], on_outcome: Callable[[CaseOutcome], None],
              max_tokens: Optional[int]) -> None:
        pending: Deque[CaseJob] = deque(jobs)
        active: Dict[str, _Active] = {}
        idle = 0
        while pending or active:
            self._admit(pending, active, max_tokens, on_outcome)
            if not active:
                continue
            try:
                outputs = self.llm.step()
            except Exception as err:
                self._fail_all(active, err, on_outcome)
                continue
            idle = 0 if self._collect(outputs, active, on_outcome) or outputs else idle + 1
            if idle >= MAX_IDLE_STEPS and not self.llm.has_unfinished_requests():
                self._fail_all(active, RuntimeError("the engine has no unfinished requests but never finished "
                                                    "these"), on_outcome)
            self._expire(active, on_outcome)
