"""The DSpark draft's block forward in CUDA graphs, one graph per batch tier.

Drafting runs after every target step: one non-causal forward of the stages over each drafting
request's block (``forward_block``: anchors, positions, the stages' rings, slots -> pre-norm rows
h [B, g, D] and base logits [B, g, V]). Eagerly that is hundreds of small kernel launches per step
(an eager drafting step took 86 ms at batch 1 on the H200's V4.1 cut); replayed from a captured graph
it is one launch. The block forward reads the rings and writes nothing, so a graph needs only three static
buffers (anchors, positions, slots); a step of B requests fills the first B entries and runs the
smallest captured tier >= B, the padding rows drafting an anchor 0 at position 0 on the engine's
spare slot (read only; their outputs are dropped). The Markov chain, drafting-time sampling and
the confidences stay eager: they are per-request host logic over the graph's outputs. Each tier
keeps its outputs in the graph pool (base logits are fp32 [tier, g, V]: 0.66 GB at tier 256 with
V = 129280), next to the verify graphs' logits.

The first replay of every tier is checked (:meth:`DraftGraphs._check`) against the same padded
call run eagerly: a difference is a capture fault (a value baked in at capture, a buffer reused)
and turns the graphs off (drafting runs eagerly, ``status`` says why). The padded call is also
compared with the unpadded eager call: padding rows change the row count of the draft's GEMMs, so
the real rows may round differently; that difference is reported, not a fault (a draft only has to
be the distribution its tokens are drawn from, and the tokens are drawn from the replay's logits).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)


def draft_tiers(max_num_seqs: int) -> List[int]:
    """Captured batch tiers: powers of two below ``max_num_seqs``, and ``max_num_seqs`` itself."""
    tiers, n = {max(1, max_num_seqs)}, 1
    while n < max_num_seqs:
        tiers.add(n)
        n *= 2
    return sorted(tiers)


def batch_tier(batch: int, tiers: Sequence[int]) -> Optional[int]:
    """The smallest tier holding ``batch`` requests (None above the largest)."""
    for t in tiers:
        if t >= batch:
            return t
    return None


def _row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest per-row relative L2 error (NaN counts as infinite)."""
    g, w = got.float().flatten(0, -2), want.float().flatten(0, -2)
    err = ((g - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30)).max().item()
    return err if err == err else float("inf")


class DraftGraphs:
    """Graphs of ``draft.forward_block`` keyed by batch tier (see the module docstring).

    ``draft``: the DSpark draft model; ``rings``: the drafter's stage rings (read by every replay as
    they are then); ``causal``: ``features.dspark.block_attention=causal``; ``padding_slot``: the
    engine's spare slot; ``capture``: :class:`redknot.engine.cuda_graphs.CudaGraphCapture` (tests: the
    host stand-in); ``pool``: a graph memory pool to share. ``checks`` / ``check_errors`` hold each
    tier's first-replay outcome."""

    def __init__(self, draft, rings: Sequence[torch.Tensor], causal: bool, max_num_seqs: int, padding_slot: int,
                 capture, pool: Any = None, tiers: Optional[Sequence[int]] = None) -> None:
        self.draft, self.rings, self.causal = draft, list(rings), causal
        self.tiers = sorted(set(tiers)) if tiers is not None else draft_tiers(max_num_seqs)
        if not 0 <= padding_slot < self.rings[0].shape[0]:
            raise ValueError(f"padding_slot={padding_slot} is not a ring slot (0..{self.rings[0].shape[0] - 1})")
        self.padding_slot = padding_slot
        self.capturer, self.pool = capture, pool
        self.graphs: Dict[int, Any] = {}
        self.checks: Dict[int, str] = {}
        self.check_errors: Dict[int, Dict[str, float]] = {}
        self.num_replays = 0
        self.disabled_reason: Optional[str] = None if capture is not None else "no graph capture on this device"
        self.capture_note = ""
        device = draft.device
        top = self.tiers[-1]
        self.anchors = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), padding_slot, dtype=torch.long, device=device)

    @property
    def status(self) -> str:
        if self.disabled_reason:
            return f"off: {self.disabled_reason}; drafting runs eagerly"
        if not self.graphs:
            return "off: not captured yet; drafting runs eagerly"
        note = f"; {self.capture_note}" if self.capture_note else ""
        return f"on: the draft block forward in CUDA graphs, batch tiers {sorted(self.graphs)}{note}"

    def _step_fn(self, tier: int):
        a, p, s = self.anchors[:tier], self.positions[:tier], self.slots[:tier]

        def step() -> Tuple[torch.Tensor, torch.Tensor]:
            return self.draft.forward_block(a, p, self.rings, s, self.causal)
        return step

    def capture(self) -> None:
        """One graph per tier, smallest first; a tier whose capture fails keeps the smaller ones (larger
        batches draft eagerly), a failure at the first tier turns the graphs off."""
        if self.disabled_reason is not None or self.graphs:
            return
        self._fill(torch.zeros(0, dtype=torch.long, device=self.anchors.device), self.anchors[:0], self.anchors[:0])
        pool = self.pool
        for tier in self.tiers:
            try:
                with torch.no_grad():
                    got = self.capturer.capture(self._step_fn(tier), pool)
            except RuntimeError as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if not self.graphs:
                    self.disabled_reason = f"capture failed ({reason})"
                    log.warning("draft graphs: %s", self.disabled_reason)
                    return
                self.capture_note = f"batches above {max(self.graphs)} draft eagerly: tier {tier} failed ({reason})"
                log.warning("draft graphs: %s", self.capture_note)
                break
            pool = got.pool
            self.graphs[tier] = got
        self.pool = pool

    def _fill(self, anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        b = anchors.shape[0]
        self.anchors[:b].copy_(anchors, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slots[:b].copy_(slots, non_blocking=True)
        self.anchors[b:].zero_()
        self.positions[b:].zero_()
        self.slots[b:].fill_(self.padding_slot)

    def tier_of(self, batch: int) -> Optional[int]:
        """The captured tier a batch of ``batch`` drafting requests replays (None: eager)."""
        if self.disabled_reason is not None or not self.graphs or batch < 1:
            return None
        return batch_tier(batch, sorted(self.graphs))

    def forward_block(self, anchors: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``draft.forward_block`` of B requests: replayed from the tier holding B (the outputs are the
        graph's static tensors, valid until the next replay), or eager when none does."""
        b = anchors.shape[0]
        tier = self.tier_of(b)
        if tier is None:
            return self.draft.forward_block(anchors, positions, self.rings, slots, self.causal)
        self._fill(anchors, positions, slots)
        got = self.graphs[tier]
        got.replay()
        self.num_replays += 1
        h, base = got.outputs[0][:b], got.outputs[1][:b]
        if tier in self.checks:
            return h, base
        return self._check(tier, anchors, positions, slots, h, base)

    @torch.no_grad()
    def _check(self, tier: int, anchors, positions, slots, h, base):
        """First replay of a tier: against the same padded call run eagerly (capture fault -> off) and
        against the unpadded eager call (the padding difference, reported)."""
        b = anchors.shape[0]
        padded_h, padded_base = self._step_fn(tier)()
        eager_h, eager_base = self.draft.forward_block(anchors, positions, self.rings, slots, self.causal)
        capture = {"h": _row_error(h, padded_h[:b]), "logits": _row_error(base, padded_base[:b])}
        padding = {"h": _row_error(padded_h[:b], eager_h), "logits": _row_error(padded_base[:b], eager_base)}
        self.check_errors[tier] = {"rows": b, **{f"capture_{k}": v for k, v in capture.items()},
                                   **{f"padding_{k}": v for k, v in padding.items()}}
        # Same kernels on the same inputs: equal up to a kernel's own nondeterminism (split-K atomics), which
        # the random-weight drafts of benchmarks amplify at bf16; a capture fault is off by O(1).
        tol = 1e-4 if h.dtype in (torch.float32, torch.float64) else 3e-2
        worst = max(capture.values())
        if not worst <= tol:   # NaN too
            self.checks[tier] = f"mismatch: replay vs the same padded call, eager: {capture}"
            self.disabled_reason = (f"the replay of batch tier {tier} disagreed with eager execution of the same "
                                    f"padded call ({capture}; tolerance {tol:g})")
            log.error("draft graphs: %s", self.disabled_reason)
            return eager_h, eager_base
        self.checks[tier] = (f"ok (capture error {worst:.3g} <= {tol:g}; padding {b} -> {tier} rows: "
                             f"h {padding['h']:.3g}, logits {padding['logits']:.3g} vs the unpadded eager call)")
        return h, base
