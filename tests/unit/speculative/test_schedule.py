"""Confidence-scheduled verification on synthetic confidences and cost tables: the budget
maximises expected emitted tokens per millisecond, the cost table is a step function up to the
capture limit, allocation is a prefix-shaped, value-independent global top-B, the budget reads
only stale confidences."""
import itertools
import json
import random

import pytest

from redknot.speculative.schedule import (CostModel, CostTable, StaleConfidences, VerifyScheduler, allocate,
                                          choose_budget, profile_costs, profile_sizes, survivals)


def flat_costs(verify, draft=None, limit=None):
    return CostModel(CostTable(verify, limit), CostTable(draft or {1: 0.0}))


def test_cost_table_steps_up_to_the_capture_limit_then_interpolates():
    t = CostTable({1: 2.0, 2: 3.0, 4: 5.0, 8: 9.0, 16: 20.0}, capture_limit=8)
    assert [t(n) for n in (1, 2, 3, 4, 5, 8)] == [2.0, 3.0, 5.0, 5.0, 9.0, 9.0]  # padded to the next graph
    assert t(12) == pytest.approx(9.0 + 11.0 * 4 / 8)  # eager above the limit: linear
    assert t(32) == pytest.approx(20.0 + 11.0 * 16 / 8)  # extrapolated from the last segment
    assert CostTable({1: 5.0, 2: 3.0})(2) == 5.0  # made non-decreasing
    with pytest.raises(ValueError):
        CostTable({})


def test_a_cost_jump_stops_the_budget():
    # one request, stale survivals 0.9, 0.72, 0.36; verify 1+B tokens; 3 tokens cost 100x
    costs = flat_costs({1: 1.0, 2: 1.0, 3: 100.0, 4: 100.0})
    assert choose_budget([survivals([0.9, 0.8, 0.5])], num_sampling=1, num_base_tokens=1, num_requests=1,
                         costs=costs) == 1
    flat = flat_costs({1: 1.0, 4: 1.0})  # free drafts: verify every slot with positive survival
    assert choose_budget([survivals([0.9, 0.8, 0.5])], num_sampling=1, num_base_tokens=1, num_requests=1,
                         costs=flat) == 3
    assert choose_budget([[0.0, 0.0]], num_sampling=1, num_base_tokens=1, num_requests=1, costs=flat) == 0


def test_budget_is_the_argmax_of_tokens_per_ms():
    rng = random.Random(0)
    for _ in range(200):
        reqs = rng.randint(1, 4)
        surv = [survivals([rng.random() for _ in range(5)]) for _ in range(reqs)]
        points = {n: rng.uniform(1, 3) * n ** rng.uniform(0.2, 1.0) for n in (1, 2, 4, 8, 16, 32)}
        costs = flat_costs(points, {1: 0.5, 2: 0.6, 4: 0.8}, limit=16)
        b = choose_budget(surv, num_sampling=reqs, num_base_tokens=reqs, num_requests=reqs, costs=costs)
        ranked = sorted((s for row in surv for s in row if s > 0), reverse=True)
        values = [(reqs + sum(ranked[:k])) / (costs.draft(reqs) + costs.verify(reqs + k))
                  for k in range(len(ranked) + 1)]
        assert values[b] == max(values) and b == values.index(max(values))


def test_allocation_is_a_prefix_shaped_top_b_with_value_independent_ties():
    tied = [[0.5, 0.5, 0.5], [0.5, 0.5]]
    assert allocate(tied, 3) == [2, 1]  # (0.5, pos 0, req 0), (0.5, pos 0, req 1), (0.5, pos 1, req 0)
    assert allocate(tied, 5) == [3, 2] and allocate(tied, 9) == [3, 2]
    assert allocate([[0.9, 0.0], [0.3]], 5) == [1, 1]  # zero survival never admitted
    assert allocate([[0.9, 0.8, 0.7], [0.95]], 3, caps=[1, 1]) == [1, 1]
    rng = random.Random(1)
    for _ in range(300):
        surv = [survivals([rng.choice([1.0, 0.5, 0.9, 0.0]) for _ in range(5)]) for _ in range(rng.randint(1, 4))]
        budget = rng.randint(0, 12)
        lengths = allocate(surv, budget)
        chosen = sorted(((-s, j, r) for r, row in enumerate(surv) for j, s in enumerate(row) if s > 0))[:budget]
        assert sum(lengths) == len(chosen)
        for r, n in enumerate(lengths):  # each request's admitted slots are exactly its first n
            assert sorted(j for _, j, rr in chosen if rr == r) == list(range(n))


def test_stale_confidences_lag_by_the_configured_steps():
    for staleness in (1, 2):
        stale = StaleConfidences(staleness, block=3)
        seen = []
        for step in range(4):
            seen.append(stale.get("a"))
            stale.publish({"a": [step / 10] * 3})
        assert seen[:staleness] == [[1.0] * 3] * staleness  # nothing old enough yet: survival 1
        assert seen[staleness] == [0.0] * 3 and seen[3] == [(3 - staleness) / 10] * 3
    with pytest.raises(ValueError, match="staleness=3"):
        StaleConfidences(3, 5)


def test_the_budget_reads_only_stale_confidences_and_ranks_are_deterministic():
    costs = flat_costs({1: 1.0, 2: 1.1, 3: 1.2, 4: 5.0, 8: 9.0, 16: 17.0})
    limits = {"a": 5, "b": 5}

    def run(order, current):
        sched = VerifyScheduler(True, "profile", 0, staleness=1, block=5, costs=costs)
        sched.lengths({"a": [0.9] * 5, "b": [0.2] * 5}, limits, 2, 2)  # published: next step's stale values
        drafts = {r: current[r] for r in order}
        return sched.lengths(drafts, limits, 2, 2), sched.last_budget
    first = run(["a", "b"], {"a": [0.9] * 5, "b": [0.9] * 5})
    assert run(["b", "a"], {"a": [0.9] * 5, "b": [0.9] * 5}) == first  # request order does not matter
    other = run(["a", "b"], {"a": [0.1] * 5, "b": [0.99] * 5})
    assert other[1] == first[1]  # same stale values, same budget, whatever the current drafts say
    assert sum(other[0].values()) == sum(first[0].values()) == first[1]


def test_fixed_budget_and_verify_all():
    sched = VerifyScheduler(True, "fixed", 3, staleness=2, block=5)
    assert sched.lengths({"a": [0.9, 0.9], "b": [0.5] * 5}, {"a": 2, "b": 4}, 2, 2) == {"a": 2, "b": 1}
    off = VerifyScheduler(False, "profile", 0, staleness=2, block=5)
    assert off.lengths({"a": [0.0] * 5}, {"a": 4}, 1, 1) == {"a": 4}


def test_cost_file_round_trip_and_errors(tmp_path):
    costs = flat_costs({1: 1.0, 8: 2.0}, {1: 0.3}, limit=8)
    path = tmp_path / "costs.json"
    path.write_text(costs.to_json())
    again = CostModel.from_file(str(path))
    assert again.verify(5) == 2.0 and again.draft(1) == 0.3 and again.verify.capture_limit == 8
    path.write_text(json.dumps({"verify": {}}))
    with pytest.raises(ValueError, match="features.dspark.budget_file=.*not a cost table"):
        CostModel.from_file(str(path))


def test_profiling_keeps_the_median_and_sizes_cover_the_decode_shapes():
    calls = itertools.count()
    timings = profile_costs(lambda n: [5.0, 1.0, 3.0, 2.0, 4.0][next(calls) % 5] * n, [1, 2], repeats=5)
    assert timings == {1: 3.0, 2: 6.0}
    sizes = profile_sizes(max_num_seqs=4, max_draft=5, max_tokens=4096)
    assert sizes[0] == 1 and sizes[-1] == 24 and sizes == sorted(set(sizes))
