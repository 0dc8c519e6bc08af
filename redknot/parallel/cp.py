"""Context parallel (CP): one engine step's rows split over the ``cp`` ranks of a DP group.

A sequence with at least ``2 * cp * min_chunk`` new tokens is cut into ``2*cp``
consecutive chunks; rank r computes chunks r and ``2cp-1-r`` (zigzag), so each
rank gets one early and one late chunk and the causal work (which grows with
position) is even. Shorter sequences (decodes, short chunks) go whole to the
rank with the fewest rows so far. Every rank of the group runs the same
schedule, so every rank computes the same plan.

Row-wise parts of the model (embedding, mHC, MoE) just run on the local rows.
Attention needs what other ranks computed: the model family says how
(:class:`~redknot.models.family.ContextParallelHooks`, e.g. V4's
``context_parallel`` module). Its attention layers find
the plan on the step metadata (``meta.context_parallel``, a :class:`CPStep`) and
use its services: :meth:`CPStep.gather` (all-gather rows into step order),
:meth:`CPStep.full_context` (the whole step as one context, for state writes)
and :meth:`CPStep.scratch_ring` (the window before each local chunk). A rank
without rows joins the same collectives through the family's ``idle`` hook.
After the last layer the rows are all-gathered back into step order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from redknot.models.family import ContextParallelHooks
from redknot.parallel.groups import all_gather_rows
from redknot.step.context import StepContext
from redknot.step.metadata import StepMetadata

MIN_CHUNK_TOKENS = 8  # a sequence is split only if every zigzag chunk gets at least this many rows


@dataclass(frozen=True)
class Piece:
    """Rows [start_row, start_row + length) of the step (one sequence, positions from ``position``)
    computed by CP rank ``rank``."""
    seq: int
    start_row: int
    length: int
    position: int
    rank: int


def zigzag_chunks(num_tokens: int, cp: int) -> List[Tuple[int, int, int]]:
    """(offset, length, rank) of the 2*cp chunks of a sequence: chunk i goes to rank i for the first
    half and to rank 2cp-1-i for the second, so rank r holds chunks r and 2cp-1-r."""
    n = 2 * cp
    base, extra = divmod(num_tokens, n)
    out, offset = [], 0
    for i in range(n):
        length = base + (1 if i < extra else 0)
        out.append((offset, length, i if i < cp else n - 1 - i))
        offset += length
    return out


def plan_pieces(num_tokens: Sequence[int], context_lens: Sequence[int], cp: int,
                min_chunk: int = MIN_CHUNK_TOKENS) -> List[Piece]:
    """Split a step (sequences in row order) over ``cp`` ranks (see the module docstring)."""
    pieces: List[Piece] = []
    rows = [0] * cp
    start = 0
    for b, (n, c) in enumerate(zip(num_tokens, context_lens)):
        if n >= 2 * cp * min_chunk:
            for offset, length, rank in zigzag_chunks(n, cp):
                pieces.append(Piece(b, start + offset, length, c + offset, rank))
                rows[rank] += length
        else:
            rank = min(range(cp), key=lambda r: (rows[r], r))
            pieces.append(Piece(b, start, n, c, rank))
            rows[rank] += n
        start += n
    return pieces


@dataclass
class CPStepMetadata(StepMetadata):
    """A rank's share of a step: its pieces as the "sequences" (slot = the piece's scratch ring),
    plus the plan that the attention layers consult."""
    context_parallel: Any = None


class CPStep:
    """One step's split over the CP group; placed on the local metadata for the attention layers."""

    def __init__(self, meta: StepMetadata, pieces: List[Piece], cp_rank: int, cp: int, group: dist.ProcessGroup,
                 hooks: ContextParallelHooks):
        self.meta, self.group, self.hooks = meta, group, hooks
        self.local = [p for p in pieces if p.rank == cp_rank]
        self.sizes = [sum(p.length for p in pieces if p.rank == r) for r in range(cp)]
        order = sorted(pieces, key=lambda p: (p.rank, p.start_row))  # the all-gather's row order
        gathered = torch.empty(meta.num_tokens, dtype=torch.long)
        at = 0
        for p in order:
            gathered[at:at + p.length] = torch.arange(p.start_row, p.start_row + p.length)
            at += p.length
        inverse = torch.empty_like(gathered)
        inverse[gathered] = torch.arange(meta.num_tokens)
        device = meta.input_ids.device
        self.inverse = inverse.to(device)  # step row -> row of the gathered tensor
        local_rows = [r for p in self.local for r in range(p.start_row, p.start_row + p.length)]
        self.local_rows = torch.tensor(local_rows, dtype=torch.long, device=device)  # [T_local]
        self._full_ctx: Optional[StepContext] = None

    def local_metadata(self) -> CPStepMetadata:
        meta, rows, local = self.meta, self.local_rows, self.local
        starts = [0]
        for p in local:
            starts.append(starts[-1] + p.length)
        device = meta.input_ids.device
        seqs = torch.tensor([p.seq for p in local], dtype=torch.long, device=device)
        return CPStepMetadata(
            input_ids=meta.input_ids[rows], positions=meta.positions[rows],
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_slots=torch.arange(len(local), dtype=torch.int32, device=device),
            block_tables=meta.block_tables[seqs], logits_indices=torch.zeros(0, dtype=torch.long, device=device),
            num_tokens_per_seq=[p.length for p in local], context_lens=[p.position for p in local],
            seq_slot_list=list(range(len(local))), query_start_list=starts[:-1], context_parallel=self)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows [T_local, ...] -> every row of the step [T, ...], in step order."""
        return all_gather_rows(rows, self.sizes, self.group).index_select(0, self.inverse)

    def full_context(self, ctx: StepContext) -> StepContext:
        """The whole step as one context (compressor updates and ring writes), made once per step."""
        if self._full_ctx is None:
            self._full_ctx = StepContext(self.meta, ctx.rope, ctx.dtype)
        return self._full_ctx

    def scratch_ring(self, swa: torch.Tensor, full_kv: torch.Tensor, window: int) -> torch.Tensor:
        """[P_local, R, hd]: for each local piece the K=V rows of the window before its first position,
        at ``pos % R`` — from the SWA ring (positions before the step) or from this step's rows."""
        ring, meta = swa.shape[1], self.meta
        src: List[int] = []
        dest: List[int] = []
        for i, p in enumerate(self.local):
            c, s0, slot = meta.context_lens[p.seq], meta.query_start_list[p.seq], meta.seq_slot_list[p.seq]
            for pos in range(max(0, p.position - window + 1), p.position):
                src.append(slot * ring + pos % ring if pos < c else swa.shape[0] * ring + s0 + pos - c)
                dest.append(i * ring + pos % ring)
        out = swa.new_zeros((len(self.local), ring, swa.shape[2]))  # [P_local, R, hd]
        if src:
            pool = torch.cat([swa.reshape(-1, swa.shape[2]), full_kv.to(swa.dtype)])
            index = torch.tensor(src, dtype=torch.long, device=swa.device)
            out.view(-1, swa.shape[2]).index_copy_(0, torch.tensor(dest, dtype=torch.long, device=swa.device),
                                                   pool.index_select(0, index))
        return out

    def attention(self, attn, ks, x: torch.Tensor, ctx: StepContext, st) -> torch.Tensor:
        """One attention layer over this rank's rows x [T_local, D] (the family's CP attention)."""
        return self.hooks.attention(self, attn, ks, x, ctx, st)


class ContextParallel:
    """The model forward of a CP group: plan, run the local rows, gather the streams."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, hooks: ContextParallelHooks,
                 min_chunk: int = MIN_CHUNK_TOKENS):
        self.group, self.cp_rank, self.cp, self.min_chunk = group, cp_rank, cp, min_chunk
        self.hooks = hooks
        self.num_split_steps = 0  # steps in which at least one sequence was split

    def plan(self, meta: StepMetadata) -> CPStep:
        pieces = plan_pieces(meta.num_tokens_per_seq, meta.context_lens, self.cp, self.min_chunk)
        if len(pieces) > meta.num_seqs:
            self.num_split_steps += 1
        return CPStep(meta, pieces, self.cp_rank, self.cp, self.group, self.hooks)

    def install(self, model) -> None:
        """Route ``model.forward`` (what the model runner calls) through :meth:`forward`; the class's
        forward still runs each rank's rows, and ``mtp_forward`` is untouched (it runs replicated)."""
        local_forward = model.forward
        model.forward = lambda meta, state: self.forward(model, local_forward, meta, state)

    @torch.no_grad()
    def forward(self, model, local_forward, meta: StepMetadata, state) -> torch.Tensor:
        """The model over the CP group -> streams [T, hc_mult, D] of every row, on every rank."""
        step = self.plan(meta)
        if step.local:
            streams = local_forward(step.local_metadata(), state)  # [T_local, hc, D]
        else:
            self.hooks.idle(step, model, state)
            cfg = model.cfg
            streams = torch.zeros(0, cfg.hc_mult, cfg.hidden_size, dtype=model.dtype, device=meta.input_ids.device)
        return step.gather(streams)
