"""Counters of speculative decoding, reported through ``EngineStats.spec`` (pure Python)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class SpecDecodeStats:
    """What DSpark did since the engine started.

    A *decode request-step* is one request's share of a step that feeds its last
    token (plus any drafts): it emits the accepted drafts plus one token.
    ``mean_accept_len`` is the tokens emitted per decode request-step (1.0 =
    no gain); per-position acceptance is the fraction of drafts verified at
    position j (1-based) that were accepted. Step times are host wall-clock
    after device synchronisation: forward + sampling/verification of steps that
    verified drafts (``verify_step_time_s``) or did not (``plain_step_time_s``),
    the drafter's work after sampling (``draft_time_s``: catch-up + drafts), the
    verification math (``verify_time_s``) and the verify scheduler
    (``schedule_time_s``). Calibration: per position, the survival the scheduler
    expected for each verified draft (``expected_per_position``, summed) against
    whether it was accepted (``accepted_per_position``).
    """
    max_draft: int = 0
    num_verify_steps: int = 0
    num_plain_steps: int = 0
    num_draft_steps: int = 0
    num_decode_request_steps: int = 0
    num_decode_tokens: int = 0
    num_drafted: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    num_mtp_rows: int = 0
    verified_per_position: List[int] = field(default_factory=list)
    accepted_per_position: List[int] = field(default_factory=list)
    expected_per_position: List[float] = field(default_factory=list)
    num_verified_tokens: int = 0      # drafts fed to verify steps
    num_budget_steps: int = 0
    budget_total: int = 0             # sum of the per-step verify budgets B
    verify_step_time_s: float = 0.0
    plain_step_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    schedule_time_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.verified_per_position:
            self.verified_per_position = [0] * self.max_draft
            self.accepted_per_position = [0] * self.max_draft
        if not self.expected_per_position:
            self.expected_per_position = [0.0] * self.max_draft

    # ------------------------------------------------------------------ recording
    def record_verify(self, num_verified: int, num_accepted: int) -> None:
        self.num_proposed += num_verified
        self.num_accepted += num_accepted
        for j in range(num_verified):
            self.verified_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    def record_calibration(self, confidences) -> None:
        """Expected survival (cumulative product of the confidences) of each verified draft."""
        surv = 1.0
        for j, c in enumerate(confidences[:self.max_draft]):
            surv *= float(c)
            self.expected_per_position[j] += surv

    def record_schedule(self, budget: int) -> None:
        self.num_budget_steps += 1
        self.budget_total += int(budget)

    def record_step(self, verified: bool, seconds: float, num_fed: int = 0) -> None:
        self.num_verified_tokens += num_fed
        if verified:
            self.num_verify_steps += 1
            self.verify_step_time_s += seconds
        else:
            self.num_plain_steps += 1
            self.plain_step_time_s += seconds

    # ------------------------------------------------------------------ derived
    @property
    def mean_accept_len(self) -> float:
        return self.num_decode_tokens / self.num_decode_request_steps if self.num_decode_request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    def acceptance_by_position(self) -> List[float]:
        return [a / v if v else 0.0 for a, v in zip(self.accepted_per_position, self.verified_per_position)]

    def expected_by_position(self) -> List[float]:
        """Mean survival the scheduler expected for drafts verified at position j."""
        return [e / v if v else 0.0 for e, v in zip(self.expected_per_position, self.verified_per_position)]

    def survival_by_position(self) -> List[float]:
        """Fraction of drafts verified at position j that survived (1..j all accepted)."""
        return self.acceptance_by_position()

    def as_metrics(self, prefix: str = "spec.") -> Dict[str, float]:
        """Flat numbers for a metrics store (MLflow): acceptance, per-position acceptance, step times."""
        def per(total: float, n: int) -> float:
            return total / n if n else 0.0
        out = {
            "mean_accept_len": self.mean_accept_len, "acceptance_rate": self.acceptance_rate,
            "num_proposed": float(self.num_proposed), "num_accepted": float(self.num_accepted),
            "num_verify_steps": float(self.num_verify_steps), "num_plain_steps": float(self.num_plain_steps),
            "verify_step_ms": 1e3 * per(self.verify_step_time_s, self.num_verify_steps),
            "plain_step_ms": 1e3 * per(self.plain_step_time_s, self.num_plain_steps),
            "draft_ms_per_step": 1e3 * per(self.draft_time_s, self.num_draft_steps),
            "verify_ms_per_step": 1e3 * per(self.verify_time_s, self.num_verify_steps),
            "schedule_ms_per_step": 1e3 * per(self.schedule_time_s, self.num_budget_steps),
            "verified_tokens_per_step": per(self.num_verified_tokens, self.num_verify_steps),
            "budget_mean": per(self.budget_total, self.num_budget_steps),
        }
        for j, rate in enumerate(self.acceptance_by_position(), start=1):
            out[f"acceptance.pos{j}"] = rate
        for j, expected in enumerate(self.expected_by_position(), start=1):
            out[f"expected_survival.pos{j}"] = expected
        for j, realised in enumerate(self.survival_by_position(), start=1):
            out[f"realised_survival.pos{j}"] = realised
        return {prefix + k: float(v) for k, v in out.items()}

    def snapshot(self) -> "SpecDecodeStats":
        return dataclasses.replace(self, verified_per_position=list(self.verified_per_position),
                                   accepted_per_position=list(self.accepted_per_position),
                                   expected_per_position=list(self.expected_per_position))
