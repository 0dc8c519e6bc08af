"""Case building: exact target length and gold spans that survive, for random inputs (hypothesis)."""
import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redknot.bench.casebuild import CaseError, PromptPieces, build_case, middle_truncate
from redknot.bench.datasets import SourceReader
from redknot.bench.suite import SuiteBuilder
from redknot.config.schema import DataConfig, SuiteConfig

from .conftest import v4_tokenizer

ids_arrays = st.lists(st.integers(0, 129_279), min_size=0, max_size=40).map(lambda v: np.asarray(v, np.uint32))


@st.composite
def case_inputs(draw):
    pieces = PromptPieces(*(draw(ids_arrays) for _ in range(4)))
    golds = draw(st.lists(st.lists(st.integers(0, 129_279), min_size=1, max_size=60)
                          .map(lambda v: np.asarray(v, np.uint32)), min_size=1, max_size=4))
    depths = draw(st.lists(st.floats(0, 1), min_size=len(golds), max_size=len(golds)))
    blocks = draw(st.lists(st.lists(st.integers(0, 129_279), min_size=1, max_size=50)
                           .map(lambda v: np.asarray(v, np.uint32)), min_size=0, max_size=30))
    sep = np.asarray(draw(st.lists(st.integers(0, 129_279), max_size=2)), np.uint32)
    target = pieces.num_fixed + draw(st.integers(0, 400))
    return pieces, golds, depths, blocks, sep, target


@settings(max_examples=300, deadline=None)
@given(case_inputs())
def test_exact_length_and_gold_survives(args):
    pieces, golds, depths, blocks, sep, target = args
    filler = [(f"b{i}", ids) for i, ids in enumerate(blocks)]
    try:
        built = build_case(pieces, golds, depths, filler, sep, target)
    except CaseError as err:
        # Only two honest reasons to refuse: not enough filler, or several needles that cannot fit.
        budget = target - pieces.num_fixed
        room = budget - sum(map(len, golds)) - (len(golds) - 1) * len(sep)
        assert ("filler runs out" in str(err) and sum(len(b) + len(sep) for b in blocks) < room) or \
            (room < 0 and len(golds) > 1)
        return
    ids = built.input_ids
    assert len(ids) == target and ids.dtype == np.uint32
    np.testing.assert_array_equal(ids[:len(pieces.prefix)], pieces.prefix)
    tail = np.concatenate([pieces.middle, pieces.question, pieces.suffix])
    np.testing.assert_array_equal(ids[len(ids) - len(tail):], tail)
    if built.gold_truncated:
        head, rest = middle_truncate(golds[0], target - pieces.num_fixed)
        (s0, e0), (s1, e1) = built.gold_spans
        np.testing.assert_array_equal(ids[s0:e0], head)
        np.testing.assert_array_equal(ids[s1:e1], rest)
        assert len(golds[0]) > target - pieces.num_fixed - len(sep)
    else:
        assert len(built.gold_spans) == len(golds)
        previous_end = len(pieces.prefix)
        for (start, end), gold in zip(built.gold_spans, golds):
            assert previous_end <= start and end <= len(ids) - len(tail)
            np.testing.assert_array_equal(ids[start:end], gold)
            previous_end = end
        # Filler blocks are used in order, as a prefix of the given sequence.
        assert list(built.filler_keys) == [f"b{i}" for i in range(len(built.filler_keys))]


def test_middle_truncation_keeps_both_halves():
    gold = np.arange(100, dtype=np.uint32)
    pieces = PromptPieces(*(np.asarray(v, np.uint32) for v in ([1, 2], [3], [4, 5], [6])))
    built = build_case(pieces, [gold], [0.5], [], np.asarray([9], np.uint32), 6 + 11)
    assert built.gold_truncated
    # budget 11: the first 5 and the last 6 gold tokens
    np.testing.assert_array_equal(built.input_ids, [1, 2, 0, 1, 2, 3, 4, 94, 95, 96, 97, 98, 99, 3, 4, 5, 6])


def test_gold_snaps_to_passage_boundary():
    pieces = PromptPieces(*(np.zeros(0, np.uint32) for _ in range(4)))
    blocks = [(f"d{i}", np.full(4, 10 + i, np.uint32)) for i in range(5)]
    sep = np.asarray([7], np.uint32)
    gold = np.asarray([1, 1], np.uint32)
    # budget 14, filler room 12; depth 0.5 wants 6 → nearest boundary is 5 (after "d0 sep")
    built = build_case(pieces, [gold], [0.5], blocks, sep, 14)
    np.testing.assert_array_equal(built.input_ids, [10, 10, 10, 10, 7, 1, 1, 7, 11, 11, 11, 11, 7, 12])
    assert built.gold_spans == ((5, 7),) and built.filler_keys == ("d0", "d1", "d2")


def test_question_longer_than_target_is_refused():
    pieces = PromptPieces(*(np.zeros(n, np.uint32) for n in (3, 3, 30, 3)))
    try:
        build_case(pieces, [np.zeros(2, np.uint32)], [0.0], [], np.zeros(0, np.uint32), 32)
    except CaseError as err:
        assert "39 tokens, more than the target 32" in str(err)
    else:
        raise AssertionError("a 39-token template+question cannot make a 32-token prompt")


texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=300)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contexts=st.lists(texts, min_size=2, max_size=6), questions=st.lists(texts, min_size=6, max_size=6),
       target=st.integers(160, 900), seed=st.integers(0, 2 ** 31))
def test_suite_cases_hit_target_with_the_real_tokenizer(contexts, questions, target, seed):
    tokenizer = v4_tokenizer()
    rows = [{"input": q[:40], "context": c, "answers": ["x"], "_id": f"r{i}", "length": 1}
            for i, (c, q) in enumerate(zip(contexts, questions))]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "hotpotqa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        suite = SuiteConfig(context_tokens=target, datasets=["hotpotqa", "niah_single"], samples_per_dataset=0,
                            seed=seed, data=DataConfig(dir=tmp))
        builder = SuiteBuilder(SuiteConfig(**{**suite.__dict__, "samples_per_dataset": len(rows)}), tokenizer,
                               SourceReader(suite.data))
        golds = {r["_id"]: tokenizer.encode(r["context"]) for r in rows}
        for entry, ids in _built_or_short(builder):
            assert len(ids) == target == entry.num_tokens
            if entry.kind == "synthetic":
                continue
            gold = golds[entry.row_id]
            spans = entry.gold_spans
            if entry.gold_truncated:
                np.testing.assert_array_equal(np.concatenate([ids[s:e] for s, e in spans]),
                                              np.concatenate(middle_truncate(gold, spans[-1][1] - spans[0][0])))
            else:
                np.testing.assert_array_equal(ids[spans[0][0]:spans[0][1]], gold)


def _built_or_short(builder):
    """All cases; a row whose distractors cannot fill the target is the one refusal allowed here."""
    try:
        yield from builder.build()
    except CaseError as err:
        assert "filler runs out" in str(err)
