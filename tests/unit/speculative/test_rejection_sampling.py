"""Speculative (rejection) sampling preserves the target distribution: chi-square tests with a
fixed seed on a small vocabulary, for the math and for the engine's verifier end to end
(temperature and top-k applied), plus the greedy rules and seeded reproducibility."""
import torch

from redknot.engine.inputs import StepInputs
from redknot.engine.messages import ScheduledRequest, SchedulerOutput
from redknot.engine.model_runner import StepBatch
from redknot.sample.params import SamplingParams
from redknot.sample import Sampler, SamplingRow
from redknot.speculative.metrics import SpecDecodeStats
from redknot.speculative.rejection import greedy_accept, point_mass, speculative_sample
from redknot.speculative.verifier import Verifier

P_MIN = 1e-3  # fixed seeds make each check deterministic; a correct sampler passes with margin


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of Pearson's statistic (cells with zero probability must be empty)."""
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts[~support]}"
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def _dist(values, gen):
    x = torch.rand(len(values), generator=gen) + torch.tensor(values)
    return x / x.sum()


def _first_tokens(p, q, draws, gen, residual_fn=None):
    vocab = p.shape[1]
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(draws):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        u = float(torch.rand((), generator=gen))
        noise = torch.empty(2, vocab).exponential_(generator=gen)
        if residual_fn is None:
            out = speculative_sample(p, q, [x], [u], noise)
        else:
            out = residual_fn(p, q, x, u, noise)
        counts[out[0]] += 1
    return counts


def test_speculative_sampling_matches_the_target_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([_dist([0.1, 3, 1, 0.5, 2, 0.0], gen), _dist([1] * 6, gen)])
    p[0, 5] = 0.0
    p[0] /= p[0].sum()
    q_sampled = _dist([2, 0.2, 1, 3, 0.5, 1], gen)[None]  # drafts drawn from a different distribution
    counts = _first_tokens(p, q_sampled, 8000, gen)
    assert chi2_pvalue(counts, p[0]) > P_MIN
    for token in (1, 3):  # DSpark's case: a deterministic draft (point mass)
        counts = _first_tokens(p, point_mass([token], 6, "cpu"), 5000, gen)
        assert chi2_pvalue(counts, p[0]) > P_MIN


def test_the_chi_square_check_detects_a_wrong_residual():
    """Negative control: resampling from p instead of max(0, p - q) over-weights the draft."""
    gen = torch.Generator().manual_seed(1)
    p = _dist([1, 2, 3, 4, 1, 1], gen)[None].repeat(2, 1)

    def wrong(p, q, x, u, noise):
        if u < min(1.0, float(p[0, x] / q[0, x])):
            return [x]
        return [int((p[0] / noise[0]).argmax())]
    counts = _first_tokens(p, point_mass([3], 6, "cpu"), 5000, gen, residual_fn=wrong)
    assert chi2_pvalue(counts, p[0]) < 1e-6


def _batch(logits_per_req, drafts, params, seeds, first_index=5):
    requests, rows = [], []
    for i, (d, seed) in enumerate(zip(drafts, seeds)):
        rid = f"q{i}"
        requests.append(ScheduledRequest(req_id=rid, slot=0, block_table=[0], start_pos=10,
                                         token_ids=[0] + list(d), num_logits=len(d) + 1, draft_token_ids=list(d),
                                         seq_len=11))
        rows += [SamplingRow(rid, params, seed, first_index + j) for j in range(len(d) + 1)]
    inputs = StepInputs(sched=SchedulerOutput(step_id=1, requests=requests), meta=None)
    return StepBatch(inputs=inputs, rows=rows), torch.cat(logits_per_req)


def _target(logits, temperature, top_k):
    """The distribution plain sampling draws from, computed here from its definition."""
    z = logits / temperature
    kth = z.topk(top_k, dim=-1).values[..., -1:]
    return torch.where(z >= kth, z, torch.full_like(z, float("-inf"))).softmax(-1)


def test_verifier_preserves_the_target_distribution_per_position():
    gen = torch.Generator().manual_seed(2)
    vocab, n = 8, 8000
    logits = torch.randn(3, vocab, generator=gen) * 1.5  # rows: after the last token, after d1, after d2
    params = SamplingParams(temperature=0.7, top_k=5)
    probs = _target(logits, 0.7, 5)
    d1, d2 = int(probs[0].argmax()), int(probs[1].argsort()[-2])  # a likely and a less likely draft
    verifier = Verifier(Sampler("cpu"), "token", SpecDecodeStats(max_draft=2))
    batch, flat = _batch([logits] * n, [[d1, d2]] * n, params, range(n))
    out = verifier(batch, flat)
    first = torch.zeros(vocab, dtype=torch.float64)
    second = torch.zeros(vocab, dtype=torch.float64)
    third = torch.zeros(vocab, dtype=torch.float64)
    for tokens in out.values():
        first[tokens[0]] += 1
        if tokens[0] == d1:
            second[tokens[1]] += 1
            if tokens[1] == d2:
                third[tokens[2]] += 1
    assert chi2_pvalue(first, probs[0]) > P_MIN
    assert chi2_pvalue(second, probs[1]) > P_MIN
    assert chi2_pvalue(third, probs[2]) > P_MIN
    assert verifier.stats.num_proposed == 2 * n and 0 < verifier.stats.num_accepted < 2 * n


def test_seeded_verification_is_reproducible():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    params = SamplingParams(temperature=1.0)
    drafts = [int(logits[i].argmax()) for i in range(3)]

    def run(seeds):
        verifier = Verifier(Sampler("cpu"), "token", SpecDecodeStats(max_draft=3))
        batch, flat = _batch([logits] * len(seeds), [drafts] * len(seeds), params, seeds)
        out = verifier(batch, flat)
        return [out[f"q{i}"] for i in range(len(seeds))]
    a, b = run(list(range(40))), run(list(range(40)))
    assert a == b
    assert len({tuple(x) for x in a}) > 1  # different seeds, different outcomes
    assert run([7]) == [a[7]]  # a request's tokens do not depend on the rest of the batch


def test_greedy_rules():
    assert greedy_accept([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert greedy_accept([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert greedy_accept([5], [4, 2]) == [4]
    assert greedy_accept([], [3]) == [3]
    logits = torch.full((3, 10), -5.0)
    logits[0, 4] = logits[1, 2] = logits[2, 9] = 5.0
    greedy = SamplingParams()
    batch, flat = _batch([logits], [[4, 3]], greedy, [0])
    assert Verifier(Sampler("cpu"), "token", SpecDecodeStats(max_draft=2))(batch, flat) == {"q0": [4, 2]}


def test_probabilistic_drafts_without_their_q_are_all_rejected():
    """Drafts kept from an older step (their q replaced meanwhile): one plain sample from row 0."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 8, generator=gen)
    params = SamplingParams(temperature=1.0)
    sampler = Sampler("cpu")
    verifier = Verifier(sampler, "token", SpecDecodeStats(max_draft=2), probabilistic=True)
    q = torch.full((2, 8), 1 / 8)
    verifier.draft_probs = {"q0": ((3, 4), q)}  # q of other drafts
    batch, flat = _batch([logits], [[1, 2]], params, [7])
    plain = sampler.sample(logits[:1], [batch.rows[0]])
    assert verifier(batch, flat) == {"q0": plain}
    verifier.draft_probs = {"q0": ((1, 2), q)}  # its own q: verified (two drafts and a token at most)
    out = verifier(batch, flat)["q0"]
    assert 1 <= len(out) <= 3 and verifier.stats.num_proposed == 4
