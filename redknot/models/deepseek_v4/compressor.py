"""KV compressors (CSA ratio 4 with overlapping windows, HCA ratio 128) and the lightning
indexer, as incremental updates of the paged state (reference §4.7-4.9)."""
from __future__ import annotations

import math

from typing import List, Optional

import torch
from torch import nn

from redknot.kernels.ref_attention import ring_window_rows
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.layers import Linear, Norm
from redknot.models.deepseek_v4.params import FLOAT, ParamFactory
from redknot.models.deepseek_v4.rope import COMPRESS
from redknot.step.context import StepContext, write_ring


def entry_rows(block_row: torch.Tensor, w: torch.Tensor, per_block: int) -> torch.Tensor:
    """Logical entry ids of one sequence -> rows of its pool flattened to [NB*E, dim]."""
    return block_row[w // per_block].long() * per_block + w % per_block


class Compressor(nn.Module):
    """Turns every ``ratio`` raw rows into one compressed entry of width ``head_dim``.

    Raw rows (kv and gate projections, fp32) live in per-slot rings; an entry is made
    when the step contains the position closing its window and is written to the
    block pool at its entry index, RMS-normed and roped at the window's first position.
    """

    def __init__(self, f: ParamFactory, cfg: V4Config, ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.ratio, self.head_dim, self.overlap, self.eps = ratio, head_dim, overlap, cfg.rms_norm_eps
        self.wkv = Linear(f, width, cfg.hidden_size, FLOAT)
        self.wgate = Linear(f, width, cfg.hidden_size, FLOAT)
        self.ape = f.fp32(ratio, width)
        self.norm = Norm(f, head_dim, cfg.rms_norm_eps)

    def _rows(self, ring: torch.Tensor, fresh: torch.Tensor, slot: int, first: int, ctx_len: int,
              start_row: int, n_fresh: int) -> torch.Tensor:
        """Rows of positions first..ctx_len-1 from the ring, then n_fresh rows of this step."""
        old = torch.arange(first, ctx_len, device=ring.device) % ring.shape[1]
        return torch.cat([ring[slot, old], fresh[start_row:start_row + n_fresh]])

    def update(self, ks, x: torch.Tensor, ctx: StepContext, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
               pool: torch.Tensor) -> None:
        """Project this step's rows, emit the entries of every window they close, store the rows."""
        self.update_projected(ks, self.wkv(ks, x), self.wgate(ks, x), ctx, kv_ring, gate_ring, pool)

    def update_projected(self, ks, kv: torch.Tensor, gate: torch.Tensor, ctx: StepContext, kv_ring: torch.Tensor,
                         gate_ring: torch.Tensor, pool: torch.Tensor) -> None:
        """:meth:`update` from this step's projections kv = wkv(x), gate = wgate(x) [T, C] (their dtype; the
        attention layer's projection group makes them with its other projections of x)."""
        if ctx.meta.tensor_only:  # the decode op reads the projections' dtype (no fp32 copies first)
            self._update_decode(ks, kv, gate, ctx, kv_ring, gate_ring, pool)
            return
        self.update_rows(ks, kv.float(), gate.float(), ctx, kv_ring, gate_ring, pool)

    def update_rows(self, ks, kv: torch.Tensor, gate: torch.Tensor, ctx: StepContext, kv_ring: torch.Tensor,
                    gate_ring: torch.Tensor, pool: torch.Tensor) -> None:
        """:meth:`update` from already projected rows kv, gate [T, C] fp32 (context parallel gathers
        them from every rank first)."""
        if ctx.meta.tensor_only:
            self._update_decode(ks, kv, gate, ctx, kv_ring, gate_ring, pool)
            return
        m, per_block = self.ratio, pool.shape[1]
        made: List[torch.Tensor] = []
        dest: List[torch.Tensor] = []
        for sp in ctx.spans:
            w0, w1 = sp.context_len // m, sp.end_pos // m
            if w1 == w0:
                continue
            has_prev = self.overlap and w0 > 0
            first = m * w0 - (m if has_prev else 0)
            n_fresh = m * w1 - sp.context_len
            args = (sp.slot, first, sp.context_len, sp.start, n_fresh)
            pooled = ks.compressor(self._rows(kv_ring, kv, *args), self._rows(gate_ring, gate, *args),
                                   self.ape, m, self.overlap, has_prev)  # [w1-w0, hd] fp32
            w = torch.arange(w0, w1, device=kv.device)
            cos, sin = ctx.rope.cos_sin(COMPRESS, w * m)
            made.append(ks.rope(self.norm(ks, pooled), cos, sin))
            dest.append(entry_rows(ctx.meta.block_tables[sp.index], w, per_block))
        if made:
            pool.view(-1, self.head_dim).index_copy_(0, torch.cat(dest), torch.cat(made).to(pool.dtype))
        write_ring(kv_ring, ctx, kv)
        write_ring(gate_ring, ctx, gate)

    def _update_decode(self, ks, kv: torch.Tensor, gate: torch.Tensor, ctx: StepContext, kv_ring: torch.Tensor,
                       gate_ring: torch.Tensor, pool: torch.Tensor) -> None:
        """:meth:`update_rows` of a tensor-only decode step (row b = sequence b at position p_b), with
        shapes that do not depend on the positions (CUDA graphs): store the rows, pool the window
        ending at p_b (with the window before it when overlapping) for every sequence, and write
        the entry where p_b closes a window; elsewhere the entry row keeps its value. One registry op
        (``compressor_decode``: a single launch on the Triton backend) after the step's index tensors
        (``compressor_decode_rows``, once per step and compressor shape); kv, gate may be the projections'
        dtype (the rings keep fp32)."""
        meta, m, per_block, ring = ctx.meta, self.ratio, pool.shape[1], kv_ring.shape[1]
        # the index tensors depend on the step's metadata and the compressor's shape only: one registry op (one
        # launch on the Triton backend) once per step for every compressor of that shape (a CSA layer's two,
        # every CSA layer's)
        rows = ctx.memo(("compressor decode rows", m, self.overlap, ring, per_block),
                        lambda: ks.compressor_decode_rows(meta.positions, meta.seq_slots, meta.block_tables, ring, m,
                                                          self.overlap, per_block, ctx.rope.inv[COMPRESS]))
        ring_dest, src, valid, cos, sin, closes, dest = rows
        ks.compressor_decode(kv, gate, kv_ring, gate_ring, ring_dest, src, valid, self.ape, self.norm.weight,
                             self.norm.eps, m, self.overlap, cos, sin, closes, dest, pool)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: its own compressor (keys of width index_head_dim)
    and per-query top-k selection of the visible compressed entries."""

    def __init__(self, f: ParamFactory, cfg: V4Config, linear_fmt: str):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.ratio, self.topk = cfg.csa_ratio, cfg.index_topk
        self.wq_b = Linear(f, self.n_heads * self.head_dim, cfg.q_lora_rank, linear_fmt)
        self.weights_proj = Linear(f, self.n_heads, cfg.hidden_size, FLOAT)
        self.compressor = Compressor(f, cfg, cfg.csa_ratio, self.head_dim, overlap=True)

    def select(self, ks, x: Optional[torch.Tensor], c_q: torch.Tensor, ctx: StepContext, keys: torch.Tensor,
               q: Optional[torch.Tensor] = None, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[T, index_topk] entry ids chosen for each query (-1 = none). ``q`` = wq_b(c_q) and ``weights`` =
        weights_proj(x) where the caller has projected them already (x may then be None)."""
        t = c_q.shape[0]
        q = (self.wq_b(ks, c_q) if q is None else q).view(t, self.n_heads, self.head_dim)  # [T, IH, ID]
        q = ks.rope(q, *ctx.cos_sin(COMPRESS))
        weights = self.weights_proj(ks, x) if weights is None else weights
        head_scale, scale = self.n_heads ** -0.5, self.head_dim ** -0.5
        if math.frexp(head_scale)[0] == 0.5:
            # 1/sqrt(heads) a power of two (64 heads: 1/8): it moves into the score's scale exactly (each term
            # scale·w·relu(q·k) scaled by a power of two either way), and the weights go in as projected (no cast
            # and scale launches; the kernels widen them to fp32 as they load)
            return ks.indexer_topk(q, weights, keys, ctx.meta, self.ratio, self.topk, scale * head_scale)
        return ks.indexer_topk(q, weights.float() * head_scale, keys, ctx.meta, self.ratio, self.topk, scale)


def pool_ring_windows(comp, ks, kv_ring: torch.Tensor, gate_ring: torch.Tensor, pos: torch.Tensor,
                      seq_slots: torch.Tensor, rows=None) -> torch.Tensor:
    """[R, hd]: for every row (a sequence slot at an absolute position, the rows already in the rings) the
    compressor ``comp``'s pooled window ending at that position, with the window before it where windows
    overlap; shapes independent of the positions (CUDA graphs). ``rows``: :func:`ring_window_rows` of these
    positions, where the caller keeps them for the step."""
    m = comp.ratio
    span = 2 * m if comp.overlap else m
    width = kv_ring.shape[2]
    src, valid = rows if rows is not None else ring_window_rows(pos, seq_slots, span, kv_ring.shape[1])
    kv_rows = torch.where(valid, kv_ring.view(-1, width)[src], 0.0)  # [R*span, C]
    gate_rows = torch.where(valid, gate_ring.view(-1, width)[src], float("-inf"))
    # Without has_prev the op pools window j with window j-1 of the rows: the odd entries are each
    # row's (previous, current) pair; the even ones straddle two rows.
    pooled = ks.compressor(kv_rows, gate_rows, comp.ape, m, comp.overlap, False)
    return pooled[1::2] if comp.overlap else pooled
