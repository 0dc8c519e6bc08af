"""Exact enumeration of token-wise and block verification on toy vocabularies (fractions, no
sampling): the joint distribution of the first N emitted tokens equals the target's, with and
without confidence-scheduled trimming (global top-B over two requests); Sun et al.'s example
gives 10/9 vs 11/9 expected accepted drafts; an anticipating scheduler, which looks at the draft
it admits, breaks it (the negative control)."""
import itertools
from fractions import Fraction as F

import numpy as np
import pytest

from redknot.speculative.rejection import block_thresholds, verify_block, verify_tokenwise
from redknot.speculative.schedule import allocate, survivals


def dist(*weights):
    w = [F(x) for x in weights]
    total = sum(w)
    return np.array([x / total for x in w], dtype=object)


def const_model(*weights):
    d = dist(*weights)
    return lambda prefix: d


def context_model(salt, vocab=3, spread=5):
    """A distribution that depends on the whole prefix (its length and tokens)."""
    def model(prefix):
        return dist(*[1 + (salt * (1 + sum(prefix)) + 3 * len(prefix) + v * (v + salt)) % spread
                      for v in range(vocab)])
    return model


def _coin_patterns(thresholds, accept_value, reject_value):
    """Every accept/reject pattern of the coins with its probability and representative coins."""
    for pattern in itertools.product((True, False), repeat=len(thresholds)):
        prob, coins = F(1), []
        for ok, t in zip(pattern, thresholds):
            prob *= t if ok else 1 - t
            coins.append(accept_value(t) if ok else reject_value(t))
        if prob:
            yield prob, coins


def step_outcomes(method, p, q, drafts):
    """[(probability, accepted drafts, next-token distribution)] of one verification."""
    vocab = len(p[0])
    p = np.array(p, dtype=object).reshape(len(p), vocab)
    q = np.array(q, dtype=object).reshape(len(q), vocab)
    if method == "token":
        ratios = [min(F(1), p[i][x] / q[i][x]) for i, x in enumerate(drafts)]
        patterns = _coin_patterns(ratios, lambda t: F(0), lambda t: t)  # accept iff u < ratio
        verify = verify_tokenwise
    else:
        hs = [h for _, h in block_thresholds(p, q, drafts)]
        patterns = _coin_patterns(hs, lambda t: t, lambda t: F(1))  # accept iff eta <= h
        verify = verify_block
    out = []
    for prob, coins in patterns:
        o = verify(p, q, drafts, coins)
        out.append((prob, o.num_accepted, o.next_dist))
    return out


def one_step(method, targets, drafts_model, prefixes, gamma, schedule):
    """{(emitted per request): probability} of one engine step over several requests: each drafts
    gamma tokens from its draft model, ``schedule`` picks verify lengths, each verifies."""
    per_req = []
    for r, prefix in enumerate(prefixes):
        options = []
        for d in itertools.product(range(len(targets[r](prefix))), repeat=gamma):
            prob = F(1)
            for k in range(gamma):
                prob *= drafts_model[r](prefix + d[:k])[d[k]]
            if prob:
                options.append((prob, d))
        per_req.append(options)
    result = {}
    for combo in itertools.product(*per_req):
        prob = F(1)
        for pr, _ in combo:
            prob *= pr
        drafts = [d for _, d in combo]
        lengths = schedule(prefixes, drafts)
        branches = []
        for r, (prefix, d, ell) in enumerate(zip(prefixes, drafts, lengths)):
            p = [targets[r](prefix + d[:i]) for i in range(ell + 1)]
            q = [drafts_model[r](prefix + d[:i]) for i in range(ell)]
            emitted = []
            for pr, tau, nxt in step_outcomes(method, p, q, list(d[:ell])):
                for y, py in enumerate(nxt):
                    if pr * py:
                        emitted.append((pr * py, d[:tau] + (y,)))
            branches.append(emitted)
        for parts in itertools.product(*branches):
            w = prob
            for pr, _ in parts:
                w *= pr
            key = tuple(e for _, e in parts)
            result[key] = result.get(key, 0) + w
    return result


def joint(method, targets, drafts_model, n, gamma, schedule, prefixes=None):
    """Exact joint distribution of the first n tokens of every request, decoding step by step."""
    prefixes = prefixes or tuple(() for _ in targets)
    if all(len(p) >= n for p in prefixes):
        return {tuple(p[:n] for p in prefixes): F(1)}
    live = [r for r, p in enumerate(prefixes) if len(p) < n]
    step = one_step(method, [targets[r] for r in live], [drafts_model[r] for r in live],
                    [prefixes[r] for r in live], gamma, schedule)
    out = {}
    for emitted, w in step.items():
        nxt = list(prefixes)
        for r, e in zip(live, emitted):
            nxt[r] = prefixes[r] + e
        for seqs, v in joint(method, targets, drafts_model, n, gamma, schedule, tuple(nxt)).items():
            out[seqs] = out.get(seqs, 0) + w * v
    return out


def target_joint(targets, n):
    out = {}
    for seqs in itertools.product(*[list(itertools.product(range(len(t(()))), repeat=n)) for t in targets]):
        w = F(1)
        for t, s in zip(targets, seqs):
            for i in range(n):
                w *= t(s[:i])[s[i]]
        if w:
            out[seqs] = w
    return out


def verify_all(prefixes, drafts):
    return [len(d) for d in drafts]


def scheduler(confidence, budget):
    """Global top-``budget`` over the survivals of ``confidence(prefix, drafts, k)`` (the real allocator)."""
    def schedule(prefixes, drafts):
        surv = [survivals([confidence(p, d, k) for k in range(len(d))]) for p, d in zip(prefixes, drafts)]
        return allocate(surv, budget)
    return schedule


def non_anticipating(prefix, drafts, k):
    """Confidence of slot k from the prefix and drafts before k only (as DSpark's head)."""
    before = drafts[:k]
    return F(1 + (sum(before) + len(prefix) + k) % 3, 4)


def anticipating(prefix, drafts, k):
    """Reads draft k itself: the first draft is admitted only when it is token 0 (paper App. A)."""
    return F(1) if drafts[k] == 0 else F(0)


SUN_TARGET, SUN_DRAFT = const_model(1, 2), const_model(2, 1)


@pytest.mark.parametrize("method, expected", [("token", F(10, 9)), ("block", F(11, 9))])
def test_sun_et_al_example_expected_accepted_drafts(method, expected):
    p, q = [SUN_TARGET(())] * 3, [SUN_DRAFT(())] * 2
    mean = F(0)
    for d in itertools.product(range(2), repeat=2):
        w = SUN_DRAFT(())[d[0]] * SUN_DRAFT(())[d[1]]
        mean += sum(w * pr * tau for pr, tau, _ in step_outcomes(method, p, q, list(d)))
    assert mean == expected


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("models", ["sun", "context", "rescue"])
def test_emitted_tokens_follow_the_target_exactly(method, models):
    if models == "sun":
        targets, drafts, n, gamma = [SUN_TARGET], [SUN_DRAFT], 4, 2
    elif models == "context":
        targets, drafts, n, gamma = [context_model(1)], [context_model(2)], 3, 2
    else:  # block keeps a draft with running ratio < 1 and a residual of more than one token
        targets, drafts, n, gamma = [context_model(2, spread=9)], [context_model(4, spread=9)], 2, 2
    assert joint(method, targets, drafts, n, gamma, verify_all) == target_joint(targets, n)


@pytest.mark.parametrize("method", ["token", "block"])
def test_global_top_b_over_two_requests_keeps_both_targets(method):
    targets = [SUN_TARGET, context_model(1, vocab=2)]
    drafts = [SUN_DRAFT, context_model(3, vocab=2)]
    schedule = scheduler(non_anticipating, budget=2)
    got = joint(method, targets, drafts, 2, 2, schedule)
    assert got == target_joint(targets, 2)


@pytest.mark.parametrize("method", ["token", "block"])
def test_an_anticipating_scheduler_breaks_the_target(method):
    """Negative control: the same allocator fed confidences that read draft k itself."""
    targets, drafts = [const_model(7, 3)], [const_model(1, 1)]
    good = joint(method, targets, drafts, 2, 2, scheduler(non_anticipating, budget=2))
    bad = joint(method, targets, drafts, 2, 2, scheduler(anticipating, budget=2))
    expected = target_joint(targets, 2)
    assert good == expected
    assert bad != expected
    first = sum(w for seqs, w in bad.items() if seqs[0][0] == 0)
    assert first > F(7, 10)  # token 0 is over-produced


def test_block_thresholds_of_sun_example_and_greedy_drafts():
    p = np.array([SUN_TARGET(())] * 3, dtype=object)
    q = np.array([SUN_DRAFT(())] * 2, dtype=object)
    # drafts (0, 0): r1 = min(1, (1/3)/(2/3)) = 1/2, one-ahead mass sum max(r1 p - q, 0) = 0 -> h1 = 0; h2 = r2 = 1/4
    assert block_thresholds(p, q, [0, 0]) == [(F(1, 2), F(0)), (F(1, 4), F(1, 4))]
    # drafts (1, 0): r1 = 1, so h1 = 1 (mass / (mass + 0))
    assert block_thresholds(p, q, [1, 0])[0] == (F(1), F(1))


def test_the_code_decides_at_the_thresholds_it_reports():
    """The representative coins above rely on: token-wise accepts iff u < ratio, block iff eta <= h."""
    p = np.array([SUN_TARGET(())] * 3, dtype=object)
    q = np.array([SUN_DRAFT(())] * 2, dtype=object)
    eps = F(1, 10 ** 9)
    assert verify_tokenwise(p[:2], q[:1], [0], [F(1, 2) - eps]).num_accepted == 1
    assert verify_tokenwise(p[:2], q[:1], [0], [F(1, 2)]).num_accepted == 0
    assert verify_block(p, q, [0, 0], [F(1), F(1, 4)]).num_accepted == 2
    assert verify_block(p, q, [0, 0], [F(1), F(1, 4) + eps]).num_accepted == 0
    # a later success rescues an earlier failure: eta_1 > h_1 but eta_2 <= h_2 keeps both
    assert verify_block(p, q, [0, 0], [F(1, 2), F(1, 8)]).num_accepted == 2
