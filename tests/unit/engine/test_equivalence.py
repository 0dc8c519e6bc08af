"""Greedy float32 equivalences: batched = alone, chunked prefill = whole prefill,
preempted-and-resumed = uninterrupted (same tokens; logits equal to fp32 rounding)."""
import random

import torch
from llm_testutil import run_all

from redknot.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _prompts(seed, n, lo=5, hi=70):
    rng = random.Random(seed)
    return {f"p{i}": [rng.randrange(3, 120000) for _ in range(rng.randrange(lo, hi))] for i in range(n)}


def _assert_same(ref, ref_logits, got, got_logits, atol=2e-4):
    for rid, out in ref.items():
        assert got[rid].token_ids == out.token_ids, rid
        for a, b in zip(ref_logits[rid], got_logits[rid]):
            torch.testing.assert_close(b, a, atol=atol, rtol=0)


def _alone(llm, prompts, params=GREEDY):
    outs, logits = {}, {}
    for rid, p in prompts.items():
        o, lg = run_all(llm, {rid: p}, params, record_logits=True)
        outs.update(o)
        logits.update(lg)
    return outs, logits


def test_batched_equals_alone(engines):
    llm = engines()
    prompts = _prompts(0, 6)
    alone, alone_logits = _alone(llm, prompts)
    batched, batched_logits = run_all(llm, prompts, GREEDY, record_logits=True)
    assert max(len(v) for v in batched_logits.values()) == 8
    _assert_same(alone, alone_logits, batched, batched_logits)
    for out in batched.values():
        assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_chunked_prefill_equals_whole_prefill(engines):
    prompt = {"long": _prompts(1, 1, lo=70, hi=71)["p0"]}
    whole, whole_logits = run_all(engines(budget=256, chunk=256), prompt, GREEDY, record_logits=True)
    for budget, chunk in [(3, 3), (7, 7), (16, 16), (40, 29)]:
        llm = engines(budget=budget, chunk=chunk)
        got, got_logits = run_all(llm, prompt, GREEDY, record_logits=True)
        assert llm.stats().num_steps >= 70 // chunk
        _assert_same(whole, whole_logits, got, got_logits)


def test_chunked_prefill_with_concurrent_decodes(engines):
    prompts = _prompts(2, 5, lo=30, hi=90)
    alone, alone_logits = _alone(engines(), prompts)
    got, got_logits = run_all(engines(budget=24, chunk=11), prompts, GREEDY, record_logits=True)
    _assert_same(alone, alone_logits, got, got_logits)


def test_preempted_and_resumed_equals_uninterrupted(engines):
    prompts = _prompts(3, 5, lo=20, hi=40)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref, ref_logits = run_all(engines(), prompts, params, record_logits=True)
    # 8 blocks of 16 tokens: five sequences growing to 44-64 tokens cannot all stay resident.
    llm = engines(num_cache_blocks=8, max_model_len=128)
    before = llm.stats().num_preemptions
    got, got_logits = run_all(llm, prompts, params, record_logits=True)
    assert llm.stats().num_preemptions > before
    assert sum(o.metrics.num_preemptions for o in got.values()) > 0
    _assert_same(ref, ref_logits, got, got_logits)


def test_preempted_seeded_sampling_equals_uninterrupted(engines):
    prompts = _prompts(4, 5, lo=20, hi=40)
    params = {rid: SamplingParams(max_tokens=24, temperature=1.0, seed=i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    ref, _ = run_all(engines(), prompts, params)
    got, _ = run_all(engines(num_cache_blocks=8, max_model_len=128), prompts, params)
    assert sum(o.metrics.num_preemptions for o in got.values()) > 0
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids
