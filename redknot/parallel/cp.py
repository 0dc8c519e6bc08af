"""Context parallel (CP): one engine step's rows split over the ``cp`` ranks of a DP group.

A sequence with at least ``2 * cp * min_chunk`` new tokens is cut into ``2*cp``
consecutive chunks; rank r computes chunks r and ``2cp-1-r`` (zigzag), so each
rank gets one early and one late chunk and the causal work (which grows with
position) is even. Shorter sequences (decodes, short chunks) go whole to the
rank with the fewest rows so far. Every rank of the group runs the same
schedule, so every rank computes the same plan.

Row-wise parts of the model (embedding, mHC, MoE) just run on the local rows.
Attention needs what other ranks computed, and V4's per-layer state is compact,
so each layer all-gathers it from the group (:meth:`CPStep.attention`):

* the step's K=V rows: every rank writes the whole step into its SWA ring
  (the state stays replicated over the group) and builds, for each local chunk,
  a scratch ring holding the window before the chunk — the SWA tail of the
  previous chunk or the state before the step;
* the compressors' projected rows (CSA, indexer, HCA): every rank pools every
  entry of the step into its pool, so each query sees exactly the entries and
  indexer keys it would see in one process.

Queries then run through the registered ops with the chunk as the "sequence"
(its first position as context length), so the ops' per-query math is
unchanged: in batch-invariant mode results are bitwise those of one process.
After the last layer the rows are all-gathered back into step order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from redknot.models.deepseek_v4.attention import visible_entries
from redknot.parallel.groups import all_gather_rows
from redknot.step.context import StepContext, write_ring
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

    def __init__(self, meta: StepMetadata, pieces: List[Piece], cp_rank: int, cp: int, group: dist.ProcessGroup):
        self.meta, self.group = meta, group
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

    def _compress(self, comp, ks, kv: torch.Tensor, gate: torch.Tensor, full: StepContext, kv_ring, gate_ring,
                  pool) -> None:
        """Every rank's projected compressor rows -> the step's entries and ring rows (on every rank)."""
        comp.update_rows(ks, self.gather(kv), self.gather(gate), full, kv_ring, gate_ring, pool)

    def _compress_x(self, comp, ks, x: torch.Tensor, full: StepContext, kv_ring, gate_ring, pool) -> None:
        self._compress(comp, ks, comp.wkv(ks, x).float(), comp.wgate(ks, x).float(), full, kv_ring, gate_ring, pool)

    @torch.no_grad()
    def idle(self, model, state) -> None:
        """A rank with no rows in this step: the same collectives, in the same order, as the layers'
        forward (so the replicated state is updated too), with zero local rows."""
        ks, full = model.ks, StepContext(self.meta, model.rope, model.dtype)
        device = self.meta.input_ids.device
        for layer, st in zip(model.layers, state.layers):
            attn = layer.attn
            full_kv = self.gather(torch.zeros(0, attn.head_dim, dtype=model.dtype, device=device))
            for comp, rings in ((attn.compressor, (st.kv_rows, st.gate_rows, st.entries)),
                                (attn.indexer.compressor if attn.indexer is not None else None,
                                 (st.idx_kv_rows, st.idx_gate_rows, st.idx_keys))):
                if comp is not None:
                    empty = torch.zeros(0, comp.wkv.weight.shape[0], dtype=torch.float32, device=device)
                    self._compress(comp, ks, empty, empty, full, *rings)
            write_ring(st.swa, full, full_kv)
            moe = layer.ffn
            if moe.dispatcher is not None:
                k = moe.gate.top_k
                moe.dispatcher(ks, torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=device),
                               torch.zeros(0, k, dtype=torch.long, device=device),
                               torch.zeros(0, k, dtype=torch.float32, device=device), moe.experts, moe.limit)

    def attention(self, attn, ks, x: torch.Tensor, ctx: StepContext, st) -> torch.Tensor:
        """``Attention.forward`` for this rank's rows x [T_local, D] (same math, gathered state)."""
        t, cfg = x.shape[0], attn.cfg
        full = self.full_context(ctx)
        cos, sin = ctx.cos_sin(attn.rope_kind)
        c_q = attn.q_norm(ks, attn.wq_a(ks, x))  # [T_local, q_lora]
        kv = ks.rope(attn.kv_norm(ks, attn.wkv(ks, x)), cos, sin)  # [T_local, hd]
        full_kv = self.gather(kv)  # [T, hd]
        ring = self.scratch_ring(st.swa, full_kv, cfg.sliding_window)  # read before the ring write
        pool = idx = None
        if attn.compressor is not None:
            self._compress_x(attn.compressor, ks, x, full, st.kv_rows, st.gate_rows, st.entries)
            pool = st.entries
            if attn.indexer is not None:
                self._compress_x(attn.indexer.compressor, ks, x, full, st.idx_kv_rows, st.idx_gate_rows,
                                 st.idx_keys)
                idx = attn.indexer.select(ks, x, c_q, ctx, st.idx_keys) if t else None
            elif t:
                idx = visible_entries(ctx, attn.ratio, st.entries.shape[1])
        q = attn.wq_b(ks, c_q).view(t, attn.num_heads, attn.head_dim)  # [T_local, H, hd]
        q = ks.rope(ks.rms_norm(q, None, cfg.rms_norm_eps), cos, sin)
        o = q
        if t:
            o = ks.sparse_attention(q, kv, ring, attn.attn_sink, attn.head_dim ** -0.5, cfg.sliding_window,
                                    ctx.meta, pool, idx)
        write_ring(st.swa, full, full_kv)
        o = ks.rope(o, cos, sin, inverse=True)
        o = ks.grouped_linear(o.view(t, cfg.o_groups, -1), attn.wo_a.weight, attn.wo_a.scale)  # [T_local, G, R]
        return attn.wo_b(ks, o.flatten(1))


class ContextParallel:
    """The model forward of a CP group: plan, run the local rows, gather the streams."""

    def __init__(self, group: dist.ProcessGroup, cp_rank: int, cp: int, min_chunk: int = MIN_CHUNK_TOKENS):
        self.group, self.cp_rank, self.cp, self.min_chunk = group, cp_rank, cp, min_chunk
        self.num_split_steps = 0  # steps in which at least one sequence was split

    def plan(self, meta: StepMetadata) -> CPStep:
        pieces = plan_pieces(meta.num_tokens_per_seq, meta.context_lens, self.cp, self.min_chunk)
        if len(pieces) > meta.num_seqs:
            self.num_split_steps += 1
        return CPStep(meta, pieces, self.cp_rank, self.cp, self.group)

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
            step.idle(model, state)
            cfg = model.cfg
            streams = torch.zeros(0, cfg.hc_mult, cfg.hidden_size, dtype=model.dtype, device=meta.input_ids.device)
        return step.gather(streams)
