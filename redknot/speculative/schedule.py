"""Confidence-scheduled verification (reference dspark.md §4): how many drafts each request
verifies this step (pure Python).

Each draft slot k of a request carries a confidence c_k, the chance that draft k survives
given that drafts 1..k-1 did; its survival a_k = c_1 ... c_k. Per step:

1. **Budget** B from *stale* confidences (one or two steps old, ``features.dspark.staleness``)
   and a cost table: B maximises expected emitted tokens per unit time,
   ``(num_sampling + sum of the B largest stale survivals) / (draft_ms(R) + verify_ms(T + B))``,
   over every B (no early stop: the budget does not depend on this step's drafts).
2. **Allocation**: the global top-B slots by *current* survival, ties ordered by position then
   request (value-independent), so each request verifies a prefix and every rank picks the same
   slots. Slots with survival 0 are never admitted.

Losslessness (§3.4): the decision to verify slot k may depend on the drafts before it and on
other requests, never on draft k itself. DSpark's confidence of slot k reads the hidden state of
position k and the *previous* token, so survivals qualify; B reads older steps only.
"""
from __future__ import annotations

import bisect
import json
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence


def survivals(confidences: Sequence[float]) -> List[float]:
    """a_k = c_1 ... c_k for every slot."""
    out, acc = [], 1.0
    for c in confidences:
        acc *= float(c)
        out.append(acc)
    return out


def allocate(survival: Sequence[Sequence[float]], budget: int, caps: Optional[Sequence[int]] = None) -> List[int]:
    """Drafts each request verifies: the top-``budget`` slots over all requests by survival
    (desc), then position (asc), then request (asc); at most ``caps[r]`` slots of request r."""
    slots = []
    for r, surv in enumerate(survival):
        cap = len(surv) if caps is None else min(len(surv), caps[r])
        slots.extend((-float(s), j, r) for j, s in enumerate(surv[:cap]) if s > 0)
    slots.sort()
    lengths = [0] * len(survival)
    for _, _, r in slots[:max(0, budget)]:
        lengths[r] += 1
    return lengths


class CostTable:
    """Milliseconds of a step as a function of a size (verify: target tokens; draft: requests).

    Up to ``capture_limit`` (the largest captured graph size) the cost of n is the cost of the
    smallest measured size >= n, since a graph pads to its captured size; above it, linear
    interpolation between the measured points, extrapolated past the last one. Costs are made
    non-decreasing first (a running maximum), so noise never makes more work look cheaper.
    """

    def __init__(self, points: Mapping[int, float], capture_limit: Optional[int] = None) -> None:
        if not points:
            raise ValueError("a cost table needs at least one (size, ms) point")
        sizes = sorted(int(n) for n in points)
        if sizes[0] < 1 or any(float(points[n]) < 0 for n in points):
            raise ValueError(f"cost table sizes must be >= 1 and costs >= 0; got {dict(points)}")
        costs, best = [], 0.0
        for n in sizes:
            best = max(best, float(points[n]))
            costs.append(best)
        self.sizes, self.costs = sizes, costs
        self.capture_limit = sizes[-1] if capture_limit is None else int(capture_limit)

    def __call__(self, n: int) -> float:
        sizes, costs = self.sizes, self.costs
        i = bisect.bisect_left(sizes, n)
        if n <= self.capture_limit and i < len(sizes) and sizes[i] <= self.capture_limit:
            return costs[i]  # padded up to the next captured size
        if len(sizes) == 1:
            return costs[0] * max(1.0, n / sizes[0])
        j = min(max(i, 1), len(sizes) - 1)  # segment [j-1, j]; past the end: the last segment
        x0, x1, y0, y1 = sizes[j - 1], sizes[j], costs[j - 1], costs[j]
        return max(y0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))

    def to_dict(self) -> Dict[str, float]:
        return {str(n): c for n, c in zip(self.sizes, self.costs)}


@dataclass
class CostModel:
    """Verify cost by target tokens and draft cost by requests (``features.dspark.budget``)."""
    verify: CostTable
    draft: CostTable

    @classmethod
    def from_file(cls, path: str) -> "CostModel":
        """``{"verify_ms": {"tokens": ms, ...}, "draft_ms": {"requests": ms, ...}, "capture_limit": n}``."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            verify = {int(k): float(v) for k, v in data["verify_ms"].items()}
            draft = {int(k): float(v) for k, v in data.get("draft_ms", {"1": 0.0}).items()}
            limit = data.get("capture_limit")
            return cls(CostTable(verify, limit), CostTable(draft))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"features.dspark.budget_file={path}: not a cost table ({err}); expected JSON "
                             f'{{"verify_ms": {{"tokens": ms}}, "draft_ms": {{"requests": ms}}}}') from err

    def to_json(self) -> str:
        return json.dumps({"verify_ms": self.verify.to_dict(), "draft_ms": self.draft.to_dict(),
                           "capture_limit": self.verify.capture_limit})


def profile_costs(time_ms: Callable[[int], float], sizes: Iterable[int], repeats: int = 5) -> Dict[int, float]:
    """{size: median of ``repeats`` timings of ``time_ms(size)``} (startup profiling)."""
    return {int(n): statistics.median(time_ms(int(n)) for _ in range(repeats)) for n in sizes}


def profile_sizes(max_num_seqs: int, max_draft: int, max_tokens: int, coarse: bool = False) -> List[int]:
    """Target-token counts a decode step with drafts can have, as captured tiers: powers of two
    and their 1.5x up to ``max_num_seqs * (max_draft + 1)`` (capped at ``max_tokens``); ``coarse``:
    powers of four only (eager steps, no captured tiers: the table interpolates between them)."""
    top = min(max_tokens, max_num_seqs * (max_draft + 1))
    sizes, n = set(), 1
    while n < top:
        sizes.add(n)
        if not coarse and n * 3 // 2 < top and n >= 2:
            sizes.add(n * 3 // 2)
        n *= 4 if coarse else 2
    sizes.add(top)
    return sorted(sizes)


def choose_budget(stale_survival: Sequence[Sequence[float]], *, num_sampling: int, num_base_tokens: int,
                  num_requests: int, costs: CostModel, max_budget: Optional[int] = None) -> int:
    """B maximising (num_sampling + sum of the B largest survivals) / (draft_ms + verify_ms(T + B)),
    the smallest such B on ties; ``stale_survival``: per request, survivals of its schedulable slots."""
    flat = sorted((float(s) for surv in stale_survival for s in surv if s > 0), reverse=True)
    if max_budget is not None:
        flat = flat[:max(0, max_budget)]
    draft_ms = costs.draft(max(1, num_requests)) if num_requests else 0.0
    best_b, best, gain = 0, None, float(num_sampling)
    for b in range(len(flat) + 1):
        if b:
            gain += flat[b - 1]
        ms = draft_ms + costs.verify(num_base_tokens + b)
        value = gain / ms if ms > 0 else (float("inf") if gain > 0 else 0.0)
        if best is None or value > best:
            best_b, best = b, value
    return best_b


class StaleConfidences:
    """Each request's confidences as published ``staleness`` steps ago (new requests: 1.0)."""

    def __init__(self, staleness: int, block: int) -> None:
        if staleness not in (1, 2):
            raise ValueError(f"features.dspark.staleness={staleness}: must be 1 or 2")
        self.staleness, self.block = staleness, block
        self._history: List[Dict[str, List[float]]] = []

    def publish(self, confidences: Mapping[str, Sequence[float]]) -> None:
        self._history.append({r: list(c) for r, c in confidences.items()})
        del self._history[:-self.staleness]

    def get(self, req_id: str) -> List[float]:
        if len(self._history) < self.staleness:
            return [1.0] * self.block
        return list(self._history[0].get(req_id, [1.0] * self.block))


def draft_limit(max_draft: int, num_outputs_after: int, max_tokens: int, next_position: int,
                max_model_len: int) -> int:
    """Drafts worth verifying in the next step of a request that will have ``num_outputs_after``
    output tokens and feed its last token at ``next_position``: the verify step emits the
    accepted drafts plus one token, which must fit in ``max_tokens`` and ``max_model_len``."""
    by_tokens = max_tokens - num_outputs_after - 1
    by_length = max_model_len - 2 - next_position
    return max(0, min(max_draft, by_tokens, by_length))


class VerifyScheduler:
    """Per step: every drafting request's verify length (``features.dspark.adaptive``, ``budget``,
    ``staleness``); see the module docstring. ``costs`` is needed for budget=profile|file."""

    def __init__(self, adaptive: bool, budget: str, budget_tokens: int, staleness: int, block: int,
                 costs: Optional[CostModel] = None) -> None:
        self.adaptive, self.budget, self.budget_tokens = adaptive, budget, budget_tokens
        self.stale = StaleConfidences(staleness, block)
        self.costs = costs
        self.last_budget = 0

    def lengths(self, drafts: Mapping[str, Sequence[float]], limits: Mapping[str, int], num_sampling: int,
                num_base_tokens: int) -> Dict[str, int]:
        """{req_id: drafts to verify}: ``drafts`` maps each request to its current confidences,
        ``limits`` to the drafts it may verify; ``num_base_tokens``: target tokens fed anyway."""
        order = sorted(drafts)
        caps = [min(limits[r], len(drafts[r])) for r in order]
        if not self.adaptive:
            self.last_budget = sum(caps)
            return dict(zip(order, caps))
        if self.budget == "fixed":
            budget = self.budget_tokens
        else:
            if self.costs is None:
                raise RuntimeError("confidence scheduling needs a cost table (features.dspark.budget)")
            stale = [survivals(self.stale.get(r))[:cap] for r, cap in zip(order, caps)]
            budget = choose_budget(stale, num_sampling=num_sampling, num_base_tokens=num_base_tokens,
                                   num_requests=len(order), costs=self.costs)
        self.stale.publish(drafts)
        self.last_budget = budget
        current = [survivals(drafts[r]) for r in order]
        return dict(zip(order, allocate(current, budget, caps)))
