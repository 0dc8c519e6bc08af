"""A fake model for scheduler tests: its next token is a hash of the whole sequence.

It tracks what each request has fed, so feeding a position twice, skipping
one, or reusing another request's blocks fails loudly; outputs then depend on
the tokens alone, so batched / preempted / chunked runs must equal solo runs.
"""
from __future__ import annotations

import time
from typing import Dict, List

from redknot.cache import CacheSpec, StateCacheManager, cdiv
from redknot.config.schema import SchedulerConfig
from redknot.engine.messages import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput
from redknot.engine.request import Request, RequestTimes
from redknot.sample.params import SamplingParams
from redknot.engine.scheduler import Scheduler

EOS = 1
VOCAB = 97


def next_token(seq: List[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 1000003 + t + 7) % 2**61
    return (h * 2654435761 >> 7) % VOCAB


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.state: Dict[str, List[int]] = {}
        self.steps: List[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(out)
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self.state.pop(rid, None)
        used_blocks: set = set()
        slots = [sr.slot for sr in out.requests]
        assert len(set(slots)) == len(slots), "two requests share a slot"
        res = ModelRunnerOutput(step_id=out.step_id)
        for sr in out.requests:
            seq = self.state.setdefault(sr.req_id, [])
            assert sr.start_pos == len(seq), f"{sr.req_id}: fed from {sr.start_pos}, state holds {len(seq)}"
            assert PLACEHOLDER_TOKEN not in sr.token_ids, "placeholder not filled before launch"
            seq.extend(sr.token_ids)
            assert len(sr.block_table) >= cdiv(len(seq), self.block_size)
            assert not used_blocks & set(sr.block_table), "two requests share a block"
            used_blocks |= set(sr.block_table)
            if sr.num_logits:
                res.sampled_token_ids[sr.req_id] = self._verify(seq, sr.num_logits)
        res.finish_time = time.perf_counter()
        return res

    @staticmethod
    def _verify(seq: List[int], num_logits: int) -> List[int]:
        """Accept drafts while they equal the model's own next token; then the bonus token."""
        base = len(seq) - num_logits
        out = []
        for i in range(num_logits):
            tok = next_token(seq[:base + i + 1])
            out.append(tok)
            if i + 1 < num_logits and seq[base + i + 1] != tok:
                del seq[base + i + 1:]  # rejected drafts leave the fake state too
                break
        return out


def make_scheduler(num_blocks=64, block_size=8, max_num_seqs=8, budget=64, chunk=32, max_model_len=512):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, long_prefill_chunk=chunk,
                          block_size=block_size)
    cache = StateCacheManager(CacheSpec(block_size, 100, 100), num_slots=max_num_seqs, num_blocks=num_blocks)
    return Scheduler(cfg, cache, max_model_len=max_model_len, eos_token_id=EOS)


_SEQ = [0]


def make_request(rid: str, prompt: List[int], **params) -> Request:
    _SEQ[0] += 1
    return Request(req_id=rid, prompt_token_ids=list(prompt), params=SamplingParams(**params),
                   arrival_seq=_SEQ[0], times=RequestTimes(arrival=time.perf_counter()))


def solo_output(prompt: List[int], max_tokens: int, ignore_eos=False) -> List[int]:
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok == EOS and not ignore_eos:
            break
    return out


def fill_placeholders(out: SchedulerOutput, prev: ModelRunnerOutput) -> None:
    for sr in out.requests:
        if sr.token_ids and sr.token_ids[0] == PLACEHOLDER_TOKEN:
            sr.token_ids[0] = prev.sampled_token_ids[sr.req_id][-1]


def run(sched: Scheduler, runner: FakeRunner, async_mode=False, max_steps=10_000, on_step=None) -> int:
    """Drive scheduler + fake runner to completion; checks invariants after every step."""
    prev = None
    steps = 0
    while sched.has_unfinished_requests() or prev is not None:
        out = sched.schedule()
        if on_step:
            on_step(out)
        if prev is not None and async_mode:
            fill_placeholders(out, prev[1])
        res = runner.execute(out)
        if async_mode:
            if prev is not None:
                sched.update_from_output(*prev)
            prev = (out, res) if not out.is_empty else None
        else:
            sched.update_from_output(out, res)
        sched.check_invariants()
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    sched.cache.assert_empty()
    return steps
