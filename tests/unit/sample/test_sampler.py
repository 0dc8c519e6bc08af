"""Sampler: greedy, seeded draws keyed by (seed, index), filters, bitmasks, processors."""
import math

import pytest
import torch

from redknot.sample.params import SamplingParams
from redknot.sample import Sampler, SamplingRow, apply_bitmask

CPU = torch.device("cpu")


def _row(params, seed=0, index=0, rid="r", outputs=()):
    return SamplingRow(req_id=rid, params=params, seed=seed, output_index=index, output_token_ids=outputs)


def test_greedy_is_argmax():
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    tokens = Sampler(CPU).sample(logits, [_row(SamplingParams())] * 5)
    assert tokens == logits.argmax(1).tolist()


@pytest.mark.parametrize("row_by_row", [False, True])
def test_seeded_row_is_independent_of_batch(row_by_row):
    g = torch.Generator().manual_seed(1)
    needle = torch.randn(1, 1000, generator=g)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, seed=7)
    sampler = Sampler(CPU, row_by_row=row_by_row)
    alone = sampler.sample(needle, [_row(params, seed=7, index=3)])[0]
    for size, pos in [(2, 1), (8, 5), (16, 0)]:
        others = torch.randn(size, 1000, generator=g)
        batch = torch.cat([others[:pos], needle, others[pos:]])
        rows = [_row(SamplingParams(temperature=1.3, top_p=0.5), seed=100 + i, index=i) for i in range(size)]
        rows.insert(pos, _row(params, seed=7, index=3))
        assert sampler.sample(batch, rows)[pos] == alone
    draws = {sampler.sample(needle, [_row(params, seed=7, index=i)])[0] for i in range(40)}
    assert len(draws) > 3  # consecutive indices draw fresh noise
    seeds = {sampler.sample(needle, [_row(params, seed=s, index=3)])[0] for s in range(40)}
    assert len(seeds) > 3


def test_vectorized_and_row_by_row_agree():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 500, generator=g)
    rows = [_row(SamplingParams(temperature=0.5 + i / 10, top_k=i * 7, top_p=1 - i / 30, min_p=i / 100),
                 seed=i, index=i) for i in range(12)]
    assert Sampler(CPU).sample(logits, rows) == Sampler(CPU, row_by_row=True).sample(logits, rows)


def test_draws_follow_the_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    probs = logits.softmax(1)[0].tolist()
    sampler = Sampler(CPU)
    n = 4000
    counts = [0] * 5
    for i in range(n):
        counts[sampler.sample(logits, [_row(SamplingParams(temperature=1.0), seed=11, index=i)])[0]] += 1
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    assert chi2 < 18.5  # 4 degrees of freedom, p = 0.001


@pytest.mark.parametrize("kw, allowed", [({"top_k": 2}, {0, 1}), ({"top_p": 0.7}, {0, 1}),
                                         ({"top_p": 0.8}, {0, 1}), ({"top_p": 0.81}, {0, 1, 2}),
                                         ({"min_p": 0.5}, {0, 1}), ({"min_p": 0.2}, {0, 1, 2})])
def test_filters_restrict_support(kw, allowed):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = Sampler(CPU)
    seen = {sampler.sample(logits, [_row(SamplingParams(temperature=1.0, **kw), seed=3, index=i)])[0]
            for i in range(400)}
    assert seen == allowed


def test_bitmask_matches_xgrammar_and_restricts_greedy():
    import xgrammar as xgr
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 100, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (3, math.ceil(100 / 32)), generator=g, dtype=torch.int64).to(torch.int32)
    ours = apply_bitmask(logits, mask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, mask)
    assert torch.equal(ours, theirs)
    tokens = Sampler(CPU).sample(logits, [_row(SamplingParams())] * 3, bitmask=mask)
    for i, t in enumerate(tokens):
        assert (int(mask[i, t // 32]) >> (t % 32)) & 1


def test_logits_processors_see_outputs_and_change_logits():
    seen = []

    def ban_last(outputs, row):
        seen.append(list(outputs))
        row = row.clone()
        row[outputs[-1]] = float("-inf")
        return row

    logits = torch.zeros(2, 10)
    logits[:, 4] = 5.0
    rows = [_row(SamplingParams(logits_processors=[ban_last]), outputs=(1, 4)), _row(SamplingParams())]
    tokens = Sampler(CPU).sample(logits, rows)
    assert tokens[0] != 4 and tokens[1] == 4 and seen == [[1, 4]]
