"""V4 attention (reference §4): low-rank q, one shared K=V head with partial interleaved RoPE,
sliding window + compressed entries (CSA: indexer-selected, HCA: all visible) with per-head
sinks in one softmax, inverse RoPE on the output, grouped output projection."""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn

from redknot.models.deepseek_v4.compressor import Compressor, Indexer
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.layers import Linear, LinearGroup, Norm
from redknot.models.deepseek_v4.params import ParamFactory
from redknot.models.deepseek_v4.rope import rope_kind
from redknot.models.deepseek_v4.state import LayerState
from redknot.step.context import StepContext, write_ring


def visible_entries(ctx: StepContext, ratio: int, per_block: int, ks) -> Optional[torch.Tensor]:
    """[T, max visible] ids of all entries w < (t+1)//ratio of each query (-1 pads), or None (the kernel set's
    ``visible_entries``). A tensor-only step sizes the width by its block tables (``per_block`` entries per
    block)."""
    if ctx.meta.tensor_only:
        most = ctx.meta.block_tables.shape[1] * per_block
    else:
        most = max(sp.end_pos // ratio for sp in ctx.spans)
    if most == 0:
        return None
    return ks.visible_entries(ctx.meta.positions, ratio, most)


class XProjections(NamedTuple):
    """An attention layer's projections of its input x [T, D]: the q latent before its norm, the kv latent
    before its norm and RoPE, the compressor's (kv, gate), the indexer compressor's (kv, gate) and the indexer's
    head weights before their scale (None where the layer has no such part)."""
    q_latent: torch.Tensor
    kv: torch.Tensor
    compressor: Optional[Tuple[torch.Tensor, torch.Tensor]]
    index_compressor: Optional[Tuple[torch.Tensor, torch.Tensor]]
    index_weights: Optional[torch.Tensor]


class Attention(nn.Module):
    """Attention of one layer; ``ratio`` 0 = sliding window only, else the layer's compressor ratio
    (CSA adds the lightning indexer)."""

    def __init__(self, f: ParamFactory, cfg: V4Config, ratio: int):
        super().__init__()
        lin = f.linear_fmt
        d, hd = cfg.hidden_size, cfg.head_dim
        self.cfg, self.ratio = cfg, ratio
        self.num_heads, self.head_dim = cfg.num_heads, hd
        self.rope_kind = rope_kind(ratio)
        self.wq_a = Linear(f, cfg.q_lora_rank, d, lin)
        self.q_norm = Norm(f, cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(f, cfg.num_heads * hd, cfg.q_lora_rank, lin)
        self.wkv = Linear(f, hd, d, lin)
        self.kv_norm = Norm(f, hd, cfg.rms_norm_eps)
        self.wo_a = Linear(f, cfg.o_groups * cfg.o_lora_rank, cfg.num_heads * hd // cfg.o_groups, lin)
        self.wo_b = Linear(f, d, cfg.o_groups * cfg.o_lora_rank, lin)
        self.attn_sink = f.fp32(cfg.num_heads)
        self.compressor = Compressor(f, cfg, ratio, hd, overlap=ratio == cfg.csa_ratio) if ratio else None
        self.indexer = Indexer(f, cfg, lin) if ratio == cfg.csa_ratio else None
        # The linears that read x, and the two that read the q latent: one launch per storage format each once
        # the model's ``fuse_projections`` has run (the q group at decode sizes only: its wide outputs' column
        # slices would be copied by the next ops)
        x_members = [self.wq_a, self.wkv]
        if self.compressor is not None:
            x_members += [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            ic = self.indexer.compressor
            x_members += [ic.wkv, ic.wgate, self.indexer.weights_proj]
        self.x_proj = LinearGroup(x_members)
        self.q_proj = LinearGroup([self.wq_b, self.indexer.wq_b], max_rows=16) if self.indexer is not None else None

    def projections(self, ks, x: torch.Tensor) -> XProjections:
        """This layer's projections of x, by its projection group."""
        y = self.x_proj(ks, x)
        comp = (y[2], y[3]) if self.compressor is not None else None
        idx = (y[4], y[5]) if self.indexer is not None else None
        return XProjections(y[0], y[1], comp, idx, y[6] if self.indexer is not None else None)

    def queries(self, ks, c_q: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(wq_b(c_q) [T, H, hd], the indexer's wq_b(c_q) or None), by the q projection group."""
        t = c_q.shape[0]
        if self.q_proj is None:
            return self.wq_b(ks, c_q).view(t, self.num_heads, self.head_dim), None
        q, q_idx = self.q_proj(ks, c_q)
        return q.view(t, self.num_heads, self.head_dim), q_idx

    def _extra(self, ks, p: XProjections, c_q: torch.Tensor, q_idx: Optional[torch.Tensor], ctx: StepContext,
               st: LayerState) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Update the compressed state; return (entry pool, per-query entry ids) for attention."""
        if self.compressor is None:
            return None, None
        self.compressor.update_projected(ks, *p.compressor, ctx, st.kv_rows, st.gate_rows, st.entries)
        if self.indexer is None:
            per_block = st.entries.shape[1]   # the same ids for every HCA layer of the step: made once
            return st.entries, ctx.memo(("visible entries", self.ratio, per_block),
                                        lambda: visible_entries(ctx, self.ratio, per_block, ks))
        self.indexer.compressor.update_projected(ks, *p.index_compressor, ctx, st.idx_kv_rows, st.idx_gate_rows,
                                                 st.idx_keys)
        return st.entries, self.indexer.select(ks, None, c_q, ctx, st.idx_keys, q=q_idx, weights=p.index_weights)

    def forward(self, ks, x: torch.Tensor, ctx: StepContext, st: LayerState) -> torch.Tensor:
        # Context parallel (redknot.parallel.cp) marks its per-rank step metadata with its plan.
        cp = getattr(ctx.meta, "context_parallel", None)
        if cp is not None:
            return cp.attention(self, ks, x, ctx, st)
        t, cfg = x.shape[0], self.cfg
        cos, sin = ctx.cos_sin(self.rope_kind)
        p = self.projections(ks, x)
        c_q = self.q_norm(ks, p.q_latent)  # [T, q_lora]
        kv = ks.rms_norm_rope(p.kv, self.kv_norm.weight, self.kv_norm.eps, cos, sin)  # [T, hd]: K = V
        q, q_idx = self.queries(ks, c_q)  # [T, H, hd]
        pool, idx = self._extra(ks, p, c_q, q_idx, ctx, st)
        q = ks.rms_norm_rope(q, None, cfg.rms_norm_eps, cos, sin)
        o = ks.sparse_attention(q, kv, st.swa, self.attn_sink, self.head_dim ** -0.5, cfg.sliding_window,
                                ctx.meta, pool, idx)  # [T, H, hd]
        write_ring(st.swa, ctx, kv, ks)
        o = ks.rope_inplace(o, cos, sin, inverse=True)
        o = ks.grouped_linear(o.view(t, cfg.o_groups, -1), self.wo_a.weight, self.wo_a.scale)  # [T, G, R]
        return self.wo_b(ks, o.flatten(1))
