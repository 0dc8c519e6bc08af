"""Variable-length verification inside CUDA graphs: the step layout, built on the device.

A verify step feeds each request its anchor plus the drafts the scheduler admitted: query
lengths 1..g+1 that differ per request and per step. One captured graph per *total token* tier
serves every mix: the step's T real rows are front-packed and padded up to the smallest tier
>= T, and every per-row value the model reads (positions, slots, which request a row belongs
to, query starts, logits rows) is computed here from device tensors holding the per-request
query lengths and start positions, with fixed shapes and no host synchronisation, so a graph
replays it as captured. Padding rows point at the engine's spare slot and block.

:class:`VerifyGraphs` captures, per tier, the family's variable-length tensor-only step
(``ModelFamily.varlen_forward``: every per-step value read from device tensors, 1..g+1 rows per
request) plus the logits of every row, and replays it with the step's rows copied into static
buffers. The DSpark taps (the streams entering the tapped layers) are outputs of the captured step
too: after a replay they are handed to the model's tap hook, so the drafter reads this step's values.
State writes are the eager step's, addressed by position, so verification's rollback (the scheduler
drops the rejected positions; their ring rows, compressor rows and entries are rewritten before any
later row reads them) holds after a replay exactly as after an eager step.

The first replay of every tier is checked (:meth:`VerifyGraphs._check`) against the same padded step
run eagerly (a capture fault turns the graphs off) and against the engine's unpadded eager step. The
second comparison is exact only where the step fills its tier: padding rows change the row count of the
step's library GEMMs (cuBLAS picks its kernel, and so its summation order, by row count), so on a padded
tier the real rows may round differently from an unpadded step; that difference is reported with the
check, not treated as a fault.

Both families have such a step: V4.1's ``tensor_step`` and V4's ``varlen_step`` (window, CSA/HCA
compressors, indexer, MoE and mHC over 1..g+1 rows per request). A model without one runs its verify
steps eagerly (``VerifyGraphs.status`` says so).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)


def verify_tiers(max_num_seqs: int, block: int) -> List[int]:
    """Captured total-token tiers of verify steps: every request feeds 1..block+1 tokens, so totals
    run up to ``max_num_seqs * (block + 1)``; powers of two and their 1.5x below it, and the top."""
    top = max_num_seqs * (block + 1)
    tiers, n = {top}, 1
    while n < top:
        tiers.add(n)
        if n >= 2 and n * 3 // 2 < top:
            tiers.add(n * 3 // 2)
        n *= 2
    return sorted(tiers)


def tier_for(total: int, tiers: List[int]) -> int:
    """The smallest captured tier holding ``total`` rows (ValueError when none does)."""
    for t in tiers:
        if t >= total:
            return t
    raise ValueError(f"a verify step of {total} tokens exceeds the largest captured tier {tiers[-1]}")


@dataclass
class VarlenLayout:
    """Per-row tensors of one padded verify step (all on the device, length = the tier)."""
    query_start_loc: torch.Tensor  # [R+1] int32: request r's rows are [qsl[r], qsl[r+1])
    row_request: torch.Tensor      # [tier] long: the request of each row (R for padding rows)
    positions: torch.Tensor        # [tier] long: start_pos[r] + offset in the request (0 for padding)
    slots: torch.Tensor            # [tier] int32: request slot (the spare slot for padding)
    valid: torch.Tensor            # [tier] bool: real rows
    logits_rows: torch.Tensor      # [tier] long: every row gets logits (verify rows); padding rows too


def varlen_layout(query_lens: torch.Tensor, start_pos: torch.Tensor, slots: torch.Tensor, tier: int,
                  padding_slot: int) -> VarlenLayout:
    """Layout of a step whose R requests feed ``query_lens`` [R] tokens from ``start_pos`` [R] on.
    Only tensor ops with shapes fixed by R and ``tier``: capturable, and no host synchronisation
    (the total is never read back; rows past it are padding)."""
    r = query_lens.shape[0]
    device = query_lens.device
    lens = query_lens.long()
    qsl = torch.zeros(r + 1, dtype=torch.long, device=device)
    qsl[1:] = torch.cumsum(lens, dim=0)
    rows = torch.arange(tier, device=device)
    # request of each row: how many request ends lie at or before it (R for rows past the total)
    row_request = torch.searchsorted(qsl[1:], rows, right=True)  # [tier] in 0..R
    valid = row_request < r
    req = row_request.clamp(max=max(r - 1, 0))
    offset = rows - qsl[req]
    positions = torch.where(valid, start_pos.long()[req] + offset, torch.zeros_like(rows))
    slot = torch.where(valid, slots.long()[req], torch.full_like(rows, padding_slot)).to(torch.int32)
    return VarlenLayout(query_start_loc=qsl.to(torch.int32), row_request=row_request, positions=positions,
                        slots=slot, valid=valid, logits_rows=rows)


class VerifyGraphs:
    """Graphs of verify steps keyed by total-token tier (see the module docstring). Capture needs a
    model whose tensor-only forward reads per-request query lengths (``supports_varlen_graphs``).

    ``runner`` gives the model, its family, the state, the device and dtype, ``cache_spec``, the spare
    ``padding_slot``/``padding_block``, the shared ``graph_pool`` and ``eager_forward(inputs)`` (the
    first-replay check). ``capture``: a :class:`redknot.engine.cuda_graphs.CudaGraphCapture` (or the
    host stand-in of tests); ``tap_layers``: the layers whose entering streams the drafter reads.
    A tier of t rows serves up to min(t, ``max_num_seqs``) requests. ``check_first_replay``: the first
    replay of every tier is compared with eager execution (:meth:`_check`); a fault turns the graphs off
    with the numbers in ``status`` (the step then returns the eager result); ``checks`` and
    ``check_errors`` hold each tier's outcome and row errors."""

    def __init__(self, runner, max_num_seqs: int, block: int, capture=None, tap_layers: Sequence[int] = (),
                 max_len: int = 0) -> None:
        self.runner = runner
        self.max_num_seqs, self.block, self.max_len = max_num_seqs, block, max_len
        self.tiers = verify_tiers(max_num_seqs, block)
        self.capturer = capture
        self.tap_layers = tuple(tap_layers)
        self.check_first_replay = True
        self.graphs: Dict[int, Any] = {}
        self.checks: Dict[int, str] = {}      # tier -> outcome of its first replay against eager
        self.check_errors: Dict[int, Dict] = {}  # tier -> the row errors of that check (see _check)
        self.num_replays = 0
        self.disabled_reason: Optional[str] = None
        self.capture_note = ""                # tiers left out after a failed capture
        model = runner.model
        kernels = getattr(runner, "kernels", None)
        host_ops = sorted(op for op, b in kernels.choice.items() if b == "batch_invariant") if kernels else []
        if not getattr(model, "supports_varlen_graphs", False):
            self.disabled_reason = ("the model's tensor-only forward handles one token per sequence (its "
                                    "attention, compressor and indexer do not read per-request query lengths); "
                                    "verify steps run eagerly")
        elif host_ops:
            self.disabled_reason = (f"the batch-invariant ops {host_ops} loop over sequences on the host; "
                                    "verify steps run eagerly")
        elif capture is None:
            self.disabled_reason = "no graph capture on this device; verify steps run eagerly"

    @property
    def status(self) -> str:
        if self.disabled_reason:
            return f"off: {self.disabled_reason}"
        if not self.graphs:
            return "off: not captured yet; verify steps run eagerly"
        note = f"; {self.capture_note}" if self.capture_note else ""
        return f"on: verify steps in CUDA graphs, total-token tiers {self.tiers}{note}"

    def requests_of(self, tier: int) -> int:
        """Requests a tier's graph holds (the unused ones have no rows)."""
        return min(tier, self.max_num_seqs)

    # ------------------------------------------------------------------ capture
    def _allocate(self) -> None:
        r = self.runner
        dev, top, b = r.device, self.tiers[-1], self.max_num_seqs
        self.width = r.cache_spec.blocks_for(self.max_len)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)                      # [T]
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)                      # [T]
        self.query_start = torch.zeros(b + 1, dtype=torch.int32, device=dev)                 # [B+1]
        self.seq_slots = torch.full((b,), r.padding_slot, dtype=torch.int32, device=dev)     # [B]
        self.block_tables = torch.full((b, self.width), r.padding_block, dtype=torch.int32, device=dev)

    def _step_fn(self, tier: int):
        """The captured callable of ``tier``: reads the static buffers only."""
        r, layers = self.runner, self.tap_layers
        model, family, state = r.model, r.family, r.state
        nb = self.requests_of(tier)
        ids, pos = self.input_ids[:tier], self.positions[:tier]
        qsl, slots, tables = self.query_start[:nb + 1], self.seq_slots[:nb], self.block_tables[:nb]

        def step() -> Tuple[torch.Tensor, ...]:
            taps: Dict[int, torch.Tensor] = {}
            hook = getattr(model, "tap_hook", None)
            if hook is not None:
                model.tap_hook = lambda i, h, rows: taps.__setitem__(i, h) if i in layers else None
            try:
                x = family.varlen_forward(model, state, input_ids=ids, positions=pos, query_start_loc=qsl,
                                          seq_slots=slots, block_tables=tables)
                logits = model.compute_logits(x)
            finally:
                if hook is not None:
                    model.tap_hook = hook
            if hook is not None and set(taps) != set(layers):
                raise RuntimeError(f"the varlen step tapped layers {sorted(taps)}, the drafter reads {list(layers)}")
            return (x, logits) + tuple(taps[i] for i in layers if hook is not None)
        return step

    def capture(self, tiers: Optional[Sequence[int]] = None) -> None:
        """One graph per tier (``tiers``: a subset, e.g. a benchmark's; default all) in the runner's
        shared pool, smallest first: a tier whose capture fails (an op that reads the device on the
        host, memory) keeps the smaller tiers in graphs and sends larger steps to the eager path."""
        if self.disabled_reason is not None:
            log.warning("verify graphs: %s", self.disabled_reason)
            return
        if self.graphs:  # captured already (the graphs hold the buffers they were recorded with)
            return
        if tiers is not None:
            bad = sorted(set(tiers) - set(self.tiers))
            if bad:
                raise ValueError(f"verify graph tiers {bad} are not among the tiers {self.tiers}")
            self.tiers = sorted(set(tiers))
        self._allocate()
        self._pad(0, 0)
        pool = getattr(self.runner, "graph_pool", None)
        for tier in self.tiers:
            try:
                got = self.capturer.capture(self._step_fn(tier), pool)
            except RuntimeError as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if not self.graphs:
                    self.disabled_reason = f"capture failed ({reason}); verify steps run eagerly"
                    log.warning("verify graphs: %s", self.disabled_reason)
                    return
                self.capture_note = (f"steps above {max(self.graphs)} tokens run eagerly: the capture of tier "
                                     f"{tier} failed ({reason})")
                log.warning("verify graphs: %s", self.capture_note)
                self.tiers = sorted(self.graphs)
                break
            pool = got.pool
            self.graphs[tier] = got
        self.runner.graph_pool = pool

    # ------------------------------------------------------------------ replay
    def can_run(self, inputs) -> bool:
        """A step of decode and verify rows only (every row sampled, 1..block+1 per request) whose
        total fits a tier and whose tables and positions fit the buffers."""
        if self.disabled_reason is not None or not self.graphs:
            return False
        meta, reqs = inputs.meta, inputs.sched.requests
        if not reqs or len(reqs) > self.max_num_seqs or meta.num_tokens > self.tiers[-1]:
            return False
        if any(sr.num_logits != sr.num_tokens or not 1 <= sr.num_tokens <= self.block + 1 for sr in reqs):
            return False
        return (meta.block_tables.shape[1] <= self.width
                and max(c + n for c, n in zip(meta.context_lens, meta.num_tokens_per_seq)) <= self.max_len)

    def _pad(self, n: int, r: int) -> None:
        """Rows n.. and requests r.. of the buffers become padding (spare slot and block, no rows)."""
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.query_start[r + 1:].fill_(n)
        self.seq_slots[r:].fill_(self.runner.padding_slot)
        self.block_tables[r:].fill_(self.runner.padding_block)

    def _fill(self, meta) -> int:
        """The step's rows into the static buffers, padding past them -> the tier that runs it."""
        n, r = meta.num_tokens, meta.num_seqs
        tier = tier_for(n, self.tiers)
        self.input_ids[:n].copy_(meta.input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.query_start[:r + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_slots[:r].copy_(meta.seq_slots, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:r, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:r, width:].fill_(self.runner.padding_block)
        self._pad(n, r)
        return tier

    def fits(self, meta) -> bool:
        """Whether a step's metadata (``meta``: rows per request 1..block+1) fits a captured tier."""
        if self.disabled_reason is not None or not self.graphs:
            return False
        counts = meta.num_tokens_per_seq
        return (0 < meta.num_seqs <= self.max_num_seqs and meta.num_tokens <= self.tiers[-1]
                and all(1 <= c <= self.block + 1 for c in counts)
                and meta.block_tables.shape[1] <= self.width
                and max(c + q for c, q in zip(meta.context_lens, counts)) <= self.max_len)

    def replay_only(self, meta) -> None:
        """Replay the tier of a step that :meth:`fits` and nothing else: no first-replay check, no tap
        hook, no counting (start-up cost profiling times exactly this)."""
        self.graphs[self._fill(meta)].replay()

    def run(self, inputs) -> Tuple[torch.Tensor, torch.Tensor]:
        """(pre-head rows [T, ...], logits [T, V]) of a step ``can_run`` accepted, by graph replay; the
        taps of the tapped layers go to the model's tap hook as an eager step would hand them."""
        meta = inputs.meta
        n = meta.num_tokens
        tier = self._fill(meta)
        got = self.graphs[tier]
        got.replay()
        self.num_replays += 1
        model = self.runner.model
        if hasattr(model, "num_forwards"):  # a replay runs no Python: count the forward as the model does
            model.num_forwards += 1
        hook = getattr(model, "tap_hook", None)
        if hook is not None:
            for i, h in zip(self.tap_layers, got.outputs[2:]):
                hook(i, h[:n], None)
        streams, logits = got.outputs[0][:n], got.outputs[1][:n].clone()
        if tier in self.checks or not self.check_first_replay:
            return streams, logits
        return self._check(inputs, tier, streams, logits, [h[:n] for h in got.outputs[2:]])

    def _check(self, inputs, tier: int, streams, logits, taps: List[torch.Tensor]):
        """First replay of a tier, compared twice (logits and taps, row by row):

        * **capture**: against the same step run eagerly on the same padded buffers (the recorded
          callable, not captured). Same kernels, same shapes, same inputs: a difference is a capture
          fault (a value baked at capture, a buffer reused, a race) and turns the graphs off.
        * **padding**: against the engine's eager step (unpadded, op by op). On a tier the step fills
          exactly, this also compares the tensor-only step with the span path and a mismatch turns the
          graphs off. On a padded tier the padding rows change the row count of every GEMM; a library
          GEMM (cuBLAS) picks its kernel, and so its summation order, by row count, so the real rows may
          round differently (and a top-k near a tie may flip): the error is reported, not a fault.

        Both eager runs write the step's state again (addressed by position: harmless); the padded one
        runs last, so when the check passes the state, the returned rows and the taps handed to the hook
        are the replay's. On a fault the engine's eager step runs once more and is what the step returns
        (state, rows and taps of the path every later step takes)."""
        model = self.runner.model
        n = streams.shape[0]
        hook = getattr(model, "tap_hook", None)
        eager_taps: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}
        if hook is not None:
            def spy(i, h, rows):
                if i in self.tap_layers:
                    eager_taps[i] = (h, rows)
            model.tap_hook = spy
        try:
            _, eager_logits = self.runner.eager_forward(inputs)
        finally:
            if hook is not None:
                model.tap_hook = hook
        with torch.no_grad():
            padded = tuple(self._step_fn(tier)())          # eager, on the static buffers (hook restored)
        padded_taps = [h[:n] for h in padded[2:]]
        capture = {"logits": row_error(logits, padded[1][:n])}
        for i, h, want in zip(self.tap_layers, taps, padded_taps):
            capture[f"tap{i}"] = row_error(h.float().flatten(1), want.float().flatten(1))
        padding = {"logits": row_error(padded[1][:n], eager_logits)}
        for i, h in zip(self.tap_layers, padded_taps):
            want, rows = eager_taps.get(i, (None, None))
            if want is not None:
                got = h if rows is None else h[rows]
                padding[f"tap{i}"] = row_error(got.float().flatten(1), want.float().flatten(1))
        tol = 1e-4 if self.runner.dtype in (torch.float32, torch.float64) else 3e-2
        per_row = row_errors(padded[1][:n], eager_logits)
        self.check_errors[tier] = {"rows": n, "capture": capture, "padding": padding,
                                   "padding_rows_over_tol": int((~(per_row <= tol)).sum().item())}
        worst, worst_pad = max(capture.values()), max(padding.values())
        over = self.check_errors[tier]["padding_rows_over_tol"]
        pad_note = (f"padding {n} -> {tier} rows: vs the unpadded eager step {_fmt(padding)}, {over} rows "
                    f"over {tol:g}" if n < tier else f"no padding: vs the eager step {_fmt(padding)}")
        if not worst <= tol:  # also catches NaN
            self.checks[tier] = f"mismatch: {_fmt(capture)} > {tol:g} (replay vs the same padded step, eager)"
            self.disabled_reason = (f"replay of tier {tier} disagreed with eager execution of the same padded step "
                                    f"({_fmt(capture)}; tolerance {tol:g}); verify steps run eagerly")
        elif n == tier and not worst_pad <= tol:
            self.checks[tier] = (f"mismatch: {_fmt(padding)} > {tol:g} (tensor-only step vs the eager step, "
                                 "no padding)")
            self.disabled_reason = (f"replay of tier {tier} disagreed with eager execution ({_fmt(padding)}; "
                                    f"tolerance {tol:g}); verify steps run eagerly")
        else:
            self.checks[tier] = f"ok (row error {worst:.3g} <= {tol:g}; {pad_note})"
        if self.disabled_reason is not None:  # serve the eager step (its state writes last, its taps)
            log.error("verify graphs: %s", self.disabled_reason)
            return self.runner.eager_forward(inputs)
        if hook is not None:  # the drafter reads the taps of the rows returned
            for i, h in zip(self.tap_layers, taps):
                hook(i, h, None)
        return streams, logits


def _fmt(errs: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in errs.items())


def row_errors(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per-row relative L2 errors [N] (fp32; NaN where either side is NaN)."""
    return (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1).clamp(min=1e-30)


def row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest per-row relative L2 error (NaN-safe: NaN compares as infinite)."""
    err = row_errors(got, want).max().item()
    return err if err == err else float("inf")
