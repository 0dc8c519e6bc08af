"""Scheduler with a fake model: budget, chunking, fairness, preemption, rollback, no leaks."""
import random

import pytest
from sched_helpers import EOS, FakeRunner, make_request, make_scheduler, run, solo_output

from redknot.engine.request import FinishReason


def _workload(rng, n, max_prompt=90, max_tokens=30):
    return [(f"r{i}", [rng.randrange(2, 97) for _ in range(rng.randrange(1, max_prompt))],
             rng.randrange(1, max_tokens)) for i in range(n)]


def _submit(sched, work, ignore_eos=False):
    reqs = {}
    for rid, prompt, mt in work:
        reqs[rid] = make_request(rid, prompt, max_tokens=mt, ignore_eos=ignore_eos)
        sched.add_request(reqs[rid])
    return reqs


def _check_outputs(reqs, work, ignore_eos=False):
    for rid, prompt, mt in work:
        assert reqs[rid].output_token_ids == solo_output(prompt, mt, ignore_eos), rid
        expected = FinishReason.STOP if reqs[rid].output_token_ids[-1] == EOS and not ignore_eos \
            else FinishReason.LENGTH
        assert reqs[rid].finish_reason is expected


@pytest.mark.parametrize("async_mode", [False, True])
def test_budget_seqs_and_chunk_limits_hold(async_mode):
    rng = random.Random(1)
    sched = make_scheduler(num_blocks=200, budget=40, chunk=16, max_num_seqs=5)
    work = _workload(rng, 25)
    reqs = _submit(sched, work)
    runner = FakeRunner(block_size=8)

    def check(out):
        assert out.num_batched_tokens <= 40
        assert len(out.requests) <= 5
        for sr in out.requests:
            assert sr.num_tokens <= 16

    run(sched, runner, async_mode=async_mode, on_step=check)
    _check_outputs(reqs, work)


def test_long_prefill_is_chunked_while_decodes_continue():
    sched = make_scheduler(num_blocks=200, budget=24, chunk=16)
    short = make_request("short", [5, 6, 7], max_tokens=40, ignore_eos=True)
    sched.add_request(short)
    runner = FakeRunner(block_size=8)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    long = make_request("long", list(range(2, 98)) + list(range(2, 50)), max_tokens=3)
    sched.add_request(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        by_id = {sr.req_id: sr for sr in out.requests}
        assert by_id["short"].num_tokens == 1  # the decode keeps going every step
        chunks.append(by_id["long"].num_tokens)
        sched.update_from_output(out, runner.execute(out))
    assert len(chunks) > 1 and max(chunks) <= 16 and sum(chunks) == long.num_prompt_tokens
    run(sched, runner)
    assert long.output_token_ids == solo_output(long.prompt_token_ids, 3)
    assert short.output_token_ids == solo_output([5, 6, 7], 40, ignore_eos=True)


def test_fcfs_admission_and_no_starvation_under_pressure():
    rng = random.Random(2)
    sched = make_scheduler(num_blocks=40, budget=32, chunk=32, max_num_seqs=3)
    big = make_request("big", [rng.randrange(2, 97) for _ in range(150)], max_tokens=20, ignore_eos=True)
    sched.add_request(big)
    work = _workload(rng, 30, max_prompt=20, max_tokens=10)
    reqs = _submit(sched, work)
    admitted = []
    runner = FakeRunner(block_size=8)

    def record(out):
        for sr in out.requests:
            if sr.start_pos == 0 and sr.req_id not in admitted:
                admitted.append(sr.req_id)

    run(sched, runner, on_step=record)
    assert admitted == ["big"] + [w[0] for w in work]  # first admission in arrival order
    assert big.output_token_ids == solo_output(big.prompt_token_ids, 20, ignore_eos=True)
    _check_outputs(reqs, work)


@pytest.mark.parametrize("async_mode", [False, True])
def test_preemption_frees_and_resumed_equals_uninterrupted(async_mode):
    rng = random.Random(3)
    # 12 blocks of 8 tokens = 96 tokens for 6 requests that each grow to ~60 tokens.
    sched = make_scheduler(num_blocks=12, budget=64, chunk=32, max_num_seqs=6, max_model_len=96)
    work = [(f"r{i}", [rng.randrange(2, 97) for _ in range(rng.randrange(10, 30))], 30) for i in range(6)]
    reqs = _submit(sched, work, ignore_eos=True)
    preempted = []
    runner = FakeRunner(block_size=8)
    run(sched, runner, async_mode=async_mode, on_step=lambda out: preempted.extend(out.preempted_req_ids))
    assert preempted, "workload was meant to force preemption"
    assert sum(r.num_preemptions for r in reqs.values()) == len(preempted)
    _check_outputs(reqs, work, ignore_eos=True)


def test_preempted_request_frees_everything_at_once():
    sched = make_scheduler(num_blocks=4, budget=64, chunk=64, max_num_seqs=2, max_model_len=32)
    a = make_request("a", list(range(2, 18)), max_tokens=10, ignore_eos=True)
    b = make_request("b", list(range(2, 18)), max_tokens=10, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    runner = FakeRunner(block_size=8)
    out = sched.schedule()
    assert [sr.req_id for sr in out.requests] == ["a", "b"] and sched.cache.num_free_blocks == 0
    sched.update_from_output(out, runner.execute(out))
    out = sched.schedule()  # a needs a third block: b (the later arrival) is preempted
    assert out.preempted_req_ids == ["b"] and [sr.req_id for sr in out.requests] == ["a"]
    assert not sched.cache.has("b") and b.num_computed_tokens == 0 and b.output_token_ids
    sched.check_invariants()
    sched.update_from_output(out, runner.execute(out))
    run(sched, runner)
    assert b.output_token_ids == solo_output(b.prompt_token_ids, 10, ignore_eos=True)


def test_abort_and_stop_tokens_free_state():
    sched = make_scheduler()
    a = make_request("a", [3, 4, 5], max_tokens=50, ignore_eos=True)
    b = make_request("b", [3, 4, 5], max_tokens=50, ignore_eos=True)
    stop_tok = solo_output([3, 4, 6], 3, ignore_eos=True)[2]
    c = make_request("c", [3, 4, 6], max_tokens=50, stop_token_ids=[stop_tok], ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    runner = FakeRunner(block_size=8)
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    assert sched.finish_request("a", FinishReason.ABORT) is a
    assert sched.finish_request("a", FinishReason.ABORT) is None
    assert a.finish_reason is FinishReason.ABORT and not sched.cache.has("a")
    assert c.finish_reason is FinishReason.STOP and c.output_token_ids[-1] == stop_tok
    out = sched.schedule()
    assert "a" in out.finished_req_ids and "c" in out.finished_req_ids
    sched.update_from_output(out, runner.execute(out))
    sched.finish_request("b", FinishReason.ABORT)
    run(sched, runner)


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=20)
    r = make_request("r", list(range(2, 17)), max_tokens=100, ignore_eos=True)
    sched.add_request(r)
    run(sched, FakeRunner(block_size=8))
    assert r.num_tokens == 20 and r.finish_reason is FinishReason.LENGTH
    with pytest.raises(ValueError, match="max_position=20"):
        sched.add_request(make_request("x", list(range(20)), max_tokens=1))
    with pytest.raises(ValueError, match="already in the engine"):
        s2 = make_scheduler()
        s2.add_request(make_request("dup", [2], max_tokens=1))
        s2.add_request(make_request("dup", [2], max_tokens=1))


@pytest.mark.parametrize("num_correct", [0, 1, 3])
def test_verify_step_rolls_back_rejected_drafts(num_correct):
    sched = make_scheduler(num_blocks=64, block_size=4)
    prompt = [5, 9, 13, 2, 8, 8, 3]
    r = make_request("r", prompt, max_tokens=40, ignore_eos=True)
    sched.add_request(r)
    runner = FakeRunner(block_size=4)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    expected = solo_output(prompt, 40, ignore_eos=True)
    drafts = expected[1:1 + num_correct] + [(expected[1 + num_correct] + 1) % 97] * (4 - num_correct)
    r.draft_token_ids = list(drafts)
    out = sched.schedule()
    (sr,) = out.requests
    assert sr.num_tokens == 5 and sr.num_logits == 5 and sr.draft_token_ids == drafts
    assert sched.cache.num_tokens("r") == len(prompt) + 1 + 4
    sched.update_from_output(out, runner.execute(out))
    assert r.output_token_ids == expected[:2 + num_correct]
    assert r.num_computed_tokens == r.num_tokens - 1  # the bonus token is fed next step
    assert sched.cache.num_tokens("r") == r.num_computed_tokens
    assert (r.num_draft_proposed, r.num_draft_accepted) == (4, num_correct)
    sched.check_invariants()
    run(sched, runner)
    assert r.output_token_ids == expected


def test_invalid_scheduler_config_names_field():
    with pytest.raises(ValueError, match="max_num_batched_tokens=0"):
        make_scheduler(budget=0)
