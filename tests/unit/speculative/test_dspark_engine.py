"""DSpark inside the engine: seeded sampling stays reproducible and accepts drafts, requests with a
grammar are never drafted, the counters reach EngineStats and RequestMetrics, the step runs
synchronously, and a random-weight model's hopeless drafts are not verified."""
import copy
import random
import json
import re

from spec_testutil import MAX_DRAFT, run_all

from redknot.engine import SamplingParams


def _prompts(seed, n, lo=5, hi=40):
    rng = random.Random(seed)
    return {f"s{seed}-{i}": [rng.randrange(3, 4096) for _ in range(rng.randrange(lo, hi))] for i in range(n)}


def test_seeded_sampling_is_reproducible_and_accepts_drafts(engines):
    on = engines()
    prompts = _prompts(0, 4)
    params = {rid: SamplingParams(max_tokens=20, temperature=0.6, top_p=0.95, seed=10 + i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    first = run_all(on, prompts, params)
    again = run_all(on, prompts, params)
    alone = {rid: run_all(on, {rid: p}, params)[rid] for rid, p in list(prompts.items())[:2]}
    for rid in prompts:
        assert first[rid].token_ids == again[rid].token_ids
    for rid in alone:
        assert alone[rid].token_ids == first[rid].token_ids  # independent of the batch
    assert sum(o.metrics.num_draft_accepted for o in first.values()) > 0
    reseeded = run_all(on, prompts, {rid: SamplingParams(max_tokens=20, temperature=0.6, top_p=0.95,
                                                         seed=99 + i, ignore_eos=True)
                                     for i, rid in enumerate(prompts)})
    assert any(reseeded[rid].token_ids != first[rid].token_ids for rid in prompts)


def test_grammar_requests_are_never_drafted(engines):
    on = engines()
    prompts = _prompts(1, 3)
    rids = list(prompts)
    pattern = r"[0-9]{2,4}(, [0-9]{2,4}){2}"
    params = {rid: SamplingParams(max_tokens=20, ignore_eos=True) for rid in rids}
    params[rids[0]] = SamplingParams(max_tokens=20, structured_output={"schema_type": "regex", "schema": pattern})
    outs = run_all(on, prompts, params)
    assert outs[rids[0]].metrics.num_draft_proposed == 0
    assert re.fullmatch(pattern, outs[rids[0]].text)
    assert sum(outs[r].metrics.num_draft_accepted for r in rids[1:]) > 0


def test_counters_reach_engine_stats_and_request_metrics(engines):
    on = engines(adaptive=False)  # verify every draft: all positions get counted
    before = copy.deepcopy(on.stats())
    outs = run_all(on, _prompts(2, 3), SamplingParams(max_tokens=16, ignore_eos=True))
    after = copy.deepcopy(on.stats())
    spec, prev = after.spec, before.spec
    proposed = sum(o.metrics.num_draft_proposed for o in outs.values())
    accepted = sum(o.metrics.num_draft_accepted for o in outs.values())
    assert spec.num_proposed - prev.num_proposed == proposed > 0
    assert spec.num_accepted - prev.num_accepted == accepted > 0
    assert after.num_draft_proposed - before.num_draft_proposed == proposed
    assert after.num_draft_accepted - before.num_draft_accepted == accepted
    per_position = [a - b for a, b in zip(spec.verified_per_position, prev.verified_per_position)]
    assert sum(per_position) == proposed and per_position[MAX_DRAFT - 1] > 0
    decode_tokens = spec.num_decode_tokens - prev.num_decode_tokens
    assert decode_tokens == sum(len(o.token_ids) - 1 for o in outs.values())
    metrics = spec.as_metrics()
    assert metrics["spec.mean_accept_len"] > 1.0 and metrics["spec.draft_ms_per_step"] > 0
    assert metrics["spec.verify_step_ms"] > 0 and f"spec.acceptance.pos{MAX_DRAFT}" in metrics
    assert on.stats().spec is not on.runner.speculator.stats  # a snapshot


def test_drafting_runs_steps_synchronously(engines):
    from spec_testutil import features
    f = features()
    assert f.async_scheduling is False
    on = engines()
    assert on._core._executor is None


def test_random_weights_draft_but_verify_almost_nothing(engines, tmp_path):
    """With random weights the MTP's confidences are tiny: confidence scheduling with a cost table
    verifies no drafts (each step is a plain step plus the drafter's work); fixed-length
    verification still verifies max_draft drafts, which are rejected."""
    costs = tmp_path / "costs.json"
    # Verify cost proportional to the tokens (compute-bound): a draft pays only if it nearly surely survives.
    costs.write_text(json.dumps({"verify_ms": {str(n): 10.0 * n for n in range(1, 33)},
                                 "draft_ms": {"1": 0.5, "8": 0.6}}))
    prompts = _prompts(3, 2)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    varlen = engines(agree=False, adaptive=True, budget_source="file", budget_file=str(costs))
    outs = run_all(varlen, prompts, params)
    # Until confidences two steps old exist the budget assumes survival 1 (staleness 2); after
    # that, the tiny survivals make every further draft cost more than it returns.
    spec = varlen.stats().spec
    assert spec.num_budget_steps > 2 and spec.num_drafted > 0
    assert sum(o.metrics.num_draft_proposed for o in outs.values()) <= 2 * len(prompts) * MAX_DRAFT
    assert spec.budget_total <= 2 * len(prompts) * MAX_DRAFT
    fixed = engines(agree=False, adaptive=False)
    ref = run_all(engines(agree=False, dspark=False), prompts, params)
    outs = run_all(fixed, prompts, params)
    assert all(outs[r].token_ids == ref[r].token_ids for r in prompts)
    assert sum(o.metrics.num_draft_proposed for o in outs.values()) > 0
