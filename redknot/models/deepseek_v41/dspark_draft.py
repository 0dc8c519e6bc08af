"""The DSpark draft model of DeepSeek-V4.1-Flash (reference dspark.md §2.4, deepseek_v41.md §3.10, §4.6).

What differs from V4-Flash-0731 (``redknot.models.deepseek_v4.dspark_draft``):

* **Taps**: the hc-mean of the residual streams *entering* each layer of
  ``dspark_target_layer_ids`` (37, 38, 39; config-driven), taken after that layer's Engram
  injection; not the layers' outputs (V4). The backbone calls :meth:`V41DSparkDraft.tap` from its
  layer loop (``DeepseekV41.tap_hook``).
* **Stages**: V4.1 blocks with ratio 0 (window attention, RoPE θ 1e4 without YaRN, no compressor or
  indexer), the lagged mHC ``pre`` carried from stage to stage (one-hot into stage 0's attention,
  as for backbone layer 0), MoE with ``dspark_n_routed_experts`` experts, top
  ``dspark_n_activated_experts`` (no VL bias).
* **Head**: no ``hc_head``; the streams collapse with the last stage's FFN ``pre``
  (``hc_collapse(h, pre)``) into h_k (pre-norm), U_k = head(norm(h_k)) with the backbone's head.
  Markov head ``markov_head.embed`` (W1) / ``markov_head.head`` (W2), both [V, r]; the bias
  ``W2 . W1[prev]`` and the confidence logit ``proj([h_k ; W1[prev]])`` are computed in fp32.

Context K/V: ``main_x = main_norm(main_proj(taps))`` feeds only the stages' K/V; stage s keeps
``QDQ_fp8(RoPE(kv_norm_s(wkv_s(main_x))))`` of every committed position in its window ring (the
backbone's window format). The block ``[anchor, noise x (g-1)]`` at positions P..P+g-1 attends
to ring positions P-W..P-1 (those >= 0) and to all g block rows (non-causal; block-causal under
``features.dspark.block_attention=causal``), block K/V through the same FP8 grid, per-head sinks
in the softmax denominator.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple

import torch

from redknot.models.deepseek_v41.attention import sparse_attend
from redknot.models.deepseek_v4.dspark_draft import block_mask  # the same visibility in both families
from redknot.models.deepseek_v41.mhc import hc_collapse, hc_expand, hc_mixes, one_hot_pre
from redknot.models.deepseek_v41.kernel_ops import ops_of
from redknot.models.deepseek_v41.moe import moe_forward, route, swiglu_expert
from redknot.models.deepseek_v41.ref_math import (
    Numerics, Weights, apply_rope, layer_rope, linear, rms_norm, window_qdq)


@dataclass(frozen=True)
class DraftStages:
    """The stage facts the engine's drafter reads (``dcfg`` of both DSpark families)."""
    target_layer_ids: Tuple[int, ...]
    num_stages: int
    block_size: int
    noise_token_id: int
    markov_rank: int


def stage_config(cfg):
    """The V4.1 config the stages' MoE runs with: the DSpark expert count and top-k."""
    return replace(cfg, n_routed_experts=cfg.dspark_n_routed_experts,
                   n_activated_experts=cfg.dspark_n_activated_experts)


class V41DSparkDraft:
    """The ``mtp.*`` stages over a V4.1 backbone (:class:`DeepseekV41`), see the module docstring."""

    def __init__(self, cfg, weights: Weights, numerics: Numerics, device="cpu"):
        if not cfg.n_mtp_layers:
            raise ValueError("V41DSparkDraft: the config has no DSpark stages (n_mtp_layers=0)")
        self.cfg, self.w, self.num = cfg, weights, numerics
        self.scfg = stage_config(cfg)
        self.dcfg = DraftStages(tuple(cfg.dspark_target_layer_ids), cfg.n_mtp_layers, cfg.dspark_block_size,
                                cfg.dspark_noise_token_id, cfg.dspark_markov_rank)
        self._device = torch.device(device)
        self.inv = layer_rope(cfg, 0).to(self._device)
        self._target = None
        # layer -> (forward number, rows | None, tap): a tap of an older forward is stale
        self._taps: Dict[int, Tuple[int, Optional[torch.Tensor], torch.Tensor]] = {}
        self.last = f"mtp.{cfg.n_mtp_layers - 1}"
        self._dense_cache: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    # ------------------------------------------------------------------ wiring
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def block_size(self) -> int:
        return self.dcfg.block_size

    @property
    def window(self) -> int:
        return self.cfg.window_size

    @property
    def target(self):
        target = self._target() if self._target is not None else None
        if target is None:
            raise RuntimeError("the DSpark draft is not attached to a live V4.1 model")
        return target

    def ring_spec(self, state) -> Tuple[int, torch.dtype]:
        """(row width, dtype) of the stages' window rings: FP8-grid values kept in the compute dtype."""
        return self.cfg.head_dim, self.num.dtype

    def attach(self, target) -> "V41DSparkDraft":
        """Tap ``target``'s layer inputs; share its embedding and head (held weakly: the model owns the draft)."""
        bad = [i for i in self.dcfg.target_layer_ids if not 0 <= i < target.cfg.n_layers]
        if bad:
            raise ValueError(f"dspark_target_layer_ids {list(self.dcfg.target_layer_ids)}: layers {bad} are not in "
                             f"the model ({target.cfg.n_layers} layers)")
        self._target = weakref.ref(target)
        target.tap_hook = self.tap
        if getattr(self.w, "ops", None) is None and getattr(target, "ops", None) is not None:
            # The stages' kept FP8 linears and MXFP4 experts run through the backbone's registry ops, as
            # its layers do (otherwise every call would decode each weight to bf16 again).
            self.w.ops = target.ops
        return self

    def _dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A weight the draft applies as a dense tensor (``wo_a``, the Markov and confidence heads),
        decoded once: kept weights (``Weights.keep``) are otherwise decoded again on every call."""
        if not self.w.keep:
            return self.w.dense(name, dtype)
        key = (name, dtype)
        got = self._dense_cache.get(key)
        if got is None:
            got = self._dense_cache[key] = self.w.dense(name, dtype)
        return got

    def tap(self, layer: int, h: torch.Tensor, rows: Optional[torch.Tensor] = None) -> None:
        """Called by the backbone with the streams [n, hc, D] entering ``layer`` (after its Engram);
        ``rows``: the step rows they belong to (bounded replay's tail layers), None for all rows."""
        if layer in self.dcfg.target_layer_ids:
            self._taps[layer] = (self.target.num_forwards, rows, h.mean(dim=1))

    def _tap(self, layer: int, num_rows: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(rows | None, tap) of the last forward; a layer that forward never reached (bounded replay
        with no late rows in the step) has no rows. A CUDA-graph replay runs no Python: it refills the
        captured tap buffers but neither calls :meth:`tap` nor counts the forward, so
        :class:`redknot.speculative.varlen.VerifyGraphs` does both after every replay (the forward
        counted on the backbone, the refilled buffers of the step's rows handed to :meth:`tap`)."""
        got = self._taps.get(layer)
        if got is None or got[0] != self.target.num_forwards:
            return torch.zeros(0, dtype=torch.long, device=self.device), None
        return got[1], got[2]

    def compact_replay_skips_taps(self) -> bool:
        """False: under bounded replay the tail layers' taps exist for the rows at or after each
        sequence's ``replay_from`` (:meth:`computed_rows`), which cover every position a ring is read
        at (``keep_tokens >= W + max_draft + 1``); the drafter writes only those rows."""
        return False

    def computed_rows(self, num_rows: int) -> torch.Tensor:
        """[T] bool: the step rows whose taps the last forward computed."""
        ok = torch.ones(num_rows, dtype=torch.bool, device=self.device)
        for i in self.dcfg.target_layer_ids:
            rows, _ = self._tap(i, num_rows)
            if rows is not None:
                mask = torch.zeros_like(ok)
                mask[rows] = True
                ok &= mask
        return ok

    def last_taps(self, num_rows: int) -> torch.Tensor:
        """[T, k*D] taps of the backbone's last forward (its ``num_rows`` rows, in step order); rows
        the forward did not compute (:meth:`computed_rows`) hold NaN."""
        parts = []
        for i in self.dcfg.target_layer_ids:
            rows, tap = self._tap(i, num_rows)
            if rows is None and tap.shape[0] != num_rows:
                raise RuntimeError(f"DSpark taps of layers {list(self.dcfg.target_layer_ids)} do not cover the "
                                   f"step's {num_rows} rows")
            if rows is not None:
                full = torch.full((num_rows, self.cfg.dim), float("nan"), dtype=self.num.dtype, device=self.device)
                tap = full if tap is None else full.index_copy(0, rows, tap.to(full.dtype))
            parts.append(tap)
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ math
    def _kv(self, x: torch.Tensor, s: int, pos: torch.Tensor) -> torch.Tensor:
        p = f"mtp.{s}.attn"
        kv = rms_norm(linear(x, self.w, f"{p}.wkv.weight", self.num), self.w.float(f"{p}.kv_norm.weight"),
                      self.cfg.norm_eps)
        return window_qdq(apply_rope(kv, pos, self.inv))

    @torch.no_grad()
    def context_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """taps [T, k*D], positions [T] -> ring rows of every stage [num_stages, T, hd]."""
        main = linear(taps.to(self.num.dtype), self.w, "mtp.0.main_proj.weight", self.num)
        main_x = rms_norm(main, self.w.float("mtp.0.main_norm.weight"), self.cfg.norm_eps)
        return torch.stack([self._kv(main_x, s, positions) for s in range(self.dcfg.num_stages)])

    def _attention(self, s: int, u: torch.Tensor, pos: torch.Tensor, ring_kv: torch.Tensor,
                   ring_valid: torch.Tensor, causal: bool = False) -> torch.Tensor:
        """u [B*g, D] (normed) -> [B*g, D]: block queries over ring (W) + block (g) rows (block slots
        <= the query's own only when ``causal``)."""
        cfg, w, num, p = self.cfg, self.w, self.num, f"mtp.{s}.attn"
        b, win, hd = ring_kv.shape
        n = u.shape[0]
        g = n // b
        qr = rms_norm(linear(u, w, f"{p}.wq_a.weight", num), w.float(f"{p}.q_norm.weight"), cfg.norm_eps)
        q = apply_rope(linear(qr, w, f"{p}.wq_b.weight", num).view(n, cfg.n_heads, hd), pos, self.inv)
        kv = self._kv(u, s, pos).view(b, g, hd)
        keys = torch.cat([ring_kv.to(kv.dtype), kv], dim=1)                          # [B, W+g, hd]
        valid = torch.cat([ring_valid, torch.ones(b, g, dtype=torch.bool, device=u.device)], dim=1)
        keys = keys.repeat_interleave(g, dim=0)                                       # every query: all rows
        valid = valid.repeat_interleave(g, dim=0)
        if causal:
            valid = valid & block_mask(g, win, u.device).repeat(b, 1)
        o = sparse_attend(q, keys, valid, w.float(f"{p}.attn_sink"), hd ** -0.5)
        o = apply_rope(o.to(num.dtype), pos, self.inv, inverse=True)
        wo_a = self._dense(f"{p}.wo_a.weight", num.dtype).view(cfg.o_groups, cfg.o_lora_rank, -1)
        z = torch.einsum("ngk,grk->ngr", o.reshape(n, cfg.o_groups, -1), wo_a).reshape(n, -1)
        return linear(z, w, f"{p}.wo_b.weight", num)

    @torch.no_grad()
    def forward_block(self, anchors: torch.Tensor, positions: torch.Tensor, rings: Sequence[torch.Tensor],
                      slots: torch.Tensor, causal: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """anchors [B] at ``positions`` [B] (P), each stage's ring [S, W, hd], slots [B] ->
        (h [B, g, D] pre-norm, base logits U [B, g, V] in the accumulation dtype); ``causal``:
        block-causal attention within the block (``features.dspark.block_attention``, §8 item 3)."""
        cfg, w, num, g = self.cfg, self.w, self.num, self.block_size
        b, dev = anchors.shape[0], anchors.device
        ids = torch.full((b, g), self.dcfg.noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        pos = (positions[:, None] + torch.arange(g, device=dev)).reshape(-1)           # [B*g]
        win = rings[0].shape[1]
        ring_pos = positions[:, None] - win + torch.arange(win, device=dev)             # P-W .. P-1
        ring_valid = ring_pos >= 0
        ring_idx = ring_pos.clamp(min=0) % win
        target = self.target
        e = target.w.dense("embed.weight", num.dtype)[ids.reshape(-1)]
        h = e.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()                    # [B*g, hc, D]
        pre = one_hot_pre(h.shape[0], cfg.hc_mult, num.dtype, dev)
        mix = (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        for s, ring in enumerate(rings):
            p = f"mtp.{s}"
            pre_a, post_a, c_a = hc_mixes(h, w.float(f"{p}.hc_attn_fn"), w.float(f"{p}.hc_attn_base"),
                                          w.float(f"{p}.hc_attn_scale"), *mix)
            u = rms_norm(hc_collapse(h, pre), w.float(f"{p}.attn_norm.weight"), cfg.norm_eps)
            att = self._attention(s, u, pos, ring[slots[:, None], ring_idx], ring_valid, causal)
            h = hc_expand(att, h, post_a, c_a)
            pre_f, post_f, c_f = hc_mixes(h, w.float(f"{p}.hc_ffn_fn"), w.float(f"{p}.hc_ffn_base"),
                                          w.float(f"{p}.hc_ffn_scale"), *mix)
            u = rms_norm(hc_collapse(h, pre_a), w.float(f"{p}.ffn_norm.weight"), cfg.norm_eps)
            h = hc_expand(stage_moe(u, w, s, self.scfg, num), h, post_f, c_f)
            pre = pre_f
        x = hc_collapse(h, pre)                                                       # [B*g, D] pre-norm
        y = rms_norm(x, w.float(f"{self.last}.norm.weight"), cfg.norm_eps)
        return x.view(b, g, -1), self._head(target, y).view(b, g, -1)

    def _head(self, target, y: torch.Tensor) -> torch.Tensor:
        """Normed rows -> logits in the accumulation dtype with the backbone's head, as the backbone
        computes its own (``DeepseekV41.head_logits``)."""
        return target.head_logits(y)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        """W1[prev] (``markov_head.embed``): [..., r] in the accumulation dtype."""
        return self._dense(f"{self.last}.markov_head.embed.weight", self.num.acc)[prev]

    @torch.no_grad()
    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """prev [B] -> [B, V] bias ``markov_head.head . W1[prev]``."""
        return self.markov_embed(prev) @ self._dense(f"{self.last}.markov_head.head.weight", self.num.acc).t()

    @torch.no_grad()
    def confidence_logits(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """h [B, g, D], prev [B, g] (x_0..x_{g-1}) -> raw confidence logits [B, g]."""
        proj = self._dense(f"{self.last}.confidence_head.proj.weight", self.num.acc)    # [1, D + r]
        z = torch.cat([h.to(self.num.acc), self.markov_embed(prev)], dim=-1)
        return (z @ proj.t()).squeeze(-1)


def stage_moe(u: torch.Tensor, w: Weights, s: int, scfg, num: Numerics) -> torch.Tensor:
    """Stage ``s``'s MoE, u [N, D] -> [N, D], without reading anything on the host, so the block forward
    can be captured in a CUDA graph (:class:`redknot.speculative.draft_graphs.DraftGraphs`): the routed
    experts through the registry's kernel when the weights route there; else every expert over every
    row with its routing weight (0 where the row does not route to it), expert ascending and then the
    shared expert, the per-row summation order of ``moe_forward``'s grouped loop (whose per-expert row
    counts are read on the host). Expert parallel layers go through ``moe_forward``."""
    prefix = f"mtp.{s}.ffn"
    if getattr(w, "expert_dispatch", None):
        return moe_forward(u, w, s, scfg, num, prefix=prefix)
    ids, weights = route(u, w, prefix, scfg, num.acc)
    ops = ops_of(w)
    routed = None if ops is None else ops.moe(u, ids, weights, w, prefix, scfg, num)
    shared = swiglu_expert(u, w, f"{prefix}.shared_experts", num, scfg.swiglu_limit, None)
    if routed is not None:
        return (routed.to(num.acc) + shared).to(num.dtype)
    experts = torch.arange(scfg.n_routed_experts, device=u.device)
    dense_w = ((ids[:, :, None] == experts) * weights[:, :, None]).sum(1)          # [N, E]
    out = torch.zeros(u.shape[0], scfg.dim, dtype=num.acc, device=u.device)
    for e in range(scfg.n_routed_experts):
        out += swiglu_expert(u, w, f"{prefix}.experts.{e}", num, scfg.swiglu_limit, dense_w[:, e])
    return (out + shared).to(num.dtype)


def build_draft(target, loaded_draft: Dict[str, torch.Tensor], quantized, keep: bool) -> Optional[V41DSparkDraft]:
    """The draft over ``target`` from the loader's ``mtp.*`` tensors (None when the config has no stages)."""
    if not target.cfg.n_mtp_layers or not loaded_draft:
        return None
    weights = Weights(loaded_draft, target.num.dtype, keep=keep, quantized=quantized)
    return V41DSparkDraft(target.cfg, weights, target.num, device=target.device).attach(target)
