"""A test double for the ENGINE (``redknot.engine.LLM``'s public API), used to test the harness runner.

It is not a model: it answers each prompt with a text the test chooses (keyed by
the prompt ids), emits one token per step after a one-step prefill, and stamps
engine-side times from a virtual clock that advances by a fixed cost per
prefilled and per decoded token — so the TTFT the harness must report is known
in advance. It records which requests were active at every step, so tests can
check admission from the engine's side. It returns the engine's real output
types (``RequestOutput``, ``RequestMetrics``, ``EngineStats``).

Failure modes per ``req_id`` (``fail``): ``oom`` (finishes with an out-of-memory
error), ``error`` (finishes with an error), ``hang`` (never finishes),
``raise`` (``step()`` raises while it is active), and ``interrupt_after``
raises ``KeyboardInterrupt`` once that many requests have finished.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from redknot.engine.outputs import EngineStats, RequestMetrics, RequestOutput


def prompt_key(ids) -> str:
    return hashlib.sha256(",".join(str(int(i)) for i in ids).encode()).hexdigest()


@dataclass
class _Request:
    req_id: str
    prompt: List[int]
    params: object
    answer_ids: List[int]
    metrics: RequestMetrics
    emitted: List[int] = field(default_factory=list)


class FakeLLM:
    """Engine double (see the module docstring)."""

    PREFILL_S_PER_TOKEN = 1e-5
    DECODE_S_PER_TOKEN = 1e-3

    def __init__(self, tokenizer, respond: Callable[[List[int]], str], fail: Optional[Dict[str, str]] = None,
                 interrupt_after: Optional[int] = None):
        self.tokenizer = tokenizer
        self.respond = respond
        self.fail = dict(fail or {})
        self.interrupt_after = interrupt_after
        self.now = 1000.0
        self.requests: Dict[str, _Request] = {}
        self.active_log: List[List[str]] = []
        self.finished_count = 0
        self.aborted: List[str] = []
        self._stats = EngineStats()

    # ------------------------------------------------------------------ public engine API

    def add_request(self, req_id: str, prompt_token_ids, params) -> None:
        if req_id in self.requests:
            raise ValueError(f"request {req_id} already exists")
        prompt = [int(i) for i in prompt_token_ids]
        answer = self.tokenizer.encode(self.respond(prompt)).tolist()
        self.requests[req_id] = _Request(req_id, prompt, params, answer,
                                         RequestMetrics(arrival_time=self.now, num_prompt_tokens=len(prompt)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort(self, req_id: str) -> None:
        if self.requests.pop(req_id, None) is not None:
            self.aborted.append(req_id)

    def stats(self) -> EngineStats:
        return self._stats

    def step(self) -> List[RequestOutput]:
        if self.interrupt_after is not None and self.finished_count >= self.interrupt_after:
            raise KeyboardInterrupt
        self.active_log.append(sorted(self.requests))
        if any(self.fail.get(r) == "raise" for r in self.requests):
            raise RuntimeError("simulated engine failure in step()")
        start = self.now
        new = [r for r in self.requests.values() if r.metrics.scheduled_time is None]
        old = [r for r in self.requests.values() if r.metrics.scheduled_time is not None]
        self.now += sum(len(r.prompt) for r in new) * self.PREFILL_S_PER_TOKEN
        self.now += len(old) * self.DECODE_S_PER_TOKEN
        self._stats.num_steps += 1
        self._stats.peak_memory_bytes = max(self._stats.peak_memory_bytes,
                                            1000 * sum(len(r.prompt) for r in self.requests.values()))
        outputs = []
        for request in new + old:
            if request.metrics.scheduled_time is None:
                request.metrics.scheduled_time = start
            out = self._advance(request)
            if out is not None:
                outputs.append(out)
        return outputs

    def generate(self, prompts, params) -> List[RequestOutput]:
        for i, prompt in enumerate(prompts):
            self.add_request(f"gen-{i}", prompt, params)
        done = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    done[out.req_id] = out
        return [done[f"gen-{i}"] for i in range(len(prompts))]

    # ------------------------------------------------------------------ internals

    def _finish(self, request: _Request, reason: str, error: Optional[str] = None) -> RequestOutput:
        request.metrics.finish_time = self.now
        self.requests.pop(request.req_id)
        self.finished_count += 1
        return RequestOutput(request.req_id, request.prompt, list(request.emitted),
                             self.tokenizer.decode(request.emitted), True, reason, error, request.metrics)

    def _advance(self, request: _Request) -> Optional[RequestOutput]:
        mode = self.fail.get(request.req_id)
        if mode == "oom":
            return self._finish(request, "error", "CUDA out of memory. Tried to allocate 2.00 GiB")
        if mode == "error":
            return self._finish(request, "error", "simulated kernel error")
        if mode == "hang":
            return None
        max_tokens = request.params.max_tokens
        if len(request.emitted) < min(len(request.answer_ids), max_tokens):
            request.emitted.append(request.answer_ids[len(request.emitted)])
            request.metrics.num_output_tokens = len(request.emitted)
        if request.metrics.first_token_time is None:  # the first step's token (EOS for an empty answer)
            request.metrics.first_token_time = self.now
        if len(request.emitted) >= max_tokens:
            return self._finish(request, "length")
        if len(request.emitted) >= len(request.answer_ids):
            return self._finish(request, "stop")
        return RequestOutput(request.req_id, request.prompt, list(request.emitted),
                             self.tokenizer.decode(request.emitted), False, None, None, request.metrics)
