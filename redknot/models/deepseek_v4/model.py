"""The DeepSeek-V4 model: embedding, mHC layers, HyperHead, final norm, head, MTP layer.

``forward`` runs one engine step over the incremental state; ``compute_logits`` turns
pre-head streams into fp32 logits; ``mtp_forward`` runs the MTP layer (reference §6).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from redknot.kernels import KernelSet
from redknot.models.deepseek_v4.block import Block, MTPLayer
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.layers import Embedding, Linear, LinearGroup, Norm
from redknot.models.deepseek_v4.moe import Experts, SharedExpert
from redknot.models.deepseek_v4.params import FLOAT, ParamFactory
from redknot.models.deepseek_v4.rope import RopeTables
from redknot.models.deepseek_v4.state import V4State
from redknot.step.context import StepContext
from redknot.step.metadata import StepMetadata


class DeepseekV4(nn.Module):
    """DeepSeek-V4 with native checkpoint parameter names (routed experts stacked per layer)."""

    # A tensor_only decode step reads every per-step value from the metadata tensors (CUDA graphs).
    supports_cuda_graphs = True

    def __init__(self, cfg: V4Config, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
                 device="meta", kernels: Optional[KernelSet] = None, with_mtp: bool = True):
        super().__init__()
        f = ParamFactory(cfg, dtype, keep_quantized, device)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.cfg, self.dtype = cfg, dtype
        self.ks = kernels or KernelSet()
        self.embed = Embedding(f, cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            Block(f, cfg, cfg.compress_ratio(i), cfg.is_hash_layer(i)) for i in range(cfg.num_layers))
        self.norm = Norm(f, d, cfg.rms_norm_eps)
        self.hc_head_fn = f.fp32(n, n * d)
        self.hc_head_base = f.fp32(n)
        self.hc_head_scale = f.fp32(1)
        self.head = Linear(f, cfg.vocab_size, d, FLOAT)
        self.mtp = nn.ModuleList(MTPLayer(f, cfg) for _ in range(cfg.num_mtp_layers if with_mtp else 0))
        # First of the window-only layers at the top of the stack (== num_layers when there are none).
        self.tail_start = cfg.num_layers - cfg.num_trailing_sliding_layers
        self._rope: Optional[RopeTables] = None
        # (layer, streams leaving it, None): DSpark taps of a varlen tensor-only step (varlen_step.py); the
        # eager forward hands them over through forward hooks instead.
        self.tap_hook = None

    @property
    def supports_varlen_graphs(self) -> bool:
        """:func:`varlen_step.varlen_forward` takes 1..γ+1 rows per request from ``query_start_loc`` (DSpark
        verify in CUDA graphs); not with expert-parallel MoE dispatch."""
        from redknot.models.deepseek_v4.varlen_step import varlen_blocker

        return varlen_blocker(self) is None

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def rope(self) -> RopeTables:
        if self._rope is None or self._rope.inv["main"].device != self.device:
            self._rope = RopeTables(self.cfg, self.device)
        self._rope.kernels = self.ks
        return self._rope

    def _context(self, meta: StepMetadata) -> StepContext:
        return StepContext(meta, self.rope, self.dtype)

    @torch.no_grad()
    def forward(self, meta: StepMetadata, state: V4State) -> torch.Tensor:
        """One step over the state: -> pre-HyperHead streams [T, hc_mult, D].

        With ``meta.replay_from`` (compact SWA replay) the window-only top layers compute only
        the rows at or after it; the other rows' returned streams are not meaningful."""
        ctx = self._context(meta)
        x = self.embed(meta.input_ids)  # [T, D]
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, n, D]
        compact = meta.replay_from is not None and self.tail_start < self.cfg.num_layers
        end = self.tail_start if compact else self.cfg.num_layers
        for layer, st in zip(self.layers[:end], state.layers[:end]):
            streams = layer(self.ks, streams, ctx, st, meta.input_ids)
        return self._compact_tail(meta, state, streams) if compact else streams

    def _compact_tail(self, meta: StepMetadata, state: V4State, streams: torch.Tensor) -> torch.Tensor:
        rows, sub = meta.suffix(meta.replay_from)
        if sub is None:
            return streams
        ctx = self._context(sub)
        part = streams[rows]  # [R, n, D]
        for layer, st in zip(self.layers[self.tail_start:], state.layers[self.tail_start:]):
            part = layer(self.ks, part, ctx, st, sub.input_ids)
        return streams.index_copy(0, rows, part)

    def _head(self, streams: torch.Tensor, fn, base, scale, norm: Norm) -> torch.Tensor:
        cfg = self.cfg
        h = self.ks.mhc_head(streams, fn, base, scale, cfg.hc_eps, cfg.rms_norm_eps)  # [N, D]
        h = norm(self.ks, h)
        return self.head(self.ks, h).float()  # [N, vocab]

    @torch.no_grad()
    def compute_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Pre-head streams [N, hc_mult, D] -> fp32 logits [N, vocab]."""
        return self._head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.norm)

    @torch.no_grad()
    def mtp_forward(self, meta: StepMetadata, state: V4State, prev_streams: torch.Tensor,
                    next_token_ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """MTP layer at the step's positions: row t combines the target streams at t with token t+1.
        -> (MTP pre-head streams [T, hc_mult, D], fp32 logits of meta.logits_indices [N, vocab])."""
        if not len(self.mtp):
            raise RuntimeError("this model was built without its MTP layer")
        mtp = self.mtp[0]
        ctx = self._context(meta)
        streams = mtp.embed_streams(self.ks, prev_streams, self.embed(next_token_ids))
        streams = mtp(self.ks, streams, ctx, state.mtp[0], meta.input_ids)
        rows = streams[meta.logits_indices]
        if rows.shape[0] == 0:  # a catch-up step that drafts nothing
            return streams, torch.empty(0, self.cfg.vocab_size, dtype=torch.float32, device=streams.device)
        logits = self._head(rows, mtp.hc_head_fn, mtp.hc_head_base, mtp.hc_head_scale, mtp.norm)
        return streams, logits

    def fuse_projections(self) -> int:
        """Concatenate the weights of the linears that read one input (each attention layer's projections of
        x, and of the q latent) so that each group runs as one linear per storage format, and the routed
        experts' and the shared expert's float gate and up stacks (one GEMM each, ``Experts.fuse_gate_up``); the
        parameters keep their names and view the concatenations. Returns the linear launches a step saves (0 on
        the meta device)."""
        for m in self.modules():
            if isinstance(m, (Experts, SharedExpert)):
                m.fuse_gate_up()
        return sum(m.fuse() for m in self.modules() if isinstance(m, LinearGroup))

    def set_kernels(self, kernels: KernelSet) -> None:
        self.ks = kernels

    def num_parameters(self, include_mtp: bool = False) -> int:
        return sum(p.numel() for name, p in self.named_parameters() if include_mtp or not name.startswith("mtp."))
