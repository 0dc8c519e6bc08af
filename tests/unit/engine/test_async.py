"""Asynchronous scheduling (step N+1 prepared while step N runs) gives the same outputs as
synchronous stepping over a mixed workload: EOS, stop strings, max_tokens, structured requests."""
import random

import pytest
from llm_testutil import run_all

from redknot.engine import SamplingParams

EOS = 1


def eos_after(n):
    """Make EOS the most likely token once the request has n outputs (a real EOS stop)."""
    def proc(outputs, logits):
        if len(outputs) >= n:
            logits = logits.clone()
            logits[EOS] = logits.max() + 10.0
        return logits
    return proc


def _workload(llm, rng):
    prompts, params = {}, {}
    for i in range(10):
        prompts[f"r{i}"] = [rng.randrange(3, 120000) for _ in range(rng.randrange(3, 50))]
        kind = i % 5
        if kind == 0:
            params[f"r{i}"] = SamplingParams(max_tokens=rng.randrange(1, 12))
        elif kind == 1:
            params[f"r{i}"] = SamplingParams(max_tokens=20, logits_processors=[eos_after(rng.randrange(0, 6))])
        elif kind == 2:
            params[f"r{i}"] = SamplingParams(max_tokens=15, temperature=0.9, top_p=0.9, seed=i)
        elif kind == 3:
            params[f"r{i}"] = SamplingParams(max_tokens=30, structured_output={
                "schema_type": "regex", "schema": r"(ok|no) [0-9]{1,3}"} if i % 2 else {
                "schema_type": "json", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                  "required": ["n"], "additionalProperties": False}})
        else:
            params[f"r{i}"] = SamplingParams(max_tokens=16)
    return prompts, params


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_async_on_off_identical(engines, batch_invariant):
    rng = random.Random(5)
    sync_llm = engines(batch_invariant=batch_invariant, budget=48, chunk=16)
    async_llm = engines(async_scheduling=True, batch_invariant=batch_invariant, budget=48, chunk=16)
    prompts, params = _workload(sync_llm, rng)
    ref, _ = run_all(sync_llm, prompts, params)
    # Stop strings cut from the synchronous texts, so that they really occur.
    for rid in ("r4", "r9"):
        if rid in ref and len(ref[rid].text) > 6:
            params[rid] = SamplingParams(max_tokens=16, stop=[ref[rid].text[3:6]])
    ref, _ = run_all(sync_llm, prompts, params)
    got, _ = run_all(async_llm, prompts, params)
    reasons = {o.finish_reason for o in ref.values()}
    assert {"stop", "length"} <= reasons
    assert any(o.token_ids and o.token_ids[-1] == EOS for o in ref.values())
    assert any(params[r].stop and ref[r].finish_reason == "stop" for r in ref)
    for rid in prompts:
        a, b = ref[rid], got[rid]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), rid


def test_async_with_preemption_and_abort(engines):
    rng = random.Random(6)
    prompts = {f"p{i}": [rng.randrange(3, 120000) for _ in range(rng.randrange(20, 40))] for i in range(5)}
    params = {rid: SamplingParams(max_tokens=24, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    ref, _ = run_all(engines(num_cache_blocks=8, max_model_len=128), prompts, params)
    llm = engines(async_scheduling=True, num_cache_blocks=8, max_model_len=128)
    got, _ = run_all(llm, prompts, params)
    assert sum(o.metrics.num_preemptions for o in got.values()) > 0
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids, rid
    llm.add_request("gone", [3, 4, 5], SamplingParams(max_tokens=40, ignore_eos=True))
    llm.add_request("stays", [3, 4, 6], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):
        llm.step()
    llm.abort("gone")  # while its next step is in flight
    finals = {}
    while llm.has_unfinished_requests():
        finals.update({o.req_id: o for o in llm.step() if o.finished})
    assert finals["gone"].finish_reason == "abort" and 1 <= len(finals["gone"].token_ids) <= 3
    assert finals["stays"].finish_reason == "length" and len(finals["stays"].token_ids) == 6
