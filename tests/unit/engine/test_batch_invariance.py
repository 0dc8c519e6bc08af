"""Batch-invariant mode: a needle request's logits are bitwise identical alone and at random
positions in batches of 8-32 random requests, under several prefill chunk sizes."""
import random

import torch
from llm_testutil import run_all

from redknot.engine import SamplingParams

NEEDLE = SamplingParams(max_tokens=5, ignore_eos=True)


def _random_batch(rng, size):
    prompts, params = {}, {}
    for i in range(size):
        rid = f"other{i}"
        prompts[rid] = [rng.randrange(3, 120000) for _ in range(rng.randrange(2, 45))]
        params[rid] = SamplingParams(max_tokens=rng.randrange(1, 8), temperature=rng.choice([0.0, 0.7]),
                                     seed=i, ignore_eos=True)
    return prompts, params


def test_needle_is_bitwise_invariant(engines):
    rng = random.Random(0)
    needle = [rng.randrange(3, 120000) for _ in range(37)]
    ref, ref_logits = run_all(engines(batch_invariant=True), {"needle": needle}, NEEDLE, record_logits=True)
    assert len(ref_logits["needle"]) == NEEDLE.max_tokens
    trials = [(8, 64, 16), (32, 48, 7), (16, 256, 64), (24, 40, 13)]  # batch size, step budget, prefill chunk
    for size, budget, chunk in trials:
        prompts, params = _random_batch(rng, size)
        order = list(prompts)
        order.insert(rng.randrange(size + 1), "needle")
        prompts["needle"], params["needle"] = needle, NEEDLE
        llm = engines(batch_invariant=True, budget=budget, chunk=chunk)
        got, got_logits = run_all(llm, {rid: prompts[rid] for rid in order}, params, record_logits=True)
        assert got["needle"].token_ids == ref["needle"].token_ids, (size, budget, chunk)
        for a, b in zip(ref_logits["needle"], got_logits["needle"], strict=True):
            assert torch.equal(a, b), f"needle logits differ in a batch of {size} (budget {budget}, chunk {chunk})"


def test_batch_invariant_engine_keeps_one_weight_stream_class(engines):
    """The V4.1 weight streams' small-row class (a second launch choice at 1-4 rows, which sums in another
    order than at 5+ rows) is off while a batch-invariant engine runs, and on while a plain one runs, whichever
    of two engines in one process was built last (the switch is process-wide: each engine applies its own)."""
    from redknot.kernels import tuning_cache
    invariant, plain = engines(batch_invariant=True), engines()  # either may be one an earlier test built
    prompt, params = {"r": [5, 17, 99, 3]}, SamplingParams(max_tokens=2, ignore_eos=True)
    for llm, small_rows in ((invariant, False), (plain, True), (invariant, False)):
        run_all(llm, prompt, params)
        assert tuning_cache.small_rows_class() is small_rows
