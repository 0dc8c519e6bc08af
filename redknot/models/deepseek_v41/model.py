"""DeepSeek-V4.1 on the engine's step contract (:class:`redknot.models.family.ServingModel`).

``forward(meta, state)`` runs one engine step (prefill chunks and decode tokens of
several sequences, concatenated) over the paged :class:`V41State` and returns the
pre-head rows ``hc_pre(h, pre_last)`` [T, D]; ``compute_logits`` applies the final
norm and the fp32 head (§3.4, §3.8). Per layer: Engram on the hc stream (layers in
``engram_layer_ids``), then the lagged-mHC block (attention, MoE).

Bounded replay (``features.swa_replay.mode=compact``, ``meta.replay_from``): layers up
to the last kv source (layer 20 of V4.1-Flash; its compressor and index keys included)
run on every row; the layers above run only on each sequence's rows at or after
``replay_from``, and their windows start there (§5.5: an approximation, measured by
``benchmarks/v41_bounded_replay.py``). ``replay_from=None`` runs every layer on every
row: exactly the reference.
"""
from __future__ import annotations

import logging
from typing import List, Optional, Tuple

import torch

from redknot.models.deepseek_v41.attention import AttentionLayer, Slots, Span
from redknot.models.deepseek_v41.engram import engram_forward
from redknot.models.deepseek_v41.engram_hash import EngramHasher, EngramLayout
from redknot.models.deepseek_v41.kernel_ops import V41Ops, host_ints, segments, span_rows
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.fused_rows import collapse
from redknot.models.deepseek_v41.mhc import one_hot_pre
from redknot.models.deepseek_v41.moe import moe_forward, moe_post
from redknot.models.deepseek_v41.ref_math import (
    INDEX_KEYS, Numerics, Weights, check_choice, layer_rope, rms_norm)
from redknot.models.deepseek_v41.state import V41State
from redknot.step.metadata import StepMetadata

log = logging.getLogger(__name__)


class DeepseekV41:
    """The V4.1 backbone over native checkpoint tensors (:class:`Weights`)."""

    @property
    def supports_cuda_graphs(self) -> bool:
        """Tensor-only steps (:mod:`tensor_step`) read every per-step value from tensors; they follow
        the owners' index keys only and run the MoE without expert-parallel dispatch."""
        from redknot.models.deepseek_v41.tensor_step import tensor_step_blocker

        return tensor_step_blocker(self) is None

    @property
    def supports_varlen_graphs(self) -> bool:
        """The tensor-only step takes 1..γ+1 rows per request from ``query_start_loc`` (DSpark verify)."""
        return self.supports_cuda_graphs

    def __init__(self, cfg, weights: Weights, token_map: Optional[torch.Tensor], pad_c: int,
                 numerics: Numerics, index_keys: str = "owner", device="cpu", ops: Optional[V41Ops] = None):
        check_choice("model.index_keys", index_keys, INDEX_KEYS)
        self.cfg, self.w, self.num = cfg, weights, numerics
        self.ops = ops              # registry ops the layers route through (None: PyTorch math)
        weights.ops = ops
        self.dtype = numerics.dtype
        self._device = torch.device(device)
        self.index_keys = index_keys
        self.attn = [AttentionLayer(cfg, weights, i, layer_rope(cfg, cfg.compress_ratios[i]).to(self._device),
                                    numerics, index_keys) for i in range(cfg.n_layers)]
        self.hasher = None
        self.token_map = None
        if cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("an Engram model needs the token map of its tokenizer")
            self.token_map = token_map.to(self._device, torch.long)
            self.hasher = EngramHasher(EngramLayout.create(cfg, pad_c), device=self._device)
        # First layer bounded replay computes on the tail only: above the last kv source.
        self.split = max(cfg.kv_source_layers) + 1 if cfg.kv_source_layers else 0
        self.dspark = None          # the DSpark draft (dspark_draft.py), set by build_v41_model
        self.tap_hook = None        # (layer, streams entering it after Engram, their step rows | None): draft taps
        self.num_forwards = 0       # forwards run (tells a tap of this forward from a stale one)
        self.last_slots: Optional[Slots] = None   # the selections of the last forward (inspection)

    @property
    def device(self) -> torch.device:
        return self._device

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def forward(self, meta: StepMetadata, state: V41State) -> torch.Tensor:
        """One step -> pre-head rows [T, D] (rows below ``replay_from`` are not meaningful)."""
        cfg = self.cfg
        self.num_forwards += 1
        if meta.tensor_only:  # CUDA-graph capture: nothing read from the python lists
            from redknot.models.deepseek_v41.tensor_step import TensorStep, tensor_forward

            return tensor_forward(self, TensorStep.from_meta(meta), state)
        spans = self._spans(meta)
        pos = meta.positions
        hashes = self._hashes(meta.input_ids, spans, state)                  # [T, L, cols] | None
        e = self.w.dense("embed.weight", self.dtype)[meta.input_ids]
        h = e.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()           # [T, hc, D]
        pre = one_hot_pre(h.shape[0], cfg.hc_mult, self.dtype, h.device)
        slots = Slots()
        compact = meta.replay_from is not None and self.split < cfg.n_layers
        h, pre = self._layers(range(self.split if compact else cfg.n_layers), h, pre, pos, spans, state,
                              slots, hashes)
        self.last_slots = slots
        x = collapse(h, pre, self.w)
        if not compact:
            return x
        rows, tail = self._tail(meta, spans)
        if not tail:
            if getattr(self.w, "expert_dispatch", None) is not None:  # expert parallel: join the other
                from redknot.models.deepseek_v41.parallel import idle_layers  # ranks' tail-layer exchanges

                idle_layers(self, range(self.split, cfg.n_layers))
            return x
        part = self._layers(range(self.split, cfg.n_layers), h[rows], pre[rows], pos[rows], tail, state,
                            slots.rows(rows), None if hashes is None else hashes[rows], rows)
        return x.index_copy(0, rows, collapse(*part, self.w))

    @torch.no_grad()
    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-head rows [N, D] -> logits [N, vocab] (fp32; fp64 for an fp64 model)."""
        return self.head_logits(rms_norm(x, self.w.float("norm.weight"), self.cfg.norm_eps))

    def head_logits(self, y: torch.Tensor) -> torch.Tensor:
        """Normed rows [N, D] -> logits [N, vocab] in the accumulation dtype (the shared head: the
        DSpark draft's logits go through here too)."""
        acc = self.num.acc
        head = self.w.raw("head.weight")
        if y.is_cuda and y.dtype == head.dtype == torch.bfloat16 and acc == torch.float32:
            # bf16 operands are exact in fp32, so a bf16 GEMM accumulating and writing fp32 is the fp32
            # head's arithmetic (summation order aside) without an fp32 copy of the head.
            try:
                return torch.mm(y, head.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError):   # a torch without the out_dtype overload
                pass
        return y.to(acc) @ self.w.dense("head.weight", acc).t()

    # ------------------------------------------------------------------ parts
    def _spans(self, meta: StepMetadata) -> List[Span]:
        return [Span(s, n, c, slot, meta.block_tables[b].long())
                for b, (s, n, c, slot) in enumerate(zip(meta.query_start_list, meta.num_tokens_per_seq,
                                                        meta.context_lens, meta.seq_slot_list))]

    def _tail(self, meta: StepMetadata, spans: List[Span]) -> Tuple[torch.Tensor, List[Span]]:
        """Rows at or after each sequence's ``replay_from`` and their spans (window floor there)."""
        rows, tail, at = [], [], 0
        for sp, first in zip(spans, meta.replay_from):
            skip = min(sp.n, max(0, int(first) - sp.ctx))
            if skip == sp.n:
                continue
            rows.extend(range(sp.start + skip, sp.start + sp.n))
            tail.append(Span(at, sp.n - skip, sp.ctx + skip, sp.slot, sp.blocks, floor=int(first)))
            at += sp.n - skip
        return torch.tensor(rows, dtype=torch.long, device=meta.positions.device), tail

    def _hashes(self, ids: torch.Tensor, spans: List[Span], state: V41State) -> Optional[torch.Tensor]:
        """Engram row ids of the step, every row at once: each row's look-back comes from its own
        step rows or, before the step, from its sequence's id ring (then the ring is updated)."""
        if self.hasher is None or not spans:
            return None
        lb = self.hasher.layout.lookback
        ring = state.engram_ids.shape[1]
        dev = ids.device
        row0, at = [], 0
        for sp in spans:
            row0.append(at)
            at += sp.n
        rows = span_rows(spans)
        if (fused_rows.PREFILL_ROWS["hashes"] and isinstance(rows, slice) and state.engram_ids.is_contiguous()
                and fused_rows.fused_ops(self.w)):   # look-back, hash and ring write: two launches, the same ints
            from redknot.kernels.triton.prefill_hash_v41 import prefill_hashes

            hs = self.hasher
            table = host_ints([(r, sp.n, sp.ctx, sp.slot) for r, sp in zip(row0, spans)], dev)
            got = fused_rows._guarded(prefill_hashes, ids[rows], self.token_map, state.engram_ids, table,
                                      hs.multipliers, hs.primes, hs.offsets, hs.layout.pad_c)
            if got is not None:
                return got
        keep = [min(sp.n, ring) for sp in spans]
        ctx, slot, n, row0_, keep_ = host_ints(
            list(zip([sp.ctx for sp in spans], [sp.slot for sp in spans], [sp.n for sp in spans], row0, keep)),
            dev).unbind(1)
        comp = self.token_map[ids[rows]]                                      # [T] in span order
        seg, i = segments(n, at)
        pos = ctx[seg] + i
        hist_pos = pos[:, None] - lb + torch.arange(lb + 1, device=dev)       # [T, lb+1], oldest first
        local = hist_pos - ctx[seg][:, None]                                  # >= 0: a row of this step
        flat = state.engram_ids.view(-1)
        hist = torch.where(local >= 0, comp[row0_[seg][:, None] + local.clamp(min=0)],
                           flat[slot[seg][:, None] * ring + hist_pos % ring])  # positions < 0 are blocked
        out = self.hasher.hash(hist, pos)[:, 0]                               # [T, L, cols]
        ks, kk = segments(keep_, sum(keep))
        last = n[ks] - keep_[ks] + kk                                         # each span's last ``keep`` rows
        flat[slot[ks] * ring + (ctx[ks] + last) % ring] = comp[row0_[ks] + last]
        return out

    def _layers(self, layers, h, pre, pos, spans, state, slots, hashes, rows=None):
        """``rows``: the step rows ``h`` holds (bounded replay's tail), None for all of them."""
        from redknot.models.deepseek_v41.tensor_step import _SiteFused, site_fns

        cfg, w, num = self.cfg, self.w, self.num
        site = site_fns(self, h)   # the lagged mHC sites: fused kernels with the Triton step ops, else PyTorch
        fused_site = isinstance(site, _SiteFused)
        for i in layers:
            p = f"layers.{i}"
            if cfg.is_engram(i):
                h = engram_forward(h, hashes[:, cfg.engram_index(i)], w, i, num, cfg.norm_eps)
            if self.tap_hook is not None:
                self.tap_hook(i, h, rows)
            u, pre_a, post_a, c_a = site.pre(h, pre, f"{p}.hc_attn", f"{p}.attn_norm.weight")
            h = site.post(self.attn[i](u, pos, spans, state, slots), h, post_a, c_a)
            u, pre, post_f, c_f = site.pre(h, pre_a, f"{p}.hc_ffn", f"{p}.ffn_norm.weight")
            # Many rows on the fused site: the MoE's combine and the post mix in one pass (None elsewhere).
            mixed = moe_post(u, w, i, cfg, num, (h, post_f, c_f)) if fused_site else None
            h = mixed if mixed is not None else site.post(moe_forward(u, w, i, cfg, num), h, post_f, c_f)
        return h, pre


def build_v41_model(model_cfg, hardware, cache_dir: str, *, kernels=None, device="cpu",
                    expert_rows=None) -> DeepseekV41:
    """Load ``model.path`` (or write, then load, the seeded ``model.synthetic`` checkpoint) onto
    ``device``. ``model.numerics`` and ``model.index_keys`` choose the numerics and the ratio-2
    owners' decode index keys; ``hardware.weight_format=keep`` keeps FP8/FP4 weights quantised
    (dequantised per GEMM). ``kernels``: the ops the hardware target resolves to a fast backend run
    through the registry (:mod:`kernel_ops`); the rest, and everything on ``cpu``, is PyTorch math."""
    from redknot.config.schema import IndexKeys, ModelNumerics, WeightFormat
    from redknot.kernels.dtypes import torch_dtype
    from redknot.models.checkpoint_files import check_model_keys
    from redknot.models.deepseek_v41.config import V41Config
    from redknot.models.deepseek_v41.weights import checkpoint_tokenizer_file, engram_token_map, load_v41_weights
    from redknot.models.deepseek_v41.writer import write_synthetic_checkpoint

    from redknot.models.deepseek_v41.parallel import engram_placement_of

    # Expert parallel: this rank's routed experts and (engram_placement=sharded) its Engram rows.
    placement, ep_group, ep_rank, ep_size = engram_placement_of(expert_rows)
    if model_cfg.path:
        import os

        if not os.path.isdir(model_cfg.path):
            raise FileNotFoundError(f"model.path={model_cfg.path!r} is not a directory")
        path = model_cfg.path
    elif model_cfg.synthetic is not None:
        path = write_synthetic_checkpoint(model_cfg, cache_dir)
    else:
        raise ValueError(f"model {model_cfg.name!r}: model.path is null and model.synthetic is not set; "
                         f"give model.path=/path/to/checkpoint or choose model=tiny-v41")
    cfg = V41Config.from_pretrained(path, model_cfg.num_layers)
    check_model_keys(model_cfg, cfg.max_position_embeddings, cfg.window_size)
    dtype = torch_dtype(hardware.dtype)
    keep = WeightFormat(hardware.weight_format) == WeightFormat.keep
    numerics = Numerics(ModelNumerics(model_cfg.numerics).value, dtype)
    index_keys = IndexKeys(model_cfg.index_keys).value
    loaded = load_v41_weights(path, cfg, weight_format="keep" if keep else "dequantize", dtype=dtype,
                              include_draft=True, device=device, expert_rows=expert_rows,
                              engram_shard=(ep_rank, ep_size) if placement == "sharded" and ep_size > 1 else None,
                              engram_device="cpu" if placement == "host" else None)
    token_map, pad_c = None, 0
    if cfg.engram_layer_ids:
        tmap = engram_token_map(cfg, checkpoint_tokenizer_file(model_cfg, model_cfg.path), cache_dir)
        lookup = list(tmap.lookup)
        pad_c = lookup[cfg.engram_pad_id]
        # Ids past the tokenizer (padding rows of the embedding) never occur in text; give them pad's id.
        lookup += [pad_c] * max(0, cfg.vocab_size - len(lookup))
        token_map = torch.tensor(lookup[:cfg.vocab_size], dtype=torch.long)
    log.info("deepseek_v41: %d layers, numerics=%s, index_keys=%s, weights %s", cfg.n_layers, numerics.mode,
             index_keys, "kept quantised" if keep else "dequantised")
    weights = Weights(loaded.tensors, dtype, keep=keep, quantized=loaded.quantized)
    ops = V41Ops.create(kernels)
    if ops is not None:
        log.info("deepseek_v41: kernel ops %s", ops.choice)
    model = DeepseekV41(cfg, weights, token_map, pad_c, numerics, index_keys, device=device, ops=ops)
    if expert_rows is not None:
        from redknot.models.deepseek_v41.parallel import install_engram

        model.expert_ids = dict(loaded.experts)
        install_engram(model, loaded, placement, ep_group, ep_rank, ep_size)
    if cfg.n_mtp_layers:
        from redknot.models.deepseek_v41.dspark_draft import build_draft

        model.dspark = build_draft(model, loaded.draft, loaded.quantized, keep)
        log.info("deepseek_v41: %d DSpark stages (mtp.*) loaded, taps = inputs of layers %s",
                 cfg.n_mtp_layers, list(cfg.dspark_target_layer_ids))
    return model
