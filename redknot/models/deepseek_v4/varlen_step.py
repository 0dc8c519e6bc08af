"""A V4 step that reads every per-step value from device tensors, 1..γ+1 rows per request
(DSpark's variable-length verify inside CUDA graphs).

The eager path (:class:`DeepseekV4.forward`) walks Python spans: per sequence it slices rows, sizes
tensors by the sequence's length and branches on which compressor windows close. A captured graph
replays fixed kernels over whatever its buffers hold, so here every shape depends only on the padded
row count ``T``, the request count ``B`` and the block-table width ``W``, and every per-step fact is a
tensor computed on the device:

* rows -> requests from ``query_start_loc``; rows at or past ``query_start_loc[B]`` are padding, each
  a request of its own on the spare slot and block (the last slot and block of the state: the engine
  runner's ``padding_slot``/``padding_block``), so they touch nothing a real request reads;
* each row is then handed to the layers as a one-token "decode" row of its own (a ``tensor_only``
  :class:`StepMetadata` whose sequence b is row b: its position, its request's slot and block table),
  so attention, the indexer and the compressed-entry visibility are the tensor-only decode math of
  :mod:`redknot.kernels.ref_attention` and :mod:`attention`;
* in-step look-back: a row's window (and its compressor windows) may reach rows of its own request
  earlier in this step. The step stores its rows in the SWA and compressor rings *before* reading them
  (the eager path stores after): a request feeds at most γ+1 = ``max_backtrack``+1 rows and every ring
  holds ``max_backtrack`` rows beyond what one position reads (:class:`StateLayout`), so a store never
  overwrites a row a query of this step still reads, and every row a query reads holds the eager
  value. A request keeps only its last ``ring`` rows (all of them, under that bound); the others
  would go to the spare slot;
* compressors (CSA ratio 4 with the overlapping previous window, HCA ratio 128): every row pools the
  window ending at its position (the previous window too where it overlaps, position < 0 weighing
  nothing, as the eager first window) and only rows closing a window, (p+1) % m == 0, store the entry;
  the others store into the spare block, which no request's table names (a non-closing row of the same
  request must not rewrite an entry a closing row of this step has just made);
* the indexer scores every entry a block table can address and masks those a row cannot see
  (w >= (p+1)//m), so its top-k needs no host count (-1: none, as eager);
* the MoE runs every expert on every row (:func:`redknot.kernels.ref_moe.moe`'s capture path) where
  the kernel set's ``moe`` is the reference op (its eager path counts rows per expert on the host).

The layers' own parameters and kernel ops (``ks``) compute everything else, in the eager order, so
results match the eager step up to summation order. The streams leaving each layer go to the model's
``tap_hook`` (DSpark taps) as the eager path's forward hooks take them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from redknot.kernels.ref_moe import _moe_every_expert
from redknot.models.deepseek_v4.attention import visible_entries
from redknot.models.deepseek_v4.compressor import pool_ring_windows
from redknot.models.deepseek_v4.moe import kernel_backend
from redknot.models.deepseek_v4.rope import COMPRESS
from redknot.step.context import StepContext, write_ring
from redknot.step.metadata import StepMetadata


def varlen_blocker(model) -> Optional[str]:
    """Why ``model`` (:class:`DeepseekV4`) cannot run variable-length tensor-only steps (None: it can)."""
    if any(layer.ffn.dispatcher is not None for layer in model.layers):
        return "features.parallel.ep > 1: expert-parallel MoE dispatch is not part of the varlen tensor-only step"
    return None


class VarlenContext(StepContext):
    """A :class:`StepContext` whose metadata treats every row as a one-token sequence of its own
    (``tensor_only``), plus the row -> request facts that decide which rows a ring keeps."""

    def __init__(self, model, state, input_ids: torch.Tensor, positions: torch.Tensor,
                 query_start_loc: torch.Tensor, seq_slots: torch.Tensor, block_tables: torch.Tensor):
        t = input_ids.shape[0]
        dev = input_ids.device
        self.spare_slot, self.spare_block = state.num_slots - 1, state.num_blocks - 1
        qsl = query_start_loc.long()
        b = qsl.shape[0] - 1
        row = torch.arange(t, device=dev)
        raw = torch.searchsorted(qsl[1:].contiguous(), row, right=True)    # B for rows past the last request
        real = raw < b
        seq = raw.clamp(max=max(b - 1, 0))
        self.last = torch.where(real, qsl[(seq + 1).clamp(max=b)] - 1, row)  # last row of the row's request
        self.row = row
        slot = torch.where(real, seq_slots.long()[seq], torch.full_like(row, self.spare_slot))
        tables = block_tables.long()[seq]                                                  # [T, W]
        tables = torch.where(real[:, None], tables, torch.full_like(tables, self.spare_block))
        meta = StepMetadata(input_ids=input_ids, positions=positions.long(), query_start_loc=row_starts(t, dev),
                            seq_slots=slot, block_tables=tables.to(block_tables.dtype), logits_indices=row,
                            num_tokens_per_seq=[1] * t, context_lens=[0] * t, seq_slot_list=[0] * t,
                            query_start_list=list(range(t)), tensor_only=True)
        super().__init__(meta, model.rope, model.dtype)

    direct_ring_writes = False  # rows of one request share a slot: ring_write_rows sends the early ones away

    def ring_write_rows(self, ring: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, flat ring index slot*ring + pos % ring): each request stores its last ``ring`` rows (as
        the eager path does), any earlier row goes to the spare slot so no index of a real slot is
        written twice."""
        def rows():
            keep = (self.last - self.row) < ring
            slot = torch.where(keep, self.meta.seq_slots, torch.full_like(self.meta.seq_slots, self.spare_slot))
            return self.row, slot * ring + self.meta.positions.remainder(ring)
        return self.memo(("ring rows", ring), rows)


def row_starts(t: int, device) -> torch.Tensor:
    """query_start_loc of T one-row sequences: 0..T (int32)."""
    return torch.arange(t + 1, dtype=torch.int32, device=device)


def compressor_update(comp, ks, kv: torch.Tensor, gate: torch.Tensor, ctx: VarlenContext, kv_ring: torch.Tensor,
                      gate_ring: torch.Tensor, pool: torch.Tensor) -> None:
    """:meth:`Compressor.update_projected` of a varlen step (kv, gate: the step's projections [T, C]): store the
    rows, pool the window ending at every row's position (with the window before it where windows overlap),
    store the entries of the closing rows and send every other row's entry to the spare block."""
    kv, gate = kv.float(), gate.float()  # [T, C]
    write_ring(kv_ring, ctx, kv)      # first: a row's windows may reach earlier rows of this step
    write_ring(gate_ring, ctx, gate)
    meta, m, per_block = ctx.meta, comp.ratio, pool.shape[1]
    pos = meta.positions  # [T]
    pooled = pool_ring_windows(comp, ks, kv_ring, gate_ring, pos, meta.seq_slots)  # [T, hd]
    closes = (pos + 1) % m == 0  # [T]
    w = ((pos + 1) // m - 1).clamp(min=0)  # the entry p closes (where it does)
    cos, sin = ctx.rope.cos_sin(COMPRESS, w * m)
    made = ks.rope(comp.norm(ks, pooled), cos, sin)  # [T, hd]
    block = meta.block_tables.gather(1, (w // per_block)[:, None].long()).squeeze(1).long()
    block = torch.where(closes, block, torch.full_like(block, ctx.spare_block))
    dest = block * per_block + w % per_block  # [T]
    pool.view(-1, comp.head_dim).index_copy_(0, dest, made.to(pool.dtype))


def attention(attn, ks, x: torch.Tensor, ctx: VarlenContext, st) -> torch.Tensor:
    """:meth:`Attention.forward` of a varlen step (window ring stored before the attention reads it)."""
    t, cfg = x.shape[0], attn.cfg
    cos, sin = ctx.cos_sin(attn.rope_kind)
    p = attn.projections(ks, x)
    c_q = attn.q_norm(ks, p.q_latent)  # [T, q_lora]
    kv = ks.rms_norm_rope(p.kv, attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)  # [T, hd]: K = V
    q, q_idx = attn.queries(ks, c_q)  # [T, H, hd]
    pool: Optional[torch.Tensor] = None
    idx: Optional[torch.Tensor] = None
    if attn.compressor is not None:
        compressor_update(attn.compressor, ks, *p.compressor, ctx, st.kv_rows, st.gate_rows, st.entries)
        pool = st.entries
        if attn.indexer is None:
            idx = visible_entries(ctx, attn.ratio, st.entries.shape[1], ks)
        else:
            compressor_update(attn.indexer.compressor, ks, *p.index_compressor, ctx, st.idx_kv_rows,
                              st.idx_gate_rows, st.idx_keys)
            idx = attn.indexer.select(ks, None, c_q, ctx, st.idx_keys, q=q_idx, weights=p.index_weights)
    q = ks.rms_norm_rope(q, None, cfg.rms_norm_eps, cos, sin)
    write_ring(st.swa, ctx, kv)  # first: the window of a row may reach earlier rows of this step
    o = ks.sparse_attention(q, kv, st.swa, attn.attn_sink, attn.head_dim ** -0.5, cfg.sliding_window,
                            ctx.meta, pool, idx)  # [T, H, hd]
    o = ks.rope_inplace(o, cos, sin, inverse=True)
    o = ks.grouped_linear(o.view(t, cfg.o_groups, -1), attn.wo_a.weight, attn.wo_a.scale)  # [T, G, R]
    return attn.wo_b(ks, o.flatten(1))


def moe(ffn, ks, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """:meth:`MoE.forward` without a host read: the reference op's capture path (every expert on every
    row, each slot keeping the rows that chose it) unless the kernel set's ``moe`` is another op."""
    if kernel_backend(ks, "moe") != "reference":
        return ffn(ks, x, input_ids)
    idx, weights = ffn.gate(ks, x, input_ids)
    ex, sh = ffn.experts, ffn.shared_experts
    routed = _moe_every_expert(x, idx, weights, ex.w1, ex.w2, ex.w3, ffn.limit, ex.w1_scale, ex.w2_scale,
                               ex.w3_scale)
    one = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731  [1, ...] expert stack
    ones_idx = torch.zeros(x.shape[0], 1, dtype=torch.long, device=x.device)
    ones_w = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
    shared = _moe_every_expert(x, ones_idx, ones_w, one(sh.w1.weight), one(sh.w2.weight), one(sh.w3.weight),
                               ffn.limit, one(sh.w1.scale), one(sh.w2.scale), one(sh.w3.scale))
    return routed + shared


def block(layer, ks, streams: torch.Tensor, ctx: VarlenContext, st, input_ids: torch.Tensor) -> torch.Tensor:
    """:meth:`Block.forward` of a varlen step: streams [T, n, D] -> [T, n, D]."""
    x, post, comb = layer.pre_norm(ks, streams, "attn")
    a = attention(layer.attn, ks, x, ctx, st)
    streams, x, post, comb = layer.post_pre_norm(ks, a, streams, post, comb, "ffn")
    y = moe(layer.ffn, ks, x, input_ids)
    return ks.mhc_post(y, streams, post, comb)


@torch.no_grad()
def varlen_forward(model, state, *, input_ids: torch.Tensor, positions: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_slots: torch.Tensor,
                   block_tables: torch.Tensor) -> torch.Tensor:
    """One step of ``model`` (:class:`DeepseekV4`): T rows of B requests (1..γ+1 rows each, padding past
    ``query_start_loc[B]``) -> pre-HyperHead streams [T, hc_mult, D], no host read."""
    reason = varlen_blocker(model)
    if reason is not None:
        raise ValueError(reason)
    ctx = VarlenContext(model, state, input_ids, positions, query_start_loc, seq_slots, block_tables)
    ks = model.ks
    x = model.embed(input_ids)  # [T, D]
    streams = x.unsqueeze(1).expand(-1, model.cfg.hc_mult, -1).contiguous()  # [T, n, D]
    hook = getattr(model, "tap_hook", None)
    for i, (layer, st) in enumerate(zip(model.layers, state.layers)):
        streams = block(layer, ks, streams, ctx, st, input_ids)
        if hook is not None:  # DSpark taps: the streams leaving layer i (a replay refills them)
            hook(i, streams, None)
    return streams
