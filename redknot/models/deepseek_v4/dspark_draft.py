"""The DSpark draft model of DeepSeek-V4-Flash-0731 (reference dspark.md §2.3, §7).

* **Taps**: after each target layer of ``dspark_target_layer_ids`` (40, 41, 42; config-driven)
  has fully run, its residual streams [T, hc, D] averaged over hc; concatenated [T, k*D]
  (forward hooks on the target's layers, so the target's code is untouched).
* **Context K/V**: ``main_x = main_norm(main_proj(taps))`` (stage 0's tensors) feeds only the
  stages' K/V: stage s writes ``rope(kv_norm_s(wkv_s(main_x)))`` of every committed position
  into its window ring (size W = sliding window). main_x never enters the residual, HC or MoE.
* **Block**: ids ``[anchor, noise x (g-1)]`` at positions P..P+g-1, the target embedding
  expanded to hc copies; each stage is a V4 block (mHC around attention and MoE, 256 experts)
  whose attention lets every block query see the ring positions P-W..P-1 and the whole block
  (non-causal; block-causal under ``features.dspark.block_attention=causal``), with per-head
  sinks in one softmax, inverse RoPE, grouped output projection.
* **Head** (last stage): sigmoid ``hc_head`` collapse -> h_k (pre-norm); U_k = head(norm(h_k))
  with the target's head; the Markov bias ``markov_w2 . markov_w1[prev]`` (rank r, fp32) and the
  confidence logit ``proj([h_k ; markov_w1[prev]])`` (fp32, no bias; sigmoid and the optional
  per-position temperatures are applied by the caller).

Parameter names equal the checkpoint names (``mtp.{s}.…``), see :func:`draft_checkpoint_spec`.
"""
from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from redknot.models.deepseek_v4.attention import Attention
from redknot.models.deepseek_v4.block import Block
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.dspark_config import DSparkDraftConfig
from redknot.models.deepseek_v4.layers import Linear, Norm
from redknot.models.deepseek_v4.params import FP32, FLOAT, ParamFactory, TensorSpec, _block_spec, _linear_formats
from redknot.models.deepseek_v4.rope import MAIN, RopeTables


def stage_config(cfg: V4Config, dcfg: DSparkDraftConfig) -> V4Config:
    """The V4 block config of a draft stage: the target's, with the stage's expert count and top-k."""
    return replace(cfg, n_routed_experts=dcfg.n_routed_experts or cfg.n_routed_experts,
                   num_experts_per_tok=dcfg.num_experts_per_tok or cfg.num_experts_per_tok)


def draft_checkpoint_spec(cfg: V4Config, dcfg: DSparkDraftConfig) -> List[TensorSpec]:
    """Every ``mtp.*`` tensor of a V4 DSpark checkpoint (§2.3 table); no embed/head (shared)."""
    scfg = stage_config(cfg, dcfg)
    lin, _ = _linear_formats(cfg)
    d, n, v, r = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, dcfg.markov_rank
    out: List[TensorSpec] = []

    def add(name: str, shape, fmt: str) -> None:
        out.append(TensorSpec(name, tuple(shape), fmt, name))
    for s in range(dcfg.num_stages):
        p = f"mtp.{s}"
        if s == 0:
            add(f"{p}.main_proj.weight", (d, len(dcfg.target_layer_ids) * d), lin)
            add(f"{p}.main_norm.weight", (d,), FP32)
        out += _block_spec(scfg, p, 0, False)
        if s == dcfg.num_stages - 1:
            add(f"{p}.norm.weight", (d,), FP32)
            add(f"{p}.hc_head_fn", (n, n * d), FP32)
            add(f"{p}.hc_head_base", (n,), FP32)
            add(f"{p}.hc_head_scale", (1,), FP32)
            add(f"{p}.markov_head.markov_w1.weight", (v, r), FLOAT)
            add(f"{p}.markov_head.markov_w2.weight", (v, r), FP32)
            add(f"{p}.confidence_head.proj.weight", (1, d + r), FP32)
    return out


def block_mask(g: int, w: int, device) -> torch.Tensor:
    """[g, W+g] bool: block-causal visibility (all ring columns; block slot i sees block slots <= i)."""
    ring = torch.ones(g, w, dtype=torch.bool, device=device)
    return torch.cat([ring, torch.ones(g, g, dtype=torch.bool, device=device).tril()], dim=1)


class _Weight(nn.Module):
    """A module holding one ``weight`` (checkpoint names ``….markov_w1.weight``, ``….proj.weight``)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


class DSparkAttention(Attention):
    """V4 sliding-window attention parameters; the block attends to its stage's ring + itself."""

    def context_kv(self, ks, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """main_x [T, D] -> ring rows [T, hd] (kv_norm, RoPE at each row's own position)."""
        return ks.rms_norm_rope(self.wkv(ks, main_x), self.kv_norm.weight, self.kv_norm.eps, cos, sin)

    def block(self, ks, x: torch.Tensor, ring_kv: torch.Tensor, ring_valid: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """x [B*g, D] (normed), ring_kv [B, W, hd], ring_valid [B, W] -> [B*g, D]; ``causal``: block
        slot i sees block slots <= i only (``features.dspark.block_attention``)."""
        b, w, hd = ring_kv.shape
        g, h = x.shape[0] // b, self.num_heads
        c_q = self.q_norm(ks, self.wq_a(ks, x))
        q = self.wq_b(ks, c_q).view(b * g, h, hd)
        q = ks.rms_norm_rope(q, None, self.cfg.rms_norm_eps, cos, sin)  # [B*g, H, hd]
        kv = ks.rms_norm_rope(self.wkv(ks, x), self.kv_norm.weight, self.kv_norm.eps, cos, sin)  # [B*g, hd]
        keys = torch.cat([ring_kv.to(kv.dtype), kv.view(b, g, hd)], dim=1).float()  # [B, W+g, hd]
        valid = torch.cat([ring_valid, torch.ones(b, g, dtype=torch.bool, device=x.device)], dim=1)
        logits = torch.einsum("bqhd,bkd->bqhk", q.view(b, g, h, hd).float(), keys) * hd ** -0.5
        mask = valid[:, None, None, :].expand(b, g, 1, w + g)
        if causal:
            mask = mask & block_mask(g, w, x.device)[None, :, None, :]
        logits = logits.masked_fill(~mask, float("-inf"))
        sink = self.attn_sink.float().view(1, 1, h, 1).expand(b, g, h, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]  # the sink only divides
        o = torch.einsum("bqhk,bkd->bqhd", probs, keys).to(x.dtype).reshape(b * g, h, hd)
        o = ks.rope_inplace(o, cos, sin, inverse=True)
        o = ks.grouped_linear(o.view(b * g, self.cfg.o_groups, -1), self.wo_a.weight, self.wo_a.scale)
        return self.wo_b(ks, o.flatten(1))


class DSparkStage(Block):
    """One draft stage (``mtp.{s}``): a V4 block with DSpark attention; stage 0 also holds
    ``main_proj``/``main_norm``, the last stage the head, Markov and confidence tensors."""

    def __init__(self, f: ParamFactory, cfg: V4Config, dcfg: DSparkDraftConfig, first: bool, last: bool):
        super().__init__(f, cfg, ratio=0, hash_layer=False)
        self.attn = DSparkAttention(f, cfg, 0)
        d, n, v, r = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size, dcfg.markov_rank
        if first:
            self.main_proj = Linear(f, d, len(dcfg.target_layer_ids) * d, f.linear_fmt)
            self.main_norm = Norm(f, d, cfg.rms_norm_eps)
        if last:
            self.norm = Norm(f, d, cfg.rms_norm_eps)
            self.hc_head_fn = f.fp32(n, n * d)
            self.hc_head_base = f.fp32(n)
            self.hc_head_scale = f.fp32(1)
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = _Weight(f.plain(v, r))
            self.markov_head.markov_w2 = _Weight(f.fp32(v, r))
            self.confidence_head = nn.Module()
            self.confidence_head.proj = _Weight(f.fp32(1, d + r))

    def run(self, ks, streams: torch.Tensor, ring_kv: torch.Tensor, ring_valid: torch.Tensor, cos, sin,
            input_ids: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """streams [B*g, n, D] -> [B*g, n, D]."""
        x, post, comb = self.pre_norm(ks, streams, "attn")
        a = self.attn.block(ks, x, ring_kv, ring_valid, cos, sin, causal)
        streams, x, post, comb = self.post_pre_norm(ks, a, streams, post, comb, "ffn")
        y = self.ffn(ks, x, input_ids)
        return ks.mhc_post(y, streams, post, comb)


class DSparkDraft(nn.Module):
    """The three draft stages over a target V4 model (see the module docstring)."""

    def __init__(self, cfg: V4Config, dcfg: DSparkDraftConfig, dtype: torch.dtype = torch.float32,
                 keep_quantized: bool = False, device="meta"):
        super().__init__()
        self.cfg, self.dcfg, self.dtype = cfg, dcfg, dtype
        scfg = stage_config(cfg, dcfg)
        f = ParamFactory(scfg, dtype, keep_quantized, device)
        n = dcfg.num_stages
        self.mtp = nn.ModuleList(DSparkStage(f, scfg, dcfg, s == 0, s == n - 1) for s in range(n))
        self._target = None  # weakref to the target model (not a submodule: its weights are its own)
        self._taps: Dict[int, torch.Tensor] = {}
        self._hooks: list = []
        self._rope: Optional[RopeTables] = None

    # ------------------------------------------------------------------ wiring
    @property
    def device(self) -> torch.device:
        return self.mtp[0].attn_norm.weight.device

    @property
    def block_size(self) -> int:
        return self.dcfg.block_size

    @property
    def window(self) -> int:
        return self.cfg.sliding_window

    @property
    def target(self):
        target = self._target() if self._target is not None else None
        if target is None:
            raise RuntimeError("the DSpark draft is not attached to a live target model")
        return target

    @property
    def ks(self):
        return self.target.ks

    def attach(self, target) -> "DSparkDraft":
        """Share the target's embedding, head and kernels; tap its layers' outputs."""
        num = len(target.layers)
        bad = [i for i in self.dcfg.target_layer_ids if not 0 <= i < num]
        if bad:
            raise ValueError(f"dspark_target_layer_ids {list(self.dcfg.target_layer_ids)}: layers {bad} are not in "
                             f"the model ({num} layers; a model.num_layers cut must keep the tapped layers)")
        for h in self._hooks:
            h.remove()
        self._target = weakref.ref(target)  # the family maps model -> draft; no cycle keeps both alive
        self._hooks = [target.layers[i].register_forward_hook(self._tap_hook(i)) for i in self.dcfg.target_layer_ids]
        target.tap_hook = self.tap_streams  # the varlen tensor-only step (verify graphs) hands its taps here
        return self

    def compact_replay_skips_taps(self) -> bool:
        """Whether compact SWA replay would compute only late rows of a tapped layer (a window-only
        layer at the top of the stack), leaving the taps of early rows missing."""
        tail = getattr(self.target, "tail_start", len(self.target.layers))
        return any(i >= tail for i in self.dcfg.target_layer_ids)

    def _tap_hook(self, layer: int):
        def hook(module, args, out):
            self._taps[layer] = out.mean(dim=1)  # [T, D]: the hc-mean of the completed residual
        return hook

    def tap_streams(self, layer: int, streams: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """The target's ``tap_hook``: ``streams`` [T, hc, D] leaving ``layer`` in a tensor-only step (or
        handed over after a verify-graph replay), kept as the forward hooks keep them."""
        if layer in self.dcfg.target_layer_ids:
            self._taps[layer] = streams.mean(dim=1)

    def last_taps(self, num_rows: int) -> torch.Tensor:
        """[T, k*D] taps of the target's last forward (its ``num_rows`` rows, in step order)."""
        parts = [self._taps.get(i) for i in self.dcfg.target_layer_ids]
        if any(p is None or p.shape[0] != num_rows for p in parts):
            raise RuntimeError(f"DSpark taps of layers {list(self.dcfg.target_layer_ids)} do not cover the step's "
                               f"{num_rows} rows (a compact SWA replay skipping a tapped layer?)")
        return torch.cat(parts, dim=-1)

    def rope(self) -> RopeTables:
        if self._rope is None or self._rope.inv[MAIN].device != self.device:
            self._rope = RopeTables(self.cfg, self.device)
        return self._rope

    # ------------------------------------------------------------------ math
    @torch.no_grad()
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """taps [T, k*D], positions [T] -> ring rows of every stage [num_stages, T, hd]."""
        ks, first = self.ks, self.mtp[0]
        main_x = first.main_norm(ks, first.main_proj(ks, taps.to(self.dtype)))  # [T, D]
        cos, sin = self.rope().cos_sin(MAIN, positions)
        return torch.stack([stage.attn.context_kv(ks, main_x, cos, sin) for stage in self.mtp])

    @torch.no_grad()
    def forward_block(self, anchors: torch.Tensor, positions: torch.Tensor, rings: Sequence[torch.Tensor],
                      slots: torch.Tensor, causal: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """anchors [B] at ``positions`` [B] (P), each stage's ring [S, W, hd], slots [B] ->
        (h [B, g, D] pre-norm, base logits U [B, g, V] fp32); ``causal``: block-causal attention
        within the block instead of bidirectional (``features.dspark.block_attention``, §8 item 3)."""
        ks, cfg, g = self.ks, self.cfg, self.block_size
        b = anchors.shape[0]
        ids = torch.full((b, g), self.dcfg.noise_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        block_pos = (positions[:, None] + torch.arange(g, device=anchors.device)).reshape(-1)  # [B*g]
        cos, sin = self.rope().cos_sin(MAIN, block_pos)
        w = rings[0].shape[1]
        ring_pos = positions[:, None] - w + torch.arange(w, device=anchors.device)  # [B, W]: P-W .. P-1
        ring_valid = ring_pos >= 0
        ring_idx = ring_pos.clamp(min=0) % w
        x = self.target.embed(ids.reshape(-1))  # [B*g, D]
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for stage, ring in zip(self.mtp, rings):
            ring_kv = ring[slots[:, None], ring_idx]  # [B, W, hd]
            streams = stage.run(ks, streams, ring_kv, ring_valid, cos, sin, ids.reshape(-1), causal)
        last = self.mtp[-1]
        h = ks.mhc_head(streams, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, cfg.hc_eps,
                        cfg.rms_norm_eps)  # [B*g, D]
        logits = self.target.head(ks, last.norm(ks, h)).float()
        return h.view(b, g, -1), logits.view(b, g, -1)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """markov_w1[prev]: [..., r] fp32."""
        return self.mtp[-1].markov_head.markov_w1.weight[prev].float()

    @torch.no_grad()
    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] -> [B, V] fp32 bias markov_w2 . markov_w1[prev]."""
        w2 = self.mtp[-1].markov_head.markov_w2.weight.float()  # [V, r]
        return self.markov_embed(prev) @ w2.t()

    @torch.no_grad()
    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [B, g, D], prev [B, g] (x_0..x_{g-1}) -> raw confidence logits [B, g] fp32."""
        proj = self.mtp[-1].confidence_head.proj.weight.float()  # [1, D + r]
        z = torch.cat([h.float(), self.markov_embed(prev)], dim=-1)
        return (z @ proj.t()).squeeze(-1)


def load_draft(target, path: str, hardware, device) -> Optional[DSparkDraft]:
    """The DSpark draft of the checkpoint at ``path`` attached to ``target``, or None when its
    config.json states no DSpark stages."""
    import json
    import os

    from redknot.kernels.dtypes import torch_dtype
    from redknot.models.deepseek_v4.dspark_config import parse_dspark
    from redknot.models.deepseek_v4.weights import load_draft_checkpoint

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        dcfg = parse_dspark(json.load(f))
    if dcfg is None:
        return None
    cfg = target.cfg
    keep = hardware.weight_format == "keep"
    draft = DSparkDraft(cfg, dcfg, torch_dtype(hardware.dtype), keep_quantized=keep, device="meta")
    draft.to_empty(device=device)
    scfg = stage_config(cfg, dcfg)
    load_draft_checkpoint(draft, path, draft_checkpoint_spec(cfg, dcfg), scfg.n_routed_experts)
    return draft.eval().attach(target)
