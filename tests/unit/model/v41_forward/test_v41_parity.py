"""The engine path of DeepSeek-V4.1 (paged state, steps) against the dense one-shot reference.

Tiny config of §7.2 (every layer type), 61-token prompts (longer than the window of 16, odd
so a ratio-2 group is carried over, more compressed entries than the top-8 and than the
candidate coverage 3x4), fp64 compute so the only differences are summation order.
"""
from __future__ import annotations

import pytest
import torch

from v41_forward.v41util import Pair, Seq, tie_aware_equal, tokens

TOL = 1e-9          # fp64: logits are O(10); summation-order differences are ~1e-14
PROMPT = 61


@pytest.fixture(scope="module", params=["reference", "bf16"])
def pair(request):
    return Pair(numerics=request.param)


@pytest.fixture(scope="module")
def ids():
    return tokens(PROMPT + 24)


@pytest.fixture(scope="module")
def oracle(pair, ids):
    return pair.ref.forward(ids)


def test_prefill_matches_reference(pair, ids, oracle):
    seq = Seq(pair.model, len(ids))
    got = seq.step(ids[:PROMPT])
    assert (got - oracle.logits[:PROMPT]).abs().max() < TOL
    # Selections: tie-aware against the reference's scores, and the candidate mask exactly.
    slots = pair.model.last_slots
    ref = pair.ref.forward(ids[:PROMPT])
    for layer, ref_sel in ref.topk.items():
        width = ref_sel.shape[1]
        assert tie_aware_equal(ref.scores[layer], slots.record[layer][:, :width], ref_sel), layer
        assert bool((slots.record[layer][:, width:] == -1).all())
    ref_cand = ref.candidates[pair.cfg.candidate_source_layer]
    assert torch.equal(slots.candidates[:, :ref_cand.shape[1]], ref_cand)
    assert not bool(ref_cand[-1].all())  # the candidate mask bites on the last rows


@pytest.mark.parametrize("splits", [(23, 38), (1, 60), (16, 16, 29), (2, 3, 5, 7, 11, 13, 20)])
def test_chunked_prefill_equals_one_shot(pair, ids, oracle, splits):
    seq = Seq(pair.model, len(ids), seed=len(splits))
    rows = []
    for n in splits:
        rows.append(seq.step(ids[len(seq.tokens):len(seq.tokens) + n]))
    assert (torch.cat(rows) - oracle.logits[:PROMPT]).abs().max() < TOL


def test_decode_steps_cross_ring_wraps_and_groups(pair, ids, oracle):
    seq = Seq(pair.model, len(ids))
    seq.step(ids[:PROMPT])
    for p in range(PROMPT, len(ids)):  # 24 steps: the 16-row ring wraps, groups close on odd p
        got = seq.step([ids[p]])
        assert (got[0] - oracle.logits[p]).abs().max() < TOL, p


def test_rollback_then_continue(pair, ids, oracle):
    seq = Seq(pair.model, len(ids) + 8, max_backtrack=5)
    seq.step(ids[:50])
    for p in range(50, 70):
        seq.step([ids[p]])
    seq.rollback(5)
    got = seq.step(ids[65:68])                      # a 3-token verify step after the rollback
    assert (got - oracle.logits[65:68]).abs().max() < TOL
    seq.step([7, 8, 9, 10])                         # rejected drafts
    seq.rollback(4)
    for p in range(68, len(ids)):
        got = seq.step([ids[p]])
        assert (got[0] - oracle.logits[p]).abs().max() < TOL, p


def test_two_sequences_in_one_step(pair, ids, oracle):
    """A batch mixing a prefill chunk and a decode token equals each sequence alone."""
    from redknot.step.metadata import StepMetadata

    a = Seq(pair.model, len(ids), num_slots=3, slot=0)
    a.step(ids[:40])
    other = tokens(30, seed=9)
    b_alone = pair.ref.forward(other).logits
    free = [i for i in range(a.state.num_blocks) if i not in a.blocks]   # b's own blocks
    meta = StepMetadata.build([ids[40:41], other], [40, 0], [0, 2], [a.blocks, free[:8]], [0, 30])
    logits = pair.model.compute_logits(pair.model.forward(meta, a.state)[meta.logits_indices])
    assert (logits[0] - oracle.logits[40]).abs().max() < TOL
    assert (logits[1] - b_alone[29]).abs().max() < TOL


def test_shipped_index_keys_follow_the_reference_decode():
    """``model.index_keys=shipped``: decode rows of ratio-2 owners with an incomplete group score
    the last kv source's keys of the previous step (§5.2); prefill is unchanged."""
    ids = tokens(PROMPT + 20, seed=3)
    shipped, owner = Pair(index_keys="shipped"), Pair()
    ref = shipped.ref.forward(ids, decode_from=PROMPT)
    own = owner.ref.forward(ids)
    assert torch.equal(ref.logits[:PROMPT], own.logits[:PROMPT])
    assert (ref.logits[PROMPT:] - own.logits[PROMPT:]).abs().max() > 1e-3  # the variant matters here
    seq = Seq(shipped.model, len(ids))
    assert (seq.step(ids[:PROMPT]) - ref.logits[:PROMPT]).abs().max() < TOL
    for p in range(PROMPT, len(ids)):
        assert (seq.step([ids[p]])[0] - ref.logits[p]).abs().max() < TOL, p


class TestBoundedReplay:
    """features.swa_replay: off is exact; compact runs layers above the last kv source on the tail."""

    def test_off_equals_reference(self, pair, ids, oracle):
        seq = Seq(pair.model, len(ids))
        got = seq.step(ids[:PROMPT], replay_from=None)
        assert (got - oracle.logits[:PROMPT]).abs().max() < TOL

    @pytest.mark.parametrize("keep", [17, 30])
    def test_compact_is_the_documented_approximation(self, pair, ids, keep):
        first = PROMPT - keep
        ref = pair.ref.forward(ids[:PROMPT], replay_from=first)
        full = pair.ref.forward(ids[:PROMPT])
        one = Seq(pair.model, len(ids)).step(ids[:PROMPT], replay_from=first)
        assert (one[first:] - ref.logits).abs().max() < TOL
        assert (ref.logits[-1] - full.logits[-1]).abs().max() > 1e-6   # the tail windows are truncated
        seq = Seq(pair.model, len(ids), seed=5)
        seq.step(ids[:25], replay_from=first)
        last = seq.step(ids[25:PROMPT], replay_from=first)
        assert (last[first - 25:] - ref.logits).abs().max() < TOL      # chunking does not change it
        # Decode after a compact prefill: tail windows reach only computed rows (keep >= window).
        for p in range(PROMPT, PROMPT + 4):
            row = seq.step([ids[p]], replay_from=p + 1 - keep)
            assert torch.isfinite(row).all()


def test_slot_reuse_and_preemption_rebuild(pair, ids, oracle):
    """A slot that held another sequence serves a new one exactly; a preempted sequence rebuilt by
    re-prefilling its known tokens continues exactly."""
    seq = Seq(pair.model, len(ids), seed=7)
    seq.step(tokens(53, seed=11))                    # a previous occupant of the same slot and blocks
    seq.tokens.clear()
    got = seq.step(ids[:PROMPT])
    assert (got - oracle.logits[:PROMPT]).abs().max() < TOL
    rebuilt = Seq(pair.model, len(ids), seed=8)
    rebuilt.step(ids[:PROMPT + 5])                   # prompt + 5 generated tokens, in one prefill
    for p in range(PROMPT + 5, PROMPT + 9):
        assert (rebuilt.step([ids[p]])[0] - oracle.logits[p]).abs().max() < TOL, p


def test_bounded_replay_in_a_mixed_batch(pair, ids):
    """Compact replay over a step holding a decode token and a prefill chunk that crosses its
    replay start equals each sequence run alone."""
    from redknot.step.metadata import StepMetadata

    keep = 20
    other = tokens(45, seed=12)
    alone_a = Seq(pair.model, len(ids), seed=1)
    alone_a.step(ids[:40], replay_from=41 - keep)
    want_a = alone_a.step(ids[40:41], replay_from=41 - keep)[0]
    alone_b = Seq(pair.model, len(ids), seed=2)
    alone_b.step(other[:10], replay_from=45 - keep)
    want_b = alone_b.step(other[10:], replay_from=45 - keep)[-1]

    a = Seq(pair.model, len(ids), num_slots=3, slot=0)
    a.step(ids[:40], replay_from=41 - keep)
    free = [i for i in range(a.state.num_blocks) if i not in a.blocks][:12]
    b_first = StepMetadata.build([other[:10]], [0], [2], [free], [9])
    b_first.replay_from = [45 - keep]
    pair.model.forward(b_first, a.state)
    meta = StepMetadata.build([ids[40:41], other[10:]], [40, 10], [0, 2], [a.blocks, free], [0, 35])
    meta.replay_from = [41 - keep, 45 - keep]
    logits = pair.model.compute_logits(pair.model.forward(meta, a.state)[meta.logits_indices])
    assert (logits[0] - want_a).abs().max() < TOL
    assert (logits[1] - want_b).abs().max() < TOL
