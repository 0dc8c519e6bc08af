"""Greedy decoding with DSpark equals decoding without it, token for token (and logits at every
emitted position to fp32 rounding): single requests, mixed-length batches, chunked prefill,
fixed-length verification, EOS / stop strings inside an accepted block, max_tokens mid-block."""
import random

import pytest
import torch
from spec_testutil import MAX_DRAFT, BlockSpy, record_logits, run_all

from redknot.engine import SamplingParams

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _prompts(seed, n, lo=3, hi=60):
    rng = random.Random(seed)
    return {f"r{seed}-{i}": [rng.randrange(3, 4096) for _ in range(rng.randrange(lo, hi))] for i in range(n)}


def _compare(ref, ref_logits, got, got_logits, atol=2e-4):
    for rid, out in ref.items():
        assert got[rid].token_ids == out.token_ids, rid
        assert got[rid].finish_reason == out.finish_reason, rid
        n = len(out.token_ids)
        torch.testing.assert_close(got_logits[rid][:n], ref_logits[rid][:n], atol=atol, rtol=0)


def _accepted(outs):
    return sum(o.metrics.num_draft_accepted for o in outs.values())


def test_single_requests_equal_plain_decoding(engines):
    off, on = engines(dspark=False), engines()
    for rid, prompt in _prompts(0, 3).items():
        ref, ref_lg = record_logits(off, {rid: prompt}, GREEDY)
        got, got_lg = record_logits(on, {rid: prompt}, GREEDY)
        _compare(ref, ref_lg, got, got_lg)
        assert got[rid].metrics.num_draft_accepted > 0, "the test model's drafts should be accepted"
    stats = on.stats().spec
    assert stats.num_verify_steps > 0 and 0 < stats.acceptance_rate <= 1


@pytest.mark.parametrize("varlen", [True, False])
def test_mixed_length_batch_equals_plain_decoding(engines, varlen):
    prompts = _prompts(1, 6, lo=2, hi=70)
    ref, ref_lg = record_logits(engines(dspark=False), prompts, GREEDY)
    on = engines(adaptive=varlen)
    before = on.stats().spec
    got, got_lg = record_logits(on, prompts, GREEDY)
    _compare(ref, ref_lg, got, got_lg)
    after = on.stats().spec
    assert _accepted(got) > 0
    proposed = after.num_proposed - before.num_proposed
    assert proposed == sum(o.metrics.num_draft_proposed for o in got.values())
    if not varlen:  # fixed length: every verify step feeds max_draft drafts unless max_tokens caps it
        verified = [v - b for v, b in zip(after.verified_per_position, before.verified_per_position)]
        assert verified[0] > 0 and verified[-1] >= verified[0] - len(prompts) * MAX_DRAFT


def test_varlen_verifies_different_lengths_in_one_step(engines):
    """Requests of one step verify different numbers of drafts in one target forward."""
    on = engines(adaptive=True)
    lengths = []
    real = on.runner.execute

    def spy(batch):
        counts = sorted({len(sr.draft_token_ids) for sr in batch.inputs.sched.requests if sr.num_logits})
        lengths.append(counts)
        return real(batch)
    on.runner.execute = spy
    try:
        run_all(on, _prompts(2, 6, lo=5, hi=30), GREEDY)
    finally:
        del on.runner.execute
    assert any(len(c) > 1 and c[-1] > 0 for c in lengths), lengths


def test_chunked_prefill_equals_plain_decoding(engines):
    prompts = _prompts(3, 3, lo=30, hi=70)
    ref, ref_lg = record_logits(engines(dspark=False), prompts, GREEDY)
    for budget, chunk in [(7, 7), (24, 11)]:
        got, got_lg = record_logits(engines(budget=budget, chunk=chunk), prompts, GREEDY)
        _compare(ref, ref_lg, got, got_lg)
        assert _accepted(got) > 0


def _block_position(spy, rid, index):
    """(step, offset) of output token ``index`` among the verified blocks (first token from prefill)."""
    pos = 1
    for step, block in enumerate(spy.blocks.get(rid, [])):
        if pos <= index < pos + len(block):
            return step, index - pos, len(block)
        pos += len(block)
    return None


def _mid_block_index(on, prompt, params):
    """An output index that the DSpark run emits inside a block, with more tokens after it."""
    spy = BlockSpy(on)
    try:
        out = run_all(on, {"probe": prompt}, params)["probe"]
    finally:
        spy.close()
    for i in range(2, len(out.token_ids)):
        where = _block_position(spy, "probe", i)
        if where is not None and where[1] < where[2] - 1 and where[1] > 0:
            return out.token_ids, i
    pytest.fail(f"no multi-token block in {spy.blocks}")


def test_eos_inside_an_accepted_block(engines):
    off, on = engines(dspark=False), engines(adaptive=False)
    prompt = _prompts(4, 1, lo=20, hi=21)["r4-0"]
    tokens, i = _mid_block_index(on, prompt, GREEDY)
    params = SamplingParams(max_tokens=24, stop_token_ids=[tokens[i]])
    ref = run_all(off, {"a": prompt}, params)["a"]
    spy = BlockSpy(on)
    try:
        got = run_all(on, {"a": prompt}, params)["a"]
    finally:
        spy.close()
    assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "stop"
    assert got.token_ids[-1] == tokens[i] and len(got.token_ids) <= i + 1
    stop_at = len(got.token_ids) - 1
    step, offset, size = _block_position(spy, "a", stop_at)
    assert offset < size - 1, "the stop token should sit inside a block with tokens after it"


def test_stop_string_inside_an_accepted_block(engines):
    off, on = engines(dspark=False), engines(adaptive=False)
    prompt = _prompts(5, 1, lo=20, hi=21)["r5-0"]
    tokens, i = _mid_block_index(on, prompt, GREEDY)
    tok = on.tokenizer
    before, upto = tok.decode(tokens[:i]), tok.decode(tokens[:i + 1])
    stop = upto[len(before):]
    if not stop.strip() or stop in before:
        pytest.skip("token text not usable as a stop string")
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])
    ref = run_all(off, {"s": prompt}, params)["s"]
    got = run_all(on, {"s": prompt}, params)["s"]
    assert ref.finish_reason == "stop" and len(ref.token_ids) == i + 1
    assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)


def test_max_tokens_reached_mid_block(engines):
    """Drafts forced past max_tokens (the drafter itself never proposes them): the block is cut."""
    off, on = engines(dspark=False), engines()
    prompt = _prompts(6, 1, lo=10, hi=11)["r6-0"]
    full = run_all(off, {"f": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))["f"].token_ids
    spec = on.runner.speculator

    def oracle(rid, first_pos, drafts):
        start = first_pos - len(prompt)
        return full[start:start + MAX_DRAFT]
    spec.draft_hook = oracle
    spy = BlockSpy(on)
    try:
        for max_tokens in (4, 9):  # blocks end at 1, 6, 11 output tokens: both cut a block
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            got = run_all(on, {f"m{max_tokens}": prompt}, params)[f"m{max_tokens}"]
            assert got.token_ids == full[:max_tokens] and got.finish_reason == "length"
            last = spy.blocks[f"m{max_tokens}"][-1]
            assert len(last) == MAX_DRAFT + 1 and sum(map(len, spy.blocks[f"m{max_tokens}"])) + 1 > max_tokens
    finally:
        spy.close()


def test_drafts_respect_max_tokens_and_model_length(engines):
    """The drafter never proposes drafts whose verify step could pass max_tokens or the model length."""
    on = engines(adaptive=False, max_len=40)
    scheduled = []
    real = on.runner.execute

    def spy(batch):
        scheduled.extend((sr.req_id, sr.start_pos, len(sr.draft_token_ids)) for sr in batch.inputs.sched.requests
                         if sr.draft_token_ids)
        return real(batch)
    on.runner.execute = spy
    prompts = {"tokens": [5, 6, 7], "length": list(range(100, 130))}
    params = {"tokens": SamplingParams(max_tokens=7, ignore_eos=True),
              "length": SamplingParams(max_tokens=100, ignore_eos=True)}
    try:
        outs = run_all(on, prompts, params)
    finally:
        del on.runner.execute
    assert len(outs["tokens"].token_ids) == 7 and outs["tokens"].finish_reason == "length"
    assert len(outs["length"].token_ids) == 40 - 30 and outs["length"].finish_reason == "length"
    assert {rid for rid, _, _ in scheduled} == {"tokens", "length"}
    for rid, start, k in scheduled:
        outputs_before = start + 1 - len(prompts[rid])  # tokens emitted before this verify step
        assert outputs_before + k + 1 <= params[rid].max_tokens
        assert start + k <= 40 - 2  # the last fed position leaves room for the token it samples


def test_max_draft_zero_is_plain_decoding(engines):
    off, zero = engines(dspark=False), engines(max_draft=0)
    assert zero.runner.speculator is None and zero.stats().spec is None
    prompts = _prompts(7, 3)
    params = {rid: SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) if i % 2 else GREEDY
              for i, rid in enumerate(prompts)}
    ref, ref_lg = record_logits(off, prompts, params)
    got, got_lg = record_logits(zero, prompts, params)
    _compare(ref, ref_lg, got, got_lg, atol=0)
    assert all(o.metrics.num_draft_proposed == 0 for o in got.values())
