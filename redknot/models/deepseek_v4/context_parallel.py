"""V4's attention under context parallel (the family's :class:`ContextParallelHooks`).

The plan and the collectives are :mod:`redknot.parallel.cp`'s; this module is the
V4 math on a rank's share of the step. V4's per-layer state is compact, so each
layer all-gathers it from the group:

* the step's K=V rows: every rank writes the whole step into its SWA ring
  (the state stays replicated over the group) and builds, for each local chunk,
  a scratch ring holding the window before the chunk — the SWA tail of the
  previous chunk or the state before the step (``step.scratch_ring``);
* the compressors' projected rows (CSA, indexer, HCA): every rank pools every
  entry of the step into its pool, so each query sees exactly the entries and
  indexer keys it would see in one process.

Queries then run through the registered ops with the chunk as the "sequence"
(its first position as context length), so the ops' per-query math is
unchanged: in batch-invariant mode results are bitwise those of one process.
"""
from __future__ import annotations

import torch

from redknot.models.deepseek_v4.attention import visible_entries
from redknot.step.context import StepContext, write_ring


def _compress(step, comp, ks, kv: torch.Tensor, gate: torch.Tensor, full: StepContext, kv_ring, gate_ring,
              pool) -> None:
    """Every rank's projected compressor rows -> the step's entries and ring rows (on every rank)."""
    comp.update_rows(ks, step.gather(kv), step.gather(gate), full, kv_ring, gate_ring, pool)


def _compress_x(step, comp, ks, x: torch.Tensor, full: StepContext, kv_ring, gate_ring, pool) -> None:
    _compress(step, comp, ks, comp.wkv(ks, x).float(), comp.wgate(ks, x).float(), full, kv_ring, gate_ring, pool)


@torch.no_grad()
def idle(step, model, state) -> None:
    """A rank with no rows in this step: the same collectives, in the same order, as the layers'
    forward (so the replicated state is updated too), with zero local rows."""
    ks, full = model.ks, StepContext(step.meta, model.rope, model.dtype)
    device = step.meta.input_ids.device
    for layer, st in zip(model.layers, state.layers):
        attn = layer.attn
        full_kv = step.gather(torch.zeros(0, attn.head_dim, dtype=model.dtype, device=device))
        for comp, rings in ((attn.compressor, (st.kv_rows, st.gate_rows, st.entries)),
                            (attn.indexer.compressor if attn.indexer is not None else None,
                             (st.idx_kv_rows, st.idx_gate_rows, st.idx_keys))):
            if comp is not None:
                empty = torch.zeros(0, comp.wkv.weight.shape[0], dtype=torch.float32, device=device)
                _compress(step, comp, ks, empty, empty, full, *rings)
        write_ring(st.swa, full, full_kv)
        moe = layer.ffn
        if moe.dispatcher is not None:
            k = moe.gate.top_k
            moe.dispatcher(ks, torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=device),
                           torch.zeros(0, k, dtype=torch.long, device=device),
                           torch.zeros(0, k, dtype=torch.float32, device=device), moe.experts, moe.limit)


def attention(step, attn, ks, x: torch.Tensor, ctx: StepContext, st) -> torch.Tensor:
    """``Attention.forward`` for this rank's rows x [T_local, D] of ``step`` (a CPStep): same math,
    gathered state."""
    t, cfg = x.shape[0], attn.cfg
    full = step.full_context(ctx)
    cos, sin = ctx.cos_sin(attn.rope_kind)
    c_q = attn.q_norm(ks, attn.wq_a(ks, x))  # [T_local, q_lora]
    kv = ks.rms_norm_rope(attn.wkv(ks, x), attn.kv_norm.weight, attn.kv_norm.eps, cos, sin)  # [T_local, hd]
    full_kv = step.gather(kv)  # [T, hd]
    ring = step.scratch_ring(st.swa, full_kv, cfg.sliding_window)  # read before the ring write
    pool = idx = None
    if attn.compressor is not None:
        _compress_x(step, attn.compressor, ks, x, full, st.kv_rows, st.gate_rows, st.entries)
        pool = st.entries
        if attn.indexer is not None:
            _compress_x(step, attn.indexer.compressor, ks, x, full, st.idx_kv_rows, st.idx_gate_rows,
                        st.idx_keys)
            idx = attn.indexer.select(ks, x, c_q, ctx, st.idx_keys) if t else None
        elif t:
            idx = visible_entries(ctx, attn.ratio, st.entries.shape[1], ks)
    q = attn.wq_b(ks, c_q).view(t, attn.num_heads, attn.head_dim)  # [T_local, H, hd]
    q = ks.rms_norm_rope(q, None, cfg.rms_norm_eps, cos, sin)
    o = q
    if t:
        o = ks.sparse_attention(q, kv, ring, attn.attn_sink, attn.head_dim ** -0.5, cfg.sliding_window,
                                ctx.meta, pool, idx)
    write_ring(st.swa, full, full_kv)
    o = ks.rope_inplace(o, cos, sin, inverse=True)
    o = ks.grouped_linear(o.view(t, cfg.o_groups, -1), attn.wo_a.weight, attn.wo_a.scale)  # [T_local, G, R]
    return attn.wo_b(ks, o.flatten(1))
