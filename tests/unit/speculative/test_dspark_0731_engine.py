"""DSpark (V4-0731 draft stages) through the engine: greedy output equals plain decoding token for
token (single requests, mixed batches, chunked prefill, rings that wrap, stop conditions inside a
block; fixed and confidence-scheduled verify lengths); sampled output follows the target at
temperature 1 (chi-square, token-wise and block verification, probabilistic drafts); forced
rollbacks leave the target state and the stages' rings bit-identical to a run that verified
nothing; counters reach the stats."""
import itertools
import random

import pytest
import torch
from spec_testutil import DSPARK_VOCAB, MAX_DRAFT, BlockSpy, live_state, lockstep, record_logits, run_all

from redknot.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
P_MIN = 1e-3


def _prompts(seed, n, lo=3, hi=40):
    rng = random.Random(seed)
    return {f"d{seed}-{i}": [rng.randrange(2, DSPARK_VOCAB - 1) for _ in range(rng.randrange(lo, hi))]
            for i in range(n)}


def _same(ref, got):
    for rid, out in ref.items():
        assert got[rid].token_ids == out.token_ids, rid
        assert got[rid].finish_reason == out.finish_reason, rid


def _accepted(outs):
    return sum(o.metrics.num_draft_accepted for o in outs.values())


def _proposed(outs):
    return sum(o.metrics.num_draft_proposed for o in outs.values())


def test_the_engine_drafts_with_the_dspark_stages(engines):
    on = engines(arch="dspark")
    assert type(on.runner.speculator.drafter).__name__ == "DSparkDrafter"
    with pytest.raises(ValueError, match="method=mtp but the checkpoint has no MTP layer"):
        engines(arch="dspark", method="mtp")


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_single_requests_and_mixed_batches_equal_plain_decoding(engines, adaptive):
    off, on = engines(arch="dspark", dspark=False), engines(arch="dspark", adaptive=adaptive)
    single = _prompts(0, 2)
    for rid, prompt in single.items():
        ref, ref_lg = record_logits(off, {rid: prompt}, GREEDY)
        got, got_lg = record_logits(on, {rid: prompt}, GREEDY)
        _same(ref, got)
        n = len(ref[rid].token_ids)
        torch.testing.assert_close(got_lg[rid][:n], ref_lg[rid][:n], atol=2e-4, rtol=0)
        assert got[rid].metrics.num_draft_accepted > 0
    batch = _prompts(1, 6, lo=2, hi=60)  # several prompts longer than the window (16): rings wrap
    ref, got = run_all(off, batch, GREEDY), run_all(on, batch, GREEDY)
    _same(ref, got)
    assert 0 < _accepted(got) < _proposed(got)  # partly accepted blocks


def test_chunked_prefill_equals_plain_decoding(engines):
    prompts = _prompts(2, 3, lo=30, hi=70)
    ref = run_all(engines(arch="dspark", dspark=False), prompts, GREEDY)
    for budget, chunk in [(7, 7), (24, 11)]:
        got = run_all(engines(arch="dspark", budget=budget, chunk=chunk), prompts, GREEDY)
        _same(ref, got)
        assert _accepted(got) > 0


def test_stop_conditions_inside_a_block(engines):
    off, on = engines(arch="dspark", dspark=False), engines(arch="dspark")
    prompt = {"stop": _prompts(3, 1, lo=10, hi=11)["d3-0"]}
    full = run_all(off, prompt, GREEDY)["stop"].token_ids
    spy = BlockSpy(on)
    try:
        run_all(on, prompt, GREEDY)
    finally:
        spy.close()
    # an output index that the DSpark run emitted in the middle of an accepted block
    pos, index = 1, None
    for block in spy.blocks["stop"]:
        if len(block) >= 3 and index is None:
            index = pos + 1
        pos += len(block)
    assert index is not None and index < len(full) - 1
    stop_token = full[index]
    first = full.index(stop_token)
    cases = {"eos-like stop token": SamplingParams(max_tokens=20, stop_token_ids=[stop_token], ignore_eos=True),
             "max_tokens": SamplingParams(max_tokens=index + 1, ignore_eos=True)}
    for name, params in cases.items():
        ref, got = run_all(off, prompt, params), run_all(on, prompt, params)
        _same(ref, got)
        expected = full[:first + 1] if "stop" in name else full[:index + 1]
        assert got["stop"].token_ids == expected, name


def _pooled_chi2(counts, probs):
    """Upper tail of Pearson's statistic, cells with expected count < 5 pooled."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "tokens outside the target's support"
    expected = n * probs
    big = expected >= 5
    obs = torch.cat([counts[big], counts[support & ~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[support & ~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("verification", ["token", "block"])
def test_sampled_tokens_follow_the_target_at_temperature_one(engines, verification):
    """Seeded requests of one prompt; the 2nd and 3rd emitted tokens (verified drafts, residual or
    bonus) against the target's distribution given the most common preceding tokens."""
    on = engines(arch="dspark", verification=verification, draft_sampling="probabilistic", max_num_seqs=32,
                 budget=512)
    off = engines(arch="dspark", dspark=False)
    prompt = [5, 17, 33, 8, 21, 40, 12]
    n = 360
    params = {f"c{i}": SamplingParams(max_tokens=3, temperature=1.0, seed=1000 + i, ignore_eos=True) for i in range(n)}
    outs = run_all(on, {rid: prompt for rid in params}, params)
    assert _accepted(outs) > n // 4  # drafts were verified and often kept
    seqs = [outs[r].token_ids for r in params]
    first = max(set(s[0] for s in seqs), key=lambda t: sum(s[0] == t for s in seqs))
    second = max(set(s[1] for s in seqs if s[0] == first), key=lambda t: sum(s[:2] == [first, t] for s in seqs))
    for ctx, pick in (([first], lambda s: s[1] if s[0] == first else None),
                      ([first, second], lambda s: s[2] if s[:2] == [first, second] else None)):
        _, lg = record_logits(off, {"ref": prompt + ctx}, SamplingParams(max_tokens=1))
        probs = torch.softmax(lg["ref"][0].double(), dim=-1)
        counts = torch.zeros(DSPARK_VOCAB, dtype=torch.float64)
        for s in seqs:
            tok = pick(s)
            if tok is not None:
                counts[tok] += 1
        assert counts.sum() >= 60
        pvalue = _pooled_chi2(counts, probs)
        print(f"chi2 {verification} ctx={ctx} n={int(counts.sum())} p={pvalue:.4f}")
        assert pvalue > P_MIN, (ctx, verification)


def _ring_rows(llm, rid):
    """The DSpark rings' rows a later block can read: positions length-W .. length-1 of the request."""
    drafter = llm.runner.speculator.drafter
    slot = llm.scheduler.cache.slot(rid)
    length = llm.scheduler.requests[rid].num_computed_tokens
    pos = torch.arange(max(0, length - drafter.draft.window), length)
    return [ring[slot, pos % drafter.draft.window].clone() for ring in drafter.rings]


def test_forced_rollbacks_leave_state_and_rings_of_a_run_that_verified_nothing(engines):
    spec = engines(arch="dspark", batch_invariant=True, tag="spec")
    ref = engines(arch="dspark", batch_invariant=True, tag="plain")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = _prompts(4, 1, lo=25, hi=26)["d4-0"]
    ref.runner.speculator.draft_hook = lambda rid, pos, drafts: []  # drafter runs, nothing is verified
    full = run_all(ref, {"full": prompt}, params)["full"].token_ids
    pattern = itertools.cycle([0, 3, 1, 4, 2, 0, 4])

    def hook(rid, first_pos, drafts):
        a, i = next(pattern), first_pos - len(prompt)
        if i + a >= len(full):
            return full[i:i + MAX_DRAFT]
        return full[i:i + a] + [(full[i + a] + 1) % DSPARK_VOCAB] * (MAX_DRAFT - a)
    spec.runner.speculator.draft_hook = hook
    spec.add_request("r", prompt, params)
    ref.add_request("r", prompt, params)
    checked = 0
    for length in lockstep(spec, ref, "r"):
        got, want = live_state(spec, "r"), live_state(ref, "r")
        for name in want:
            assert torch.equal(got[name], want[name]), (length, name)
        for a, b in zip(_ring_rows(spec, "r"), _ring_rows(ref, "r")):
            assert torch.equal(a, b), length
        checked += 1
    assert checked >= 5 and spec.stats().spec.num_accepted > 0


def test_counters_reach_the_stats(engines):
    on = engines(arch="dspark", adaptive=True)
    run_all(on, _prompts(5, 3), GREEDY)
    m = on.stats().spec.as_metrics()
    assert m["spec.mean_accept_len"] > 1.0 and m["spec.verified_tokens_per_step"] > 0
    assert m["spec.draft_ms_per_step"] > 0 and m["spec.schedule_ms_per_step"] > 0 and m["spec.verify_ms_per_step"] > 0
    for j in range(1, MAX_DRAFT + 1):
        assert 0.0 <= m[f"spec.expected_survival.pos{j}"] <= 1.0
        assert 0.0 <= m[f"spec.realised_survival.pos{j}"] <= 1.0
    assert m["spec.expected_survival.pos1"] > 0 and m["spec.budget_mean"] > 0


def test_profiled_budget_at_start_and_greedy_still_equal(engines):
    on = engines(arch="dspark", adaptive=True, budget_source="profile")
    costs = on.runner.speculator.scheduler.costs
    assert costs is not None and costs.verify.sizes[0] == 1 and all(c > 0 for c in costs.verify.costs)
    assert costs.verify.costs == sorted(costs.verify.costs) and costs.draft(1) > 0
    prompts = _prompts(6, 3)
    _same(run_all(engines(arch="dspark", dspark=False), prompts, GREEDY), run_all(on, prompts, GREEDY))


def test_sts_temperatures_and_block_size_limits(engines, tmp_path):
    from redknot.speculative.dspark_drafter import load_sts
    path = tmp_path / "sts.json"
    path.write_text('{"sts_temperatures": [1.0, 1.5, 2.0, 2.5, 3.0]}')
    assert load_sts(str(path), 5) == [1.0, 1.5, 2.0, 2.5, 3.0] and load_sts(None, 5) == [1.0] * 5
    path.write_text('{"temperatures": [1.0, 2.0]}')
    with pytest.raises(ValueError, match="sts_path=.*needs 5 positive temperatures"):
        load_sts(str(path), 5)
    path.write_text('{"temperatures": [1.0, 2.0, 1.0, 1.0, 1.0]}')
    hot = engines(arch="dspark", adaptive=True, sts_path=str(path))
    cold = engines(arch="dspark", adaptive=True)
    prompt = _prompts(7, 1)["d7-0"]

    def first_confidences(llm):
        llm.add_request("x", prompt, GREEDY)
        while not llm.runner.speculator.last_drafts:
            llm.step()
        conf = list(llm.runner.speculator.last_drafts["x"].confidences)
        while llm.has_unfinished_requests():
            llm.step()
        return conf
    c_hot, c_cold = first_confidences(hot), first_confidences(cold)
    # sigmoid(z / 2) lies between sigmoid(z) and 1/2; temperature 1 leaves the others
    assert c_hot[0] == pytest.approx(c_cold[0]) and abs(c_hot[1] - 0.5) <= abs(c_cold[1] - 0.5) + 1e-6
    with pytest.raises(ValueError, match="max_draft=6 exceeds the checkpoint's dspark_block_size=5"):
        engines(arch="dspark", max_draft=6, keep_tokens=40)


def test_compact_replay_is_refused_when_it_would_skip_a_tapped_layer(engines):
    with pytest.raises(ValueError, match="features.swa_replay.mode=compact skips early rows of window-only top"):
        engines(arch="dspark_tail", compact=True, keep_tokens=40)
    prompts = _prompts(8, 2, lo=20, hi=40)
    _same(run_all(engines(arch="dspark_tail", dspark=False), prompts, GREEDY),
          run_all(engines(arch="dspark_tail"), prompts, GREEDY))
