"""EPLB placement: structure (every expert keeps a replica, equal slots per rank, no copy twice on a
rank), balance (better than the load-blind placement on skewed loads; LPT's bound) and errors."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from redknot.parallel.eplb import (ExpertPlacement, imbalance, plan_placement, rank_loads, replicate,
                                   uniform_placement)


def zipf(num_experts: int, s: float, seed: int = 0) -> list:
    loads = [1000.0 / (i + 1) ** s for i in range(num_experts)]
    random.Random(seed).shuffle(loads)
    return loads


@st.composite
def problems(draw):
    ranks = draw(st.integers(1, 8))
    experts = draw(st.integers(1, 48))
    options = [r for r in range(0, min(experts * (ranks - 1), 3 * ranks) + 1) if (experts + r) % ranks == 0]
    if not options:
        experts += ranks - experts % ranks
        options = [0]
    redundant = draw(st.sampled_from(options))
    weight = st.one_of(st.just(0.0), st.floats(0, 1e6, allow_nan=False), st.integers(0, 10**6).map(float))
    loads = draw(st.lists(weight, min_size=experts, max_size=experts))
    return loads, ranks, redundant


@settings(max_examples=150, deadline=None)
@given(problems())
def test_placement_structure(problem):
    loads, ranks, redundant = problem
    p = plan_placement(loads, ranks, redundant)
    assert p.num_physical == len(loads) + redundant
    assert set(p.phys_to_logical) == set(range(len(loads)))  # every logical expert keeps >= 1 replica
    counts = p.replica_counts()
    assert all(1 <= c <= ranks for c in counts) and sum(counts) == p.num_physical
    for r in range(ranks):
        held = p.rank_experts(r)
        assert len(held) == p.slots_per_rank and len(set(held)) == len(held)
    assert abs(sum(rank_loads(p, loads)) - sum(loads)) <= 1e-6 * max(1.0, sum(loads))
    assert plan_placement(loads, ranks, redundant) == p  # deterministic: every rank computes the same


@settings(max_examples=150, deadline=None)
@given(problems())
def test_lpt_bound(problem):
    """Greedy LPT: no rank exceeds the mean by more than the heaviest replica."""
    loads, ranks, redundant = problem
    p = plan_placement(loads, ranks, redundant)
    counts = p.replica_counts()
    heaviest = max(w / c for w, c in zip(loads, counts))
    per_rank = rank_loads(p, loads)
    assert max(per_rank) <= sum(per_rank) / ranks + heaviest + 1e-6 * max(1.0, sum(loads))


@pytest.mark.parametrize("experts,ranks,redundant,s", [(64, 8, 8, 1.2), (256, 8, 32, 1.0), (8, 2, 2, 1.5),
                                                       (16, 4, 4, 0.8)])
def test_balance_improves_on_skewed_loads(experts, ranks, redundant, s):
    loads = zipf(experts, s)
    before = imbalance(uniform_placement(experts, ranks, redundant), loads)
    after = imbalance(plan_placement(loads, ranks, redundant), loads)
    assert before > 1.05 and after < before
    assert after < 1.1


def test_replicas_split_a_hot_expert():
    loads = [40.0] + [60.0 / 15] * 15  # one expert takes 40% of the tokens
    alone = plan_placement(loads, 4, 0)
    assert imbalance(alone, loads) >= 0.4 * 4 - 1e-9  # its rank carries all of it
    spread = plan_placement(loads, 4, 4)
    assert spread.replica_counts()[0] == 4  # capped at one copy per rank
    assert imbalance(spread, loads) < 1.1


def test_replicate_gives_slots_by_load_per_replica():
    assert replicate([100.0, 1.0, 50.0, 1.0], num_ranks=4, num_redundant=3) == [3, 1, 2, 1]
    assert replicate([5.0, 5.0], num_ranks=2, num_redundant=1) == [2, 1]  # ties: lower id


def test_uniform_placement_is_what_serving_starts_with():
    p = uniform_placement(8, 2, 2)
    assert p.replica_counts() == [2, 2, 1, 1, 1, 1, 1, 1] and p.slots_per_rank == 5


@pytest.mark.parametrize("experts,ranks,redundant,match", [
    (8, 3, 0, "features.parallel.eplb.num_redundant_experts=0: .* split evenly over features.parallel.ep=3"),
    (8, 2, 10, "at most 8"),
    (8, 2, -2, "must be >= 0"),
])
def test_bad_sizes_name_the_key(experts, ranks, redundant, match):
    with pytest.raises(ValueError, match=match):
        plan_placement([1.0] * experts, ranks, redundant)


def test_placement_rejects_a_missing_expert():
    with pytest.raises(ValueError, match="without a replica"):
        ExpertPlacement(4, 2, (0, 1, 2, 2))
    with pytest.raises(ValueError, match="must be >= 0"):
        plan_placement([1.0, -1.0], 2, 0)
