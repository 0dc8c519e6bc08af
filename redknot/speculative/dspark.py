"""DSpark: speculative decoding with the MTP layer, for the model runner.

The runner calls ``verify`` (its verifier hook) on steps that feed drafts and
``after_step`` after every step; ``after_step`` catches the MTP layer up,
drafts, and hands the confidence-scheduled drafts to the scheduler through
``ModelRunnerOutput.draft_token_ids``. The scheduler feeds them next step and
rolls back what verification rejects.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from redknot.config.schema import DraftMethod, VerificationMode
from redknot.models.family import MTP
from redknot.speculative.drafter import Draft, MTPDrafter
from redknot.speculative.metrics import SpecDecodeStats
from redknot.speculative.replay import CompactReplay
from redknot.speculative.verifier import Verifier

# (req_id, position of the first draft, drafts) -> drafts to schedule instead (tests, experiments).
DraftHook = Callable[[str, int, List[int]], List[int]]


class DSpark:
    """Drafter + verifier + counters of ``features.dspark`` (see the module docstring)."""

    def __init__(self, model, state, sampler, features, max_model_len: int,
                 replay: Optional[CompactReplay] = None) -> None:
        cfg = features.dspark
        self.stats = SpecDecodeStats(max_draft=cfg.max_draft)
        self.drafter = MTPDrafter(model, state, sampler, cfg.max_draft, 0.0, False,
                                  greedy_confidence=False, max_model_len=max_model_len, replay=replay)
        self.verifier = Verifier(sampler, VerificationMode(cfg.verification), self.stats)
        self.device = model.device
        self.draft_hook: Optional[DraftHook] = None
        self.last_drafts: Dict[str, Draft] = {}

    @classmethod
    def create(cls, draft_models: Mapping[str, Any], state, sampler, features, max_model_len: int,
               replay: Optional[CompactReplay] = None) -> Optional["DSpark"]:
        """None when drafting is off (``features.dspark.method=none`` or ``max_draft=0``, or ``auto``
        on a checkpoint without a drafter). ``draft_models``: the drafters the model family found in
        the checkpoint, by kind."""
        cfg = features.dspark
        if cfg.effective_max_draft <= 0:
            return None
        method = DraftMethod(cfg.method)
        if method == DraftMethod.auto and not draft_models:
            return None
        model = draft_models.get(MTP) if method in (DraftMethod.auto, DraftMethod.mtp) else None
        if model is None:
            what = ("no DSpark draft stages (mtp.0.main_proj, mtp.2.markov_head, ...)" if method == DraftMethod.dspark
                    else "no MTP layer (num_nextn_predict_layers=0)")
            raise ValueError(f"features.dspark.method={method.value} but the checkpoint has {what}; "
                             f"set features.dspark.method=auto or none")
        if state.layout.max_backtrack < cfg.max_draft:
            raise ValueError(f"features.dspark.max_draft={cfg.max_draft} but the state rings were sized for "
                             f"{state.layout.max_backtrack} rolled-back tokens")
        return cls(model, state, sampler, features, max_model_len, replay)

    def verify(self, batch, logits: torch.Tensor) -> Dict[str, List[int]]:
        """Accepted drafts + one token per request with logits rows (runner's verifier hook)."""
        return self.verifier(batch, logits)

    def after_step(self, batch, streams: torch.Tensor, out, step_start: float) -> None:
        """Count the step, run the MTP, put the next step's drafts into ``out.draft_token_ids``."""
        t0 = time.perf_counter()
        requests = batch.inputs.sched.requests
        if any(sr.num_logits for sr in requests):
            self.stats.record_step(any(sr.draft_token_ids for sr in requests), t0 - step_start)
        self._count_decode(batch, out.sampled_token_ids)
        drafts = self.drafter.propose(batch, streams, out.sampled_token_ids)
        if self.draft_hook is not None:
            for req_id, d in drafts.items():
                d.token_ids = [int(t) for t in self.draft_hook(req_id, d.first_position, list(d.token_ids))]
        out.draft_token_ids = {r: list(d.token_ids) for r, d in drafts.items() if d.token_ids}
        self.last_drafts = drafts
        self.stats.num_drafted = self.drafter.num_drafted
        self.stats.num_mtp_rows = self.drafter.num_mtp_rows
        self.stats.num_draft_steps = self.drafter.num_steps
        self.stats.draft_time_s += time.perf_counter() - t0

    def _count_decode(self, batch, sampled: Dict[str, List[int]]) -> None:
        """Decode request-steps (the request's last token fed, its first output already out)."""
        row = 0
        for sr in batch.inputs.sched.requests:
            tokens = sampled.get(sr.req_id)
            if sr.num_logits and tokens and sr.start_pos + 1 == sr.seq_len and batch.rows[row].output_index > 0:
                self.stats.num_decode_request_steps += 1
                self.stats.num_decode_tokens += len(tokens)
            row += sr.num_logits
