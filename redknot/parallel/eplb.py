"""Expert-parallel load balancing (EPLB): where each MoE layer's experts live (pure Python).

A layer has ``E`` logical experts and ``E + R`` physical slots, ``S = (E + R) / N``
on each of the ``N`` ranks of an expert-parallel group. From the tokens each
expert received (the load recorded while serving), a placement is made in two
greedy passes:

1. **replication** — the ``R`` redundant slots go one at a time to the expert
   with the highest load per replica (ties: lower id), so the hottest experts
   are split over several ranks; no expert gets more replicas than there are
   ranks, and every expert keeps at least one;
2. **packing** — replicas, heaviest first (weight = load / replicas), go to the
   least-loaded rank that still has a free slot and does not hold that expert
   yet (longest-processing-time-first bin packing).

The dispatcher spreads an expert's tokens evenly over its replicas, so a rank's
expected load is the sum of its replicas' weights. Everything is deterministic:
every rank computes the same placement from the same (all-reduced) load.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import List, Sequence, Tuple

REDUNDANT_KEY = "features.parallel.eplb.num_redundant_experts"


@dataclass(frozen=True)
class ExpertPlacement:
    """Physical slot ``p`` (on rank ``p // slots_per_rank``) holds logical expert ``phys_to_logical[p]``."""
    num_logical: int
    num_ranks: int
    phys_to_logical: Tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.phys_to_logical) % self.num_ranks:
            raise ValueError(f"{len(self.phys_to_logical)} slots do not split evenly over {self.num_ranks} ranks")
        missing = sorted(set(range(self.num_logical)) - set(self.phys_to_logical))
        if missing:
            raise ValueError(f"placement leaves logical experts {missing[:8]} without a replica")
        if any(not 0 <= e < self.num_logical for e in self.phys_to_logical):
            raise ValueError(f"placement names experts outside [0, {self.num_logical})")

    @property
    def num_physical(self) -> int:
        return len(self.phys_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.num_ranks

    def rank_experts(self, rank: int) -> Tuple[int, ...]:
        """Logical expert of each of ``rank``'s slots, in slot order."""
        s = self.slots_per_rank
        return self.phys_to_logical[rank * s:(rank + 1) * s]

    def replicas(self) -> List[List[int]]:
        """For each logical expert, its physical slots (ascending)."""
        out: List[List[int]] = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.phys_to_logical):
            out[e].append(p)
        return out

    def replica_counts(self) -> List[int]:
        return [len(r) for r in self.replicas()]


def check_sizes(num_logical: int, num_ranks: int, num_redundant: int) -> None:
    """Raise ValueError naming the config key when the slots cannot be laid out."""
    if num_ranks < 1:
        raise ValueError(f"features.parallel.ep={num_ranks}: must be >= 1")
    if num_redundant < 0:
        raise ValueError(f"{REDUNDANT_KEY}={num_redundant}: must be >= 0")
    if (num_logical + num_redundant) % num_ranks:
        ok = [r for r in range(0, 2 * num_ranks) if (num_logical + r) % num_ranks == 0][:3]
        raise ValueError(f"{REDUNDANT_KEY}={num_redundant}: the model's {num_logical} experts plus the redundant "
                         f"ones must split evenly over features.parallel.ep={num_ranks} ranks "
                         f"(e.g. {REDUNDANT_KEY} in {ok})")
    if num_redundant > num_logical * (num_ranks - 1):
        raise ValueError(f"{REDUNDANT_KEY}={num_redundant}: at most {num_logical * (num_ranks - 1)} "
                         f"({num_logical} experts x {num_ranks - 1} extra ranks); more replicas than ranks is useless")


def replicate(load: Sequence[float], num_ranks: int, num_redundant: int) -> List[int]:
    """Replica count per logical expert: each redundant slot to the highest load per replica."""
    counts = [1] * len(load)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(num_redundant):
        while True:
            _, e = heapq.heappop(heap)
            if counts[e] < num_ranks:
                break
        counts[e] += 1
        if counts[e] < num_ranks:
            heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def pack(load: Sequence[float], counts: Sequence[int], num_ranks: int) -> Tuple[int, ...]:
    """Longest-processing-time-first packing of the replicas onto ranks with equal slot counts."""
    slots = sum(counts) // num_ranks
    items = sorted(((float(load[e]) / c, e) for e, c in enumerate(counts) for _ in range(c)),
                   key=lambda it: (-it[0], it[1]))
    rank_load = [0.0] * num_ranks
    held: List[List[int]] = [[] for _ in range(num_ranks)]
    for weight, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free  # a second copy on one rank only if forced
        r = min(fresh, key=lambda q: (rank_load[q], q))
        held[r].append(e)
        rank_load[r] += weight
    return tuple(e for r in range(num_ranks) for e in sorted(held[r]))


def plan_placement(load: Sequence[float], num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """The placement of one layer from its per-expert load (token counts)."""
    check_sizes(len(load), num_ranks, num_redundant)
    if any(w < 0 for w in load):
        raise ValueError("expert loads must be >= 0")
    counts = replicate(load, num_ranks, num_redundant)
    return ExpertPlacement(len(load), num_ranks, pack(load, counts, num_ranks))


def uniform_placement(num_logical: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """The placement before any load is known: :func:`plan_placement` of equal loads (the redundant
    slots replicate the lowest expert ids; experts are dealt round-robin over the ranks)."""
    return plan_placement([1.0] * num_logical, num_ranks, num_redundant)


def rank_loads(placement: ExpertPlacement, load: Sequence[float]) -> List[float]:
    """Expected load of each rank when an expert's tokens are spread evenly over its replicas."""
    counts = placement.replica_counts()
    out = [0.0] * placement.num_ranks
    for p, e in enumerate(placement.phys_to_logical):
        out[p // placement.slots_per_rank] += float(load[e]) / counts[e]
    return out


def imbalance(placement: ExpertPlacement, load: Sequence[float]) -> float:
    """max / mean of the ranks' expected loads (1.0 = perfectly balanced; 1.0 for no load)."""
    loads = rank_loads(placement, load)
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
