"""Drafting-time sampling: the Markov bias chains the block, q is exactly the distribution each
draft was drawn from (temperature, top-k, top-p applied to the Markov-corrected logits), and
draws are keyed by (request seed, position)."""
import torch

from redknot.sample import Sampler, SamplingRow
from redknot.sample.params import SamplingParams
from redknot.speculative.draft_sampling import MarkovSampler

V = 6


def _row(seed=0, **params):
    return SamplingRow(req_id=f"r{seed}", params=SamplingParams(**params), seed=seed, output_index=0)


def _bias_table(table):
    return lambda prev: table[prev]


def test_a_hand_built_bias_gives_a_known_chain():
    base = torch.zeros(1, 3, V)
    table = torch.zeros(V, V)
    table[1, 2] = table[2, 3] = table[3, 4] = 10.0  # prev -> next
    out = MarkovSampler(Sampler("cpu"), "greedy").sample(base, _bias_table(table), torch.tensor([1]), [_row()], [5])
    assert out[0].token_ids == [2, 3, 4] and out[0].probs is None


def test_q_is_the_processed_distribution_of_the_corrected_logits():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 4, V, generator=gen)
    table = torch.randn(V, V, generator=gen)
    rows = [_row(1, temperature=0.7, top_k=4), _row(2, temperature=1.3, top_p=0.8)]
    sampler = Sampler("cpu")
    out = MarkovSampler(sampler, "probabilistic").sample(base, _bias_table(table), torch.tensor([0, 3]), rows, [9, 40])
    for i, block in enumerate(out):
        prev = [[0, 3][i]] + block.token_ids[:-1]
        for k in range(4):
            logits = base[i, k] + table[prev[k]]
            z = logits / rows[i].params.temperature
            if rows[i].params.top_k:
                z = torch.where(z >= z.topk(rows[i].params.top_k).values[-1], z, torch.tensor(float("-inf")))
            expected = sampler.probs(logits[None], [rows[i]])[0]
            torch.testing.assert_close(block.probs[k], expected)
            assert block.probs[k, block.token_ids[k]] > 0  # drawn from its own q
            assert abs(float(block.probs[k].sum()) - 1) < 1e-5
            if rows[i].params.top_k:
                torch.testing.assert_close(block.probs[k], z.softmax(-1))


def test_draws_are_keyed_by_seed_and_position_not_by_batch():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(3, 5, V, generator=gen)
    table = torch.randn(V, V, generator=gen)
    ms = MarkovSampler(Sampler("cpu"), "probabilistic")
    rows = [_row(s, temperature=1.0) for s in (3, 4, 5)]
    together = ms.sample(base, _bias_table(table), torch.tensor([0, 1, 2]), rows, [10, 20, 30])
    alone = ms.sample(base[1:2], _bias_table(table), torch.tensor([1]), rows[1:2], [20])
    assert together[1].token_ids == alone[0].token_ids
    again = ms.sample(base, _bias_table(table), torch.tensor([0, 1, 2]), rows, [10, 20, 30])
    assert [b.token_ids for b in again] == [b.token_ids for b in together]
    moved = ms.sample(base, _bias_table(table), torch.tensor([0, 1, 2]), rows, [11, 21, 31])
    assert [b.token_ids for b in moved] != [b.token_ids for b in together]


def test_draft_draws_follow_q():
    """Many seeds: the first draft's frequencies match q_1 (chi-square)."""
    from test_rejection_sampling import chi2_pvalue
    base = torch.tensor([[[0.5, 0.1, -0.3, 1.0, 0.0, -1.0]]])
    table = torch.zeros(V, V)
    ms = MarkovSampler(Sampler("cpu"), "probabilistic")
    counts = torch.zeros(V, dtype=torch.float64)
    for seed in range(3000):
        block = ms.sample(base, _bias_table(table), torch.tensor([0]), [_row(seed, temperature=1.0)], [7])[0]
        counts[block.token_ids[0]] += 1
        q = block.probs[0]
    assert chi2_pvalue(counts, q.double()) > 1e-3


def test_greedy_requests_draft_argmax_even_when_probabilistic():
    base = torch.tensor([[[0.0, 3.0, 0.0, 0.0, 0.0, 0.0]]])
    out = MarkovSampler(Sampler("cpu"), "probabilistic").sample(
        base, _bias_table(torch.zeros(V, V)), torch.tensor([0]), [_row(0, temperature=0.0)], [3])
    assert out[0].token_ids == [1] and out[0].probs is None
