"""V4.1 attention on the paged incremental state (reference §3.5, §5.2, §5.3).

Every layer: low-rank q without a per-head norm, one K=V latent with interleaved RoPE on
its last dims (the layer's own table: θ 10000 on ratio-0 layers, θ 160000 + YaRN on the
others), a window ring in FP8, per-head sinks, grouped output. kv sources (ratio 1 or
2) also compress and publish index keys computed from the *pre-RoPE* latent; index
sources score those keys (layer 20 publishes candidate blocks, 24/28/32/36 re-index
inside them) and publish the top-k, which the layers above reuse until the next source.

Cross-layer sharing is per step through :class:`Slots` (rows of this step). Cache reads
return exactly the grid values the reference computes (the state stores the byte
formats of :mod:`redknot.kernels.mx_formats`), so chunk boundaries are invisible.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.kernel_ops import (
    attend_spans, block_table, host_ints, index_spans, insert_rows, ops_of, page_rows, segments, span_rows)
from redknot.models.deepseek_v41.ref_math import (
    Numerics, Weights, acc_dtype, acc_linear, apply_rope, bf16_round, index_qdq, linear, plain_linear, topk_ids)
from redknot.models.deepseek_v41.state import V41State

ROW_CHUNK = 256  # query rows scored / attended at once (bounds [rows, candidates, dim] temporaries)
PREFILL_ROWS = 128  # above this many rows the grouped output's layout is chosen by measurement (linear_prefill_mx)


@dataclass
class Span:
    """Rows [start, start+n) of the step: one sequence at positions ctx..ctx+n-1; its window
    starts at ``floor`` (bounded replay's tail layers) and its block table is ``blocks``."""
    start: int
    n: int
    ctx: int
    slot: int
    blocks: torch.Tensor      # [max_blocks] int64
    floor: int = 0

    @property
    def end(self) -> int:
        return self.ctx + self.n


@dataclass
class Slots:
    """What the latest sources of this forward published, per row of the step."""
    topk: Optional[torch.Tensor] = None           # [T, K] entry ids of the latest index source (-1: none)
    candidates: Optional[torch.Tensor] = None     # [T, n_max] bool, from the candidate source
    cand_blocks: Optional[torch.Tensor] = None    # [T, NB] block ids (-1 pad): the same, on the kernel path
    record: Dict[int, torch.Tensor] = field(default_factory=dict)  # index source -> topk (inspection)
    rope: Dict = field(default_factory=dict)      # this forward's RoPE cos/sin tables (fused_rows)
    # Inspection, off unless a dict: index source -> the scores [T, n_max] the PyTorch indexer selected
    # from (-inf: not selectable), so a selection can be checked tie-aware against them.
    scores: Optional[Dict[int, torch.Tensor]] = None

    def rows(self, idx: torch.Tensor) -> "Slots":
        return Slots(topk=None if self.topk is None else self.topk[idx],
                     candidates=None if self.candidates is None else self.candidates[idx],
                     cand_blocks=None if self.cand_blocks is None else self.cand_blocks[idx], record=self.record,
                     scores=self.scores)


def _page_index(span: Span, entry: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """Flat page rows of entries ``entry`` of one sequence (entry j lives in the block of position j*r)."""
    per = block_size // ratio
    pos = entry * ratio
    return span.blocks[pos // block_size] * per + (pos % block_size) // ratio


def sparse_attend(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """q [N, H, D] over its own candidate rows kv [N, M, D] (valid [N, M]) plus a per-head sink
    (unscaled logit in the denominator only): -> [N, H, D] in the accumulation dtype."""
    a = sink.dtype
    z = torch.einsum("nhd,nmd->nhm", q.to(a), kv.to(a)) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    s = sink[None, :, None].expand(q.shape[0], -1, 1)
    m = torch.maximum(z.amax(-1, keepdim=True), s)
    e = torch.exp(z - m)
    return torch.einsum("nhm,nmd->nhd", e, kv.to(a)) / (e.sum(-1, keepdim=True) + torch.exp(s - m))


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """Layer 20's candidate mask (§3.5(d)): blocks of ``block`` entries scored by their max, the
    block of the newest visible entry pinned, the best ``n_blocks`` finite blocks kept -> [N, n] bool."""
    rows, n = scores.shape
    nblk = -(-n // block)
    pad = F.pad(scores, (0, nblk * block - n), value=float("-inf"))
    bscore = pad.view(rows, nblk, block).amax(-1)                               # [N, nblk]
    blk = torch.arange(nblk, device=scores.device)
    pinned = (visible[:, None] > 0) & (blk[None, :] == ((visible - 1).clamp(min=0) // block)[:, None])
    bscore = bscore.masked_fill(pinned, float("inf"))
    chosen = topk_ids(bscore, min(n_blocks, nblk))
    keep = torch.zeros_like(bscore, dtype=torch.bool).scatter_(1, chosen, True) & (bscore > float("-inf"))
    return keep.repeat_interleave(block, dim=1)[:, :n]


def grouped_output(o: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, cfg, w, p: str, num,
                   tables=None, mix=None, inplace: bool = False, rotated: bool = False):
    """The attention output [T, H, D] -> [T, hidden]: inverse RoPE on its rotary part, the per-group
    ``wo_a`` projection (bf16 in the reference), then ``wo_b``. ``tables``: the forward's RoPE tables.
    ``mix`` = (h, post, comb) of the fused mHC site: returns (out, mixed), ``mixed`` telling that ``out`` is
    already ``site_post(y, h, post, comb)`` (``wo_b`` and the post mix in two launches, the same bits).
    ``inplace``: the caller gives up ``o`` (the inverse RoPE may rotate its last columns in place).
    ``rotated``: ``o`` has had its inverse RoPE already (the attention launch's)."""
    t = o.shape[0]
    if not rotated:
        o = fused_rows.rope(o.to(num.dtype), w, pos, inv, tables, inverse=True, inplace=inplace)
    g = cfg.o_groups
    ops = ops_of(w)
    wo_a = (ops.bf16_weight(w, f"{p}.wo_a.weight", num.dtype) if ops is not None
            else w.dense(f"{p}.wo_a.weight", num.dtype)).view(g, cfg.o_lora_rank, -1)
    if o.is_cuda and t > PREFILL_ROWS:   # prefill rows: the batched GEMM's layout measured (same products)
        from redknot.kernels.triton.linear_prefill_mx import grouped_wo_a

        z = grouped_wo_a(o.reshape(t, g, -1), wo_a)
    else:   # few rows: the einsum, or a GEMV on the stored FP8 weight where measured faster (the same products)
        z = fused_rows.wo_a_rows(o.reshape(t, g, -1), wo_a, w, f"{p}.wo_a.weight", num)
        if z is None:   # decode batches: the einsum or a stream of the stored FP8 bytes, by measurement
            z = _wo_a_stream(o, w, f"{p}.wo_a.weight", num, ops, g, wo_a)
        z = z if z is not None else torch.einsum("ngk,grk->ngr", o.reshape(t, g, -1), wo_a).reshape(t, -1)
    if mix is not None:
        hp = fused_rows.linear_post_rows(z, w, f"{p}.wo_b.weight", num, *mix)
        if hp is not None:
            return hp, True
    y = fused_rows.linear_rows(z, w, f"{p}.wo_b.weight", num)   # few rows: two launches, the same bits
    y = y if y is not None else linear(z, w, f"{p}.wo_b.weight", num)
    return (y, False) if mix is not None else y


def _wo_a_stream(o: torch.Tensor, w, name: str, num, ops, groups: int, wo_a: torch.Tensor):
    """``wo_a`` for ``wo_a_v41.MIN_ROWS``..``MAX_ROWS`` bf16 rows on the registry's Triton linears with the weight kept
    in its stored FP8 format: ``wo_a_v41.wo_a`` (a tuner's choice between the einsum on ``wo_a`` and streams of the FP8
    bytes: the same exact products in another fp32 summation order); None elsewhere (the caller runs the einsum)."""
    from redknot.kernels.triton import wo_a_v41
    from redknot.models.deepseek_v41.moe import _fp8_linear_weights

    t = o.shape[0]
    if ops is None or not (o.dtype == wo_a.dtype == torch.bfloat16) or not wo_a_v41.MIN_ROWS <= t <= wo_a_v41.MAX_ROWS:
        return None
    got = _fp8_linear_weights(ops, w, name, num)
    o2 = o.reshape(t, -1)
    if got is None or got[0].shape != (wo_a.shape[0] * wo_a.shape[1], wo_a.shape[2]) or o2.shape[1] != \
            groups * wo_a.shape[2]:
        return None
    return wo_a_v41.wo_a(o2 if o2.stride(-1) == 1 else o2.contiguous(), got[0], got[1], groups, lambda: wo_a)


class AttentionLayer:
    """One layer's attention over the step (weights by native name under ``layers.L.attn``)."""

    def __init__(self, cfg, w: Weights, layer: int, inv_freq: torch.Tensor, num: Numerics, index_keys: str):
        self.cfg, self.w, self.layer, self.inv, self.num = cfg, w, layer, inv_freq, num
        self.p = f"layers.{layer}.attn"
        self.ratio = cfg.compress_ratios[layer]
        self.kv_source = cfg.kv_source_of(layer)
        self.index_keys = index_keys

    # ------------------------------------------------------------------ whole layer
    def __call__(self, u: torch.Tensor, pos: torch.Tensor, spans: List[Span], state: V41State,
                 slots: Slots) -> torch.Tensor:
        cfg, w, num, p = self.cfg, self.w, self.num, self.p
        t = u.shape[0]
        index = cfg.is_index_source(self.layer)
        got = fused_rows.q_kv_rows(u, w, p, cfg, num, pos, self.inv, slots.rope, index)   # the step's launches
        q_index = None
        if got is not None:
            qr, q, kv, q_index, _ = got
        else:
            qr = fused_rows.norm(linear(u, w, f"{p}.wq_a.weight", num), w, f"{p}.q_norm.weight", cfg.norm_eps)
            q = fused_rows.rope(linear(qr, w, f"{p}.wq_b.weight", num).view(t, cfg.n_heads, cfg.head_dim), w, pos,
                                self.inv, slots.rope, inplace=True)
            kv = fused_rows.norm_rope(linear(u, w, f"{p}.wkv.weight", num), w, f"{p}.kv_norm.weight",
                                      cfg.norm_eps, pos, self.inv, slots.rope)
        if cfg.is_kv_source(self.layer) and spans:
            self._compress(u, spans, state)
        if cfg.is_index_source(self.layer):
            self._index(u, qr, pos, spans, state, slots, q_index)
        ops = ops_of(w)
        routed = ops is not None and ops.attention
        # The routed kernel writes q's dtype: no fp32 round trip of the [T, H, Dh] output (1 GiB at 8K rows).
        o = torch.empty(t, cfg.n_heads, cfg.head_dim, dtype=q.dtype if routed else num.acc, device=u.device)
        if routed:
            o = attend_spans(self, q, kv, spans, state, slots, o)
        else:
            for sp in spans:
                self._attend(q, kv, sp, state, slots, o)
        return grouped_output(o, pos, self.inv, cfg, w, p, num, slots.rope, inplace=True)

    # ------------------------------------------------------------------ window + sparse attention
    def _window_rows(self, kv: torch.Tensor, sp: Span, state: V41State):
        """(kv rows [L, Dh] on the grid, their positions [L]) a chunk's window reads: ring rows
        of positions max(floor, ctx-W+1)..ctx-1, then the chunk's rows; the ring is updated."""
        ring = state.windows[self.layer]
        size = ring.shape[1]
        dev = kv.device
        lo = max(sp.floor, sp.ctx - self.cfg.window_size + 1, 0)
        old_pos = torch.arange(lo, sp.ctx, device=dev)
        old = mx.unpack_window_rows(ring[sp.slot, old_pos % size], self.num.dtype)
        packed = mx.pack_window_rows(kv[sp.start:sp.start + sp.n])                  # [n, bytes]
        new = mx.unpack_window_rows(packed, self.num.dtype)
        keep = min(sp.n, size)
        new_pos = torch.arange(sp.ctx, sp.end, device=dev)
        ring[sp.slot, new_pos[-keep:] % size] = packed[-keep:]
        return torch.cat([old, new]), torch.cat([old_pos, new_pos])

    def _attend(self, q, kv, sp: Span, state: V41State, slots: Slots, out: torch.Tensor) -> None:
        cfg = self.cfg
        rows, rpos = self._window_rows(kv, sp, state)
        dev = q.device
        win = cfg.window_size
        entries = picks = None
        if self.ratio and sp.end // self.ratio:
            # Only the entries some row of the span selected are read and decoded.
            src = state.sources[self.kv_source]
            sel = slots.topk[sp.start:sp.start + sp.n]
            used, picks = torch.unique(sel.clamp(min=0), return_inverse=True)  # picks [n, K] -> used
            idx = _page_index(sp, used, self.ratio, state.layout.block_size)
            entries = mx.unpack_compressed_entries(src.entries.view(-1, src.entries.shape[-1])[idx],
                                                   self.num.dtype)              # [len(used), Dh]
        sink = self.w.float(f"{self.p}.attn_sink")
        first_local = rpos.shape[0] - sp.n                                      # local index of position ctx
        for r0 in range(0, sp.n, ROW_CHUNK):
            r1 = min(sp.n, r0 + ROW_CHUNK)
            p = torch.arange(sp.ctx + r0, sp.ctx + r1, device=dev)               # [R]
            loc = (first_local + r0 + torch.arange(r1 - r0, device=dev))[:, None] - torch.arange(win, device=dev)
            lpos = p[:, None] - torch.arange(win, device=dev)                     # [R, W]
            valid = (lpos >= max(sp.floor, 0)) & (loc >= 0)
            cand = rows[loc.clamp(min=0)]                                         # [R, W, Dh]
            if entries is not None:
                sel = slots.topk[sp.start + r0:sp.start + r1]                    # [R, K]
                cand = torch.cat([cand, entries[picks[r0:r1]]], dim=1)
                valid = torch.cat([valid, sel >= 0], dim=1)
            qs = q[sp.start + r0:sp.start + r1]
            out[sp.start + r0:sp.start + r1] = sparse_attend(qs, cand, valid, sink, cfg.head_dim ** -0.5)

    # ------------------------------------------------------------------ compressor (kv sources)
    def _compress(self, u: torch.Tensor, spans: List[Span], state: V41State) -> None:
        """The compressor over every span at once: one projection of all rows, the ratio-2 groups that
        complete in this step pooled together (carry-over rows from each sequence's ring), one write of
        the index keys and one of the compressed entries (one registry insert each when routed). Its norms
        are ``fused_rows.norm``, as the tensor-only step's compressor (same bits on the Triton path)."""
        cfg, w, num, p = self.cfg, self.w, self.num, self.p
        src = state.sources[self.layer]
        r = self.ratio
        dev = u.device
        row0, acc = [], 0
        for sp in spans:
            row0.append(acc)
            acc += sp.n
        first = [sp.ctx // r if r != 1 else sp.ctx for sp in spans]     # first entry completing here
        count = [sp.end // r - f if r != 1 else sp.n for sp, f in zip(spans, first)]
        keep = [min(sp.n, src.kv_rows.shape[1]) if r != 1 else 0 for sp in spans]
        row0_, first_, count_, ctx, slot, n, keep_ = host_ints(
            list(zip(row0, first, count, [sp.ctx for sp in spans], [sp.slot for sp in spans],
                     [sp.n for sp in spans], keep)), dev).unbind(1)
        x = u[span_rows(spans)]
        gseg, k = segments(count_, sum(count))
        ent = first_[gseg] + k                                                     # [G] entry ids
        if r == 1:
            latent = fused_rows.norm(plain_linear(x, w, f"{p}.compressor.wkv.weight", num.dtype), w,
                                     f"{p}.compressor.norm.weight", cfg.norm_eps)
        else:
            a = acc_dtype(num.dtype)
            kv_a = acc_linear(x, w, f"{p}.compressor.wkv.weight", a)               # [rows, Dh]
            gate = acc_linear(x, w, f"{p}.compressor.wgate.weight", a)
            ring = src.kv_rows.shape[1]
            kv_ring = src.kv_rows.view(-1, src.kv_rows.shape[-1])
            gate_ring = src.gate_rows.view(-1, src.gate_rows.shape[-1])
            latent = None
            if sum(count):
                gpos = ent[:, None] * r + torch.arange(r, device=dev)              # [G, r]
                start = ctx[gseg][:, None]
                in_chunk = (gpos >= start)[..., None]
                li = row0_[gseg][:, None] + (gpos - start).clamp(min=0)
                old = slot[gseg][:, None] * ring + gpos % ring
                ka = torch.where(in_chunk, kv_a[li], kv_ring[old].to(a))
                ga = torch.where(in_chunk, gate[li], gate_ring[old].to(a))
                pooled = (ka * torch.softmax(ga, dim=1)).sum(1)
                latent = fused_rows.norm(pooled.to(num.dtype), w, f"{p}.compressor.norm.weight", cfg.norm_eps)
            ks, kk = segments(keep_, sum(keep))
            local = n[ks] - keep_[ks] + kk                                         # each span's last ``keep`` rows
            dst = slot[ks] * ring + (ctx[ks] + local) % ring
            kv_ring[dst] = kv_a[row0_[ks] + local].to(kv_ring.dtype)
            gate_ring[dst] = gate[row0_[ks] + local].to(gate_ring.dtype)
            if latent is None:
                return
        epos = ent * r
        keys = fused_rows.norm(plain_linear(latent, w, f"{p}.indexer.wk.weight", num.dtype), w,
                               f"{p}.indexer.k_norm.weight", cfg.norm_eps)
        dest = page_rows(block_table(spans), gseg, ent, r, state.layout.block_size)
        ops = ops_of(w)
        if ops is not None and ops.attention:  # quantised on insert by the registry op
            insert_rows(ops, src.keys, dest, apply_rope(keys, epos, self.inv), "index")
            insert_rows(ops, src.entries, dest, apply_rope(latent, epos, self.inv), "compressed")
            return
        src.keys.view(-1, src.keys.shape[-1])[dest] = mx.pack_index_keys(apply_rope(keys, epos, self.inv))
        src.entries.view(-1, src.entries.shape[-1])[dest] = mx.pack_compressed_entries(
            apply_rope(latent, epos, self.inv))

    # ------------------------------------------------------------------ indexer (index sources)
    def _keys(self, layer: int, sp: Span, n: int, state: V41State) -> torch.Tensor:
        src = state.sources[layer]
        idx = _page_index(sp, torch.arange(n, device=src.keys.device), src.ratio, state.layout.block_size)
        return mx.unpack_index_keys(src.keys.view(-1, src.keys.shape[-1])[idx], self.num.dtype)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        a = wts.dtype
        dots = torch.einsum("nhd,sd->nsh", q.to(a), keys.to(a))
        if self.num.act_quant:  # the reference's bf16 score arithmetic
            r = bf16_round(bf16_round(F.relu(bf16_round(dots))) * bf16_round(wts)[:, None, :])
            return bf16_round(r.sum(-1))
        return (F.relu(dots) * wts[:, None, :]).sum(-1)

    def _index(self, u, qr, pos, spans: List[Span], state: V41State, slots: Slots,
               q: Optional[torch.Tensor] = None) -> None:
        """``q``: the indexer's query when the q projections computed it (``fused_rows.q_kv_rows``)."""
        cfg, w, num = self.cfg, self.w, self.num
        p = f"{self.p}.indexer"
        t = u.shape[0]
        dev = u.device
        if q is None:
            q = linear(qr, w, f"{p}.wq_b.weight", num).view(t, cfg.index_n_heads, cfg.index_head_dim)
            q = fused_rows.rope(q, w, pos, self.inv, slots.rope, qdq=True)
        wts = plain_linear(u, w, f"{p}.weights_proj.weight", num.dtype).to(num.acc) \
            * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        r = self.ratio
        topk = torch.full((t, cfg.index_topk), -1, dtype=torch.long, device=dev)
        ops = ops_of(w)
        if ops is not None and ops.attention:
            index_spans(self, q, wts, pos, spans, state, slots, topk)
            slots.topk = topk
            slots.record[self.layer] = topk
            return
        n_max = max(sp.end // r for sp in spans)
        is_cand = cfg.is_candidate_source(self.layer)
        cand_all = torch.zeros(t, n_max, dtype=torch.bool, device=dev) if is_cand else None
        seen = None
        if slots.scores is not None:
            seen = slots.scores[self.layer] = torch.full((t, n_max), float("-inf"), device=dev)
        last_src = max(cfg.kv_source_layers)
        for sp in spans:
            n = sp.end // r
            if n == 0:
                continue
            keys = self._keys(self.kv_source, sp, n, state)
            shipped = (self.index_keys == "shipped" and sp.n == 1 and r == 2 and cfg.is_kv_source(self.layer)
                       and (sp.ctx + 1) % r != 0 and last_src != self.layer)
            if shipped:  # the shipped reference scores the last published keys (§5.2)
                keys = self._keys(last_src, sp, n, state)
            for r0 in range(0, sp.n, ROW_CHUNK):
                r1 = min(sp.n, r0 + ROW_CHUNK)
                rows = slice(sp.start + r0, sp.start + r1)
                sc = self._scores(q[rows], keys, wts[rows])                       # [R, n]
                visible = (pos[rows] + 1) // r
                sc = sc.masked_fill(torch.arange(n, device=dev)[None, :] >= visible[:, None], float("-inf"))
                if is_cand:
                    cand = candidate_blocks(sc, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
                    cand_all[rows, :n] = cand
                elif cfg.reads_candidates(self.layer):
                    sc = sc.masked_fill(~slots.candidates[rows, :n], float("-inf"))
                if seen is not None:
                    seen[rows, :n] = sc
                k = min(cfg.index_topk, n)
                sel = topk_ids(sc, k)
                sel = torch.where(sc.gather(1, sel) > float("-inf"), sel, torch.full_like(sel, -1))
                topk[rows, :k] = sel
        slots.topk = topk
        slots.record[self.layer] = topk
        if is_cand:
            slots.candidates = cand_all
