"""SWA bounded replay (features.swa_replay.mode=compact): the window-only layers (the MTP layer;
a window-only top layer in the second model) compute only the last keep_tokens positions of a
prompt. Same tokens, logits and drafts as mode off around the window and keep_tokens boundaries
and chunk boundaries near them, with the window-only layers' state filled with noise beforehand
(kv-sized values, so a skipped position that were read would get attention weight and show; NaN
would not do: a masked-out key still meets its zero weight in the attention product). The checks
run on the test model whose drafts are accepted and on the plain random model, whose MTP layer
depends strongly on its inputs; a control shows that too few kept positions are caught.
Rebuilds after preemption replay at most keep_tokens."""
import random

import pytest
import torch
from spec_testutil import MAX_DRAFT, WINDOW, record_logits, run_all

from redknot.engine import SamplingParams
from redknot.speculative.replay import CompactReplay

K_MAIN = WINDOW + MAX_DRAFT + 1                 # 21: the configuration rule
K_TAIL = WINDOW + MAX_DRAFT + 1 + (WINDOW - 1)  # 36: one window-only top layer below the MTP layer
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def _prompt(n, seed=0):
    rng = random.Random(seed * 1000 + n)
    return [rng.randrange(3, 4096) for _ in range(n)]


def _window_only_rings(llm):
    runner = llm.runner
    tail = [st.swa for st in runner.state.layers[runner.model.tail_start:]]
    return tail + [st.swa for st in runner.state.mtp]


class DraftLog:
    """Every drafter call's drafts and confidences per request, plus the MTP rows it computed."""

    def __init__(self, llm):
        self.drafter = llm.runner.speculator.drafter
        self.drafts, self.mtp_rows = [], []
        self._plan, self._propose = self.drafter._plan, self.drafter.propose
        self.drafter._plan = self.plan
        self.drafter.propose = self.propose

    def plan(self, batch, sampled):
        seqs = self._plan(batch, sampled)
        seq_len = {sr.req_id: sr.seq_len for sr in batch.inputs.sched.requests}
        self.mtp_rows += [(s.req_id, s.first_pos, len(s.rows), seq_len[s.req_id]) for s in seqs]
        return seqs

    def propose(self, batch, streams, sampled):
        out = self._propose(batch, streams, sampled)
        self.drafts.append({rid: (d.token_ids, d.confidences) for rid, d in out.items()})
        return out

    def close(self):
        del self.drafter._plan, self.drafter.propose

    def per_request(self):
        out = {}
        for step in self.drafts:
            for rid, d in step.items():
                out.setdefault(rid, []).append(d)
        return out


def _run(llm, prompts, params=GREEDY):
    gen = torch.Generator().manual_seed(7)
    for ring in _window_only_rings(llm):
        ring.copy_(torch.randn(ring.shape, generator=gen))
    log = DraftLog(llm)
    try:
        outs, logits = record_logits(llm, prompts, params)
    finally:
        log.close()
    return outs, logits, log


def _assert_same(ref, got):
    (ref_out, ref_lg, ref_log), (out, lg, log) = ref, got
    for rid in ref_out:
        assert out[rid].token_ids == ref_out[rid].token_ids, rid
        torch.testing.assert_close(lg[rid], ref_lg[rid], atol=2e-4, rtol=0)
    ref_drafts, drafts = ref_log.per_request(), log.per_request()
    assert drafts.keys() == ref_drafts.keys()
    for rid, steps in ref_drafts.items():
        assert [d[0] for d in drafts[rid]] == [d[0] for d in steps], rid
        for (_, conf), (_, ref_conf) in zip(drafts[rid], steps):
            torch.testing.assert_close(torch.tensor(conf), torch.tensor(ref_conf), atol=1e-8, rtol=1e-4)


def _assert_bounded(log, keep):
    """No MTP catch-up row lies before its sequence's kept tail."""
    for rid, first, _, seq_len in log.mtp_rows:
        assert first >= seq_len - keep, (rid, first, seq_len)


@pytest.mark.parametrize("agree", [True, False])
@pytest.mark.parametrize("arch,keep", [("main", K_MAIN), ("tail", K_TAIL)])
def test_compact_equals_off_around_window_and_keep_boundaries(engines, arch, keep, agree):
    lengths = sorted({WINDOW - 1, WINDOW, WINDOW + 1, keep - 1, keep, keep + 1, 2 * keep + 5})
    prompts = {f"L{n}": _prompt(n) for n in lengths}
    off = _run(engines(arch=arch, agree=agree, tag="off"), prompts)
    got = _run(engines(arch=arch, agree=agree, compact=True, keep_tokens=keep), prompts)
    _assert_same(off, got)
    if agree:
        assert sum(o.metrics.num_draft_accepted for o in got[0].values()) > 0
    long = f"L{2 * keep + 5}"  # its prefill: every position through the MTP layer in mode off, keep in compact

    def prefill_rows(log):
        return sum(n for rid, first, n, _ in log.mtp_rows if rid == long and first < 2 * keep + 5)
    assert (prefill_rows(off[2]), prefill_rows(got[2])) == (2 * keep + 5, keep)
    _assert_bounded(got[2], keep)


@pytest.mark.parametrize("arch,keep,chunks", [("main", K_MAIN, (7, 19, 20, 21, 25)),
                                              ("tail", K_TAIL, (17, 35, 36, 37))])
def test_compact_with_chunk_boundaries_near_the_bounds(engines, arch, keep, chunks):
    prompts = {"a": _prompt(2 * keep + 1, 1), "b": _prompt(keep + 1, 2), "c": _prompt(WINDOW + 2, 3)}
    off = _run(engines(arch=arch, tag="off"), prompts)
    for chunk in chunks:
        got = _run(engines(arch=arch, compact=True, keep_tokens=keep, budget=chunk, chunk=chunk), prompts)
        _assert_same(off, got)
        _assert_bounded(got[2], keep)


@pytest.mark.parametrize("arch,keep,too_small", [("main", K_MAIN, WINDOW - 1), ("tail", K_TAIL, 2 * WINDOW - 2)])
def test_a_too_short_replay_reads_the_skipped_rows(engines, arch, keep, too_small):
    """Control: with one kept position fewer than the layers need, the noise is read."""
    prompts = {"x": _prompt(3 * keep, 4)}
    off = _run(engines(arch=arch, agree=False, tag="off"), prompts)
    llm = engines(arch=arch, agree=False, compact=True, keep_tokens=keep, tag="short")
    llm.runner.replay = llm.runner.speculator.drafter.replay = CompactReplay(keep_tokens=too_small)
    try:
        got = _run(llm, prompts)
    finally:
        llm.runner.replay = llm.runner.speculator.drafter.replay = CompactReplay(keep_tokens=keep)
    with pytest.raises(AssertionError):
        _assert_same(off, got)


def test_rebuild_after_preemption_replays_at_most_keep_tokens(engines):
    rng = random.Random(5)
    prompts = {f"p{i}": [rng.randrange(3, 4096) for _ in range(rng.randrange(25, 45))] for i in range(4)}
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = run_all(engines(), prompts, params)
    # 8 blocks of 16 tokens: four sequences growing to 55-75 tokens cannot all stay resident.
    llm = engines(compact=True, keep_tokens=K_MAIN, num_cache_blocks=8, max_len=128)
    log = DraftLog(llm)
    try:
        got = run_all(llm, prompts, params)
    finally:
        log.close()
    assert sum(o.metrics.num_preemptions for o in got.values()) > 0
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids
    recomputes = [(rid, n) for rid, first, n, seq_len in log.mtp_rows if seq_len > len(prompts[rid]) + 1
                  and first < seq_len - 1]
    assert recomputes and all(n <= K_MAIN for _, n in recomputes)
    _assert_bounded(log, K_MAIN)


def test_keep_tokens_must_cover_window_only_layers():
    from redknot.config.schema import FeaturesConfig, SwaReplayMode
    from redknot.models.deepseek_v4.config import V4Config
    from spec_testutil import ARCH, ARCH_TAIL
    f = FeaturesConfig()
    f.swa_replay.mode, f.dspark.max_draft = SwaReplayMode.compact, MAX_DRAFT
    main, tail = V4Config.flash().with_overrides(ARCH), V4Config.flash().with_overrides(ARCH_TAIL)
    assert (main.num_trailing_sliding_layers, tail.num_trailing_sliding_layers) == (0, 1)
    f.swa_replay.keep_tokens = K_MAIN
    assert CompactReplay.from_features(f, main).keep_tokens == K_MAIN
    with pytest.raises(ValueError, match=r"features.swa_replay.keep_tokens=21.*= 36"):
        CompactReplay.from_features(f, tail)
    f.swa_replay.mode = SwaReplayMode.off
    assert CompactReplay.from_features(f, tail) is None
