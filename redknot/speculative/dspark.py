"""Speculative decoding for the model runner: a drafter, the verify scheduler, the verifier.

The runner calls ``verify`` (its verifier hook) on steps that feed drafts and ``after_step``
after every step. ``after_step`` lets the drafter catch up with what the target kept and
draft (the DSpark stages: one block per request; the classic MTP layer: a chain), asks the
:class:`VerifyScheduler` how many drafts each request verifies, and hands those prefixes to the
engine scheduler through ``ModelRunnerOutput.draft_token_ids``; it feeds them next step and
rolls back what verification rejects. Which drafter runs is ``features.dspark.method`` (``auto``:
whatever the checkpoint carries).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from redknot.config.schema import BudgetSource, DraftMethod, VerificationMode
from redknot.models.family import DSPARK, MTP
from redknot.speculative.drafter import Draft, MTPDrafter
from redknot.speculative.metrics import SpecDecodeStats
from redknot.speculative.replay import CompactReplay
from redknot.speculative.schedule import CostModel, VerifyScheduler
from redknot.speculative.verifier import Verifier

# (req_id, position of the first draft, drafts) -> drafts to schedule instead (tests, experiments).
DraftHook = Callable[[str, int, List[int]], List[int]]


def pick_drafter(method: DraftMethod, draft_models: Mapping[str, Any]) -> Optional[str]:
    """The drafter kind ``method`` asks for, or None (plain decoding); ValueError when the
    checkpoint does not carry it."""
    method = DraftMethod(method)
    if method == DraftMethod.none:
        return None
    if method == DraftMethod.auto:
        return DSPARK if DSPARK in draft_models else (MTP if MTP in draft_models else None)
    kind = DSPARK if method == DraftMethod.dspark else MTP
    if kind not in draft_models:
        what = ("no DSpark drafter that its model family builds (either config.json states no DSpark stages "
                "- dspark_block_size, n_mtp_layers; tensors mtp.0.main_proj, mtp.*.markov_head - or the family "
                "has no DSpark drafting)" if kind == DSPARK
                else "no MTP layer (num_nextn_predict_layers=0; DSpark checkpoints keep their stages under "
                     "mtp.* instead)")
        raise ValueError(f"features.dspark.method={method.value} but the checkpoint has {what}; "
                         f"set features.dspark.method=auto or none")
    return kind


class DSparkSpeculator:
    """Drafter + verify scheduler + verifier + counters of ``features.dspark``."""

    def __init__(self, drafter, sampler, features, costs: Optional[CostModel] = None) -> None:
        cfg = features.dspark
        self.cfg = cfg
        self.drafter = drafter
        self.stats = SpecDecodeStats(max_draft=cfg.max_draft)
        self.verifier = Verifier(sampler, VerificationMode(cfg.verification), self.stats,
                                 probabilistic=getattr(drafter, "probabilistic", False))
        self.scheduler = VerifyScheduler(cfg.adaptive, BudgetSource(cfg.budget).value, cfg.budget_tokens,
                                         cfg.staleness, block=drafter.block_size, costs=costs)
        self.draft_hook: Optional[DraftHook] = None
        self.last_drafts: Dict[str, Draft] = {}
        self.last_lengths: Dict[str, int] = {}

    @property
    def needs_profile(self) -> bool:
        """Whether the engine must time verify steps at start (``budget=profile``)."""
        return self.cfg.adaptive and BudgetSource(self.cfg.budget) == BudgetSource.profile

    def set_costs(self, costs: CostModel) -> None:
        self.scheduler.costs = costs

    def use_draft_graphs(self, capture, max_num_seqs: int, padding_slot: int):
        """The DSpark drafter's block forward through CUDA graphs recorded with ``capture``
        (:class:`redknot.speculative.draft_graphs.DraftGraphs`) -> the graphs (None for a drafter without)."""
        use = getattr(self.drafter, "use_graphs", None)
        return use(capture, max_num_seqs, padding_slot) if use is not None else None

    def capture_draft_graphs(self, pool=None):
        """Capture the drafter's graphs in ``pool`` -> the pool (unchanged without draft graphs)."""
        capture = getattr(self.drafter, "capture_graphs", None)
        return capture(pool) if capture is not None else pool

    @classmethod
    def create(cls, draft_models: Mapping[str, Any], state, sampler, features, max_model_len: int,
               replay: Optional[CompactReplay] = None) -> Optional["DSparkSpeculator"]:
        """None when drafting is off (``features.dspark.method=none``, ``max_draft=0``, or ``auto``
        on a checkpoint without a drafter). ``draft_models``: the drafters the model family found
        in the checkpoint, by kind."""
        cfg = features.dspark
        if cfg.effective_max_draft <= 0:
            return None
        kind = pick_drafter(cfg.method, draft_models)
        if kind is None:
            return None
        if state.layout.max_backtrack < cfg.max_draft:
            raise ValueError(f"features.dspark.max_draft={cfg.max_draft} but the state rings were sized for "
                             f"{state.layout.max_backtrack} rolled-back tokens")
        if kind == MTP:
            drafter = MTPDrafter(draft_models[MTP], state, sampler, cfg.max_draft, max_model_len, replay)
        else:
            from redknot.speculative.dspark_drafter import DSparkDrafter
            drafter = DSparkDrafter(draft_models[DSPARK], state, sampler, features, max_model_len, replay)
        costs = None
        if cfg.adaptive and BudgetSource(cfg.budget) == BudgetSource.file:
            costs = CostModel.from_file(cfg.budget_file)
        return cls(drafter, sampler, features, costs)

    def verify(self, batch, logits: torch.Tensor) -> Dict[str, List[int]]:
        """Accepted drafts + one token per request with logits rows (runner's verifier hook)."""
        t0 = time.perf_counter()
        out = self.verifier(batch, logits)
        self.stats.verify_time_s += time.perf_counter() - t0
        return out

    def after_step(self, batch, streams: torch.Tensor, out, step_start: float) -> None:
        """Count the step, draft, schedule, put the next step's drafts into ``out.draft_token_ids``."""
        t0 = time.perf_counter()
        requests = batch.inputs.sched.requests
        if any(sr.num_logits for sr in requests):
            fed = sum(len(sr.draft_token_ids) for sr in requests)
            self.stats.record_step(fed > 0, t0 - step_start, fed)
        self._count_decode(batch, out.sampled_token_ids)
        self._record_outcomes(batch, out.sampled_token_ids)
        drafts = self.drafter.propose(batch, streams, out.sampled_token_ids)
        t1 = time.perf_counter()
        self.stats.draft_time_s += t1 - t0
        lengths = self._schedule(batch, drafts)
        self.stats.schedule_time_s += time.perf_counter() - t1
        self.verifier.draft_probs = {r: (tuple(d.token_ids), d.probs) for r, d in drafts.items()
                                     if d.probs is not None}
        for req_id, d in drafts.items():
            d.token_ids = d.token_ids[:lengths.get(req_id, 0)]
            if self.draft_hook is not None:
                d.token_ids = [int(t) for t in self.draft_hook(req_id, d.first_position, list(d.token_ids))]
        out.draft_token_ids = {r: list(d.token_ids) for r, d in drafts.items() if d.token_ids}
        self.last_drafts, self.last_lengths = drafts, lengths
        self.stats.num_drafted = self.drafter.num_drafted
        self.stats.num_mtp_rows = self.drafter.num_mtp_rows
        self.stats.num_draft_steps = self.drafter.num_steps

    def _schedule(self, batch, drafts: Dict[str, Draft]) -> Dict[str, int]:
        if not drafts:
            return {}
        confidences = {r: list(d.confidences) for r, d in drafts.items()}
        limits = {r: d.limit for r, d in drafts.items()}
        lengths = self.scheduler.lengths(confidences, limits, num_sampling=len(drafts), num_base_tokens=len(drafts))
        self.stats.record_schedule(self.scheduler.last_budget)
        return lengths

    def _record_outcomes(self, batch, sampled: Dict[str, List[int]]) -> None:
        """Realised acceptance of the drafts verified this step, against the survival the
        scheduler expected for them (calibration)."""
        for sr in batch.inputs.sched.requests:
            tokens = sampled.get(sr.req_id)
            prev = self.last_drafts.get(sr.req_id)
            if not sr.draft_token_ids or not tokens or prev is None:
                continue
            self.stats.record_calibration(prev.confidences[:len(sr.draft_token_ids)])

    def _count_decode(self, batch, sampled: Dict[str, List[int]]) -> None:
        """Decode request-steps (the request's last token fed, its first output already out)."""
        row = 0
        for sr in batch.inputs.sched.requests:
            tokens = sampled.get(sr.req_id)
            if sr.num_logits and tokens and sr.start_pos + 1 == sr.seq_len and batch.rows[row].output_index > 0:
                self.stats.num_decode_request_steps += 1
                self.stats.num_decode_tokens += len(tokens)
            row += sr.num_logits
