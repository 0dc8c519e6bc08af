"""The V4.1 engine path's shipped-format ops (``redknot/kernels/V41_OPS.md``), chosen by hardware target.

:class:`V41Ops` holds the registry ops (:class:`redknot.kernels.KernelSet`) the model routes through:
FP8 linears with weights kept in 32x32 E8M0 tiles (``linear_mx``), routed MXFP4 experts (``moe_mx``),
quantise-on-insert cache writes (``cache_insert_mx``), sparse attention over the byte caches
(``sparse_attention_mx``), the indexer's top-k and candidate blocks (``indexer_*_mx``) and the Engram
gather (``engram_gather_mx``). By default an op is routed only when the hardware target resolves it to
a non-reference backend (``sm90-port`` -> ``triton``); on ``cpu`` every op stays on the model's own
PyTorch math, which is the reference the registry ops are tested against. ``route_all`` sends every op
through the registry even when it resolves to ``reference`` (the dispatch test on a CPU).

What stays PyTorch on every target: the router, the ratio-2/ratio-1 compressor arithmetic, mHC, norms,
RoPE, ``wo_a`` (a bf16 weight in the reference: dequantised once and kept) and the head. Linears and
experts route only with ``hardware.weight_format=keep`` and ``model.numerics=reference`` (the ops
quantise activations per 32, which is what reference numerics computes; bf16 numerics does not).

The functions below are the routed bodies of :class:`AttentionLayer` methods; they read the same
state and publish the same :class:`Slots` (plus candidate block ids instead of a position mask).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from redknot.models.deepseek_v41.ref_math import Numerics, Weights

OPS = ("linear_mx", "moe_mx", "cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx",
       "indexer_source_mx", "engram_gather_mx")


class V41Ops:
    """The registry ops one model routes through (``None``: that op runs the PyTorch path)."""

    def __init__(self, kernels, route_all: bool = False):
        self.choice = {}
        for op in OPS:
            backend = kernels.choice.get(op)
            use = backend is not None and (route_all or backend != "reference")
            setattr(self, op, getattr(kernels, op) if use else None)
            self.choice[op] = backend if use else "pytorch"
        self._experts = {}
        self._dense = {}

    @classmethod
    def create(cls, kernels, route_all: bool = False) -> Optional["V41Ops"]:
        """``None`` when nothing is routed (no kernel set, or a target without fast V4.1 ops)."""
        if kernels is None:
            return None
        ops = cls(kernels, route_all)
        return ops if any(v != "pytorch" for v in ops.choice.values()) else None

    @property
    def attention(self) -> bool:
        """Window/compressed attention, cache inserts and the indexer route together (one cache reading)."""
        return all(getattr(self, op) is not None for op in
                   ("cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx", "indexer_source_mx"))

    def __repr__(self) -> str:
        return f"V41Ops({self.choice})"

    # ------------------------------------------------------------------ weights
    def _dtype_ok(self, op: str, num: Numerics) -> bool:
        """Fast GEMMs take bf16 activations; the reference ops any float dtype (fp64 tests)."""
        return num.dtype == torch.bfloat16 or self.choice[op] == "reference"

    def linear(self, x: torch.Tensor, w: Weights, name: str, num: Numerics) -> Optional[torch.Tensor]:
        """The FP8 GEMM of a kept 32x32-tile weight, or None (the caller runs its PyTorch linear)."""
        if self.linear_mx is None or not (w.keep and num.act_quant and self._dtype_ok("linear_mx", num)):
            return None
        weight = w.tensors.get(name)
        scale = w.tensors.get(Weights.scale_name(name))
        if weight is None or scale is None or weight.dtype != torch.float8_e4m3fn:
            return None
        return self.linear_mx(x.to(num.dtype), weight, scale, 32, 32)

    def bf16_weight(self, w: Weights, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A weight the reference holds dequantised (``wo_a``: bf16, applied without activation
        quantisation), dequantised once even when the others are kept quantised."""
        key = (name, dtype)
        got = self._dense.get(key)
        if got is None:
            got = self._dense[key] = w.dense(name, dtype)
        return got

    def stacked_experts(self, w: Weights, prefix: str, n: int):
        """(w1, w1_s, w3, w3_s, w2, w2_s) as [E, ...] uint8 stacks of the routed experts' MXFP4 weights,
        built once; the per-expert tensors become views of the stacks (no second copy is kept)."""
        got = self._experts.get(prefix)
        if got is not None:
            return got
        out = []
        for part in ("w1", "w3", "w2"):
            for suffix in ("weight", "scale"):
                names = [f"{prefix}.experts.{e}.{part}.{suffix}" for e in range(n)]
                parts = [w.tensors[k].view(torch.uint8) for k in names]
                stack = _stacked_view(parts)
                if stack is None:
                    stack = torch.stack(parts)
                    for e, k in enumerate(names):
                        w.tensors[k] = stack[e].view(w.tensors[k].dtype)
                out.append(stack)
        self._experts[prefix] = out
        return out

    def moe(self, u: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w: Weights, prefix: str, cfg,
            num: Numerics) -> Optional[torch.Tensor]:
        """The routed experts' sum [T, D] (bf16) from the MXFP4 stacks, or None (PyTorch path)."""
        if self.moe_mx is None or not (w.keep and num.act_quant and self._dtype_ok("moe_mx", num)):
            return None
        if w.tensors.get(f"{prefix}.experts.0.w1.weight") is None or \
                w.tensors[f"{prefix}.experts.0.w1.weight"].dtype not in (torch.int8, torch.uint8):
            return None
        w1, s1, w3, s3, w2, s2 = self.stacked_experts(w, prefix, cfg.n_routed_experts)
        return self.moe_mx(u.to(num.dtype), ids, weights.float(), w1, s1, w3, s3, w2, s2, cfg.swiglu_limit)

    def engram_rows(self, w: Weights, prefix: str, ids: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
        if self.engram_gather_mx is None:
            return None
        rows = self.engram_gather_mx(w.raw(f"{prefix}.embed.weight"), w.raw(f"{prefix}.embed.scale").view(torch.uint8),
                                     ids, dtype)
        return rows


def _stacked_view(parts: List[torch.Tensor]) -> Optional[torch.Tensor]:
    """[E, ...] view of per-expert tensors that already lie back to back in one storage, else None."""
    first = parts[0]
    step = first.numel()
    for e, t in enumerate(parts):
        if not t.is_contiguous() or t.shape != first.shape or \
                t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or \
                t.storage_offset() != first.storage_offset() + e * step:
            return None
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (len(parts), *first.shape))


def ops_of(w: Weights) -> Optional[V41Ops]:
    """The ops attached to a model's weights (``None`` for the oracle's and for the PyTorch path)."""
    return getattr(w, "ops", None)


# ---------------------------------------------------------------------- attention (routed bodies)
def insert_rows(ops: V41Ops, cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Quantise x [n, D] into the flat rows ``rows`` of a paged uint8 cache [..., bytes] (in place)."""
    ops.cache_insert_mx(cache.view(-1, cache.shape[-1]), rows, x, fmt)


def attend_spans(layer, q: torch.Tensor, kv: torch.Tensor, spans, state, slots, out: torch.Tensor) -> None:
    """Window + selected compressed entries for every span in one ``sparse_attention_mx`` call.

    The window rows a span reads (the ring's previous rows, then its own new rows, quantised on
    insert) are laid out in one byte scratch; the ring keeps the last ``window_ring`` of them."""
    from redknot.models.deepseek_v41.attention import _page_index

    ops = ops_of(layer.w)
    cfg = layer.cfg
    dev = q.device
    win = cfg.window_size
    nbytes = state.windows[layer.layer].shape[-1]
    pieces: List[torch.Tensor] = []
    widx: List[torch.Tensor] = []
    cidx: List[torch.Tensor] = []
    at = 0
    ring = state.windows[layer.layer]
    size = ring.shape[1]
    comp = layer.ratio and any(sp.end // layer.ratio for sp in spans)
    src = state.sources[layer.kv_source] if comp else None
    for sp in spans:
        lo = max(sp.floor, sp.ctx - win + 1, 0)
        old_pos = torch.arange(lo, sp.ctx, device=dev)
        new_pos = torch.arange(sp.ctx, sp.end, device=dev)
        n_old = old_pos.shape[0]
        scratch = torch.empty(n_old + sp.n, nbytes, dtype=torch.uint8, device=dev)
        scratch[:n_old] = ring[sp.slot, old_pos % size]
        ops.cache_insert_mx(scratch, torch.arange(n_old, n_old + sp.n, device=dev), kv[sp.start:sp.start + sp.n],
                            "window")
        keep = min(sp.n, size)
        ring[sp.slot, new_pos[-keep:] % size] = scratch[-keep:]
        loc = (n_old + torch.arange(sp.n, device=dev))[:, None] - torch.arange(win, device=dev)   # [n, W]
        lpos = new_pos[:, None] - torch.arange(win, device=dev)
        valid = (lpos >= max(sp.floor, 0)) & (loc >= 0)
        widx.append(torch.where(valid, loc + at, -1))
        pieces.append(scratch)
        at += scratch.shape[0]
        if comp:
            sel = slots.topk[sp.start:sp.start + sp.n]
            if sp.end // layer.ratio:
                rows = _page_index(sp, sel.clamp(min=0), layer.ratio, state.layout.block_size)
                cidx.append(torch.where(sel >= 0, rows, -1))
            else:
                cidx.append(torch.full_like(sel, -1))
    window = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    widx_all = torch.cat(widx)
    sink = layer.w.float(f"{layer.p}.attn_sink")
    comp_cache = src.entries.view(-1, src.entries.shape[-1]) if comp else None
    comp_idx = torch.cat(cidx) if comp else None
    t0, t1 = spans[0].start, spans[-1].start + spans[-1].n
    qs = q[t0:t1] if (t0, t1) != (0, q.shape[0]) else q
    out[t0:t1] = ops.sparse_attention_mx(qs, window, widx_all, sink, cfg.head_dim ** -0.5, comp_cache, comp_idx)


def index_spans(layer, q: torch.Tensor, wts: torch.Tensor, pos: torch.Tensor, spans, state, slots,
                topk: torch.Tensor) -> None:
    """The indexer of one index source over every span: top-k (inside the candidate blocks on the
    layers that read them) and, on the candidate source, the candidate blocks it publishes."""
    from redknot.models.deepseek_v41.attention import _page_index

    ops = ops_of(layer.w)
    cfg = layer.cfg
    r = layer.ratio
    dev = q.device
    is_cand = cfg.is_candidate_source(layer.layer)
    reads = cfg.reads_candidates(layer.layer)
    bf16 = layer.num.act_quant
    last_src = max(cfg.kv_source_layers)
    blocks = None
    if is_cand:
        blocks = torch.full((q.shape[0], cfg.candidate_topk_blocks), -1, dtype=torch.int32, device=dev)
    for sp in spans:
        n = sp.end // r
        if n == 0:
            continue
        owner = layer.kv_source
        if (layer.index_keys == "shipped" and sp.n == 1 and r == 2 and cfg.is_kv_source(layer.layer)
                and (sp.ctx + 1) % r != 0 and last_src != layer.layer):
            owner = last_src   # the shipped reference scores the last published keys (§5.2)
        src = state.sources[owner]
        keys = src.keys.view(-1, src.keys.shape[-1])[
            _page_index(sp, torch.arange(n, device=dev), src.ratio, state.layout.block_size)]
        rows = slice(sp.start, sp.start + sp.n)
        visible = (pos[rows] + 1) // r
        if is_cand:
            sel, blk = ops.indexer_source_mx(q[rows], wts[rows], keys, visible, cfg.index_topk,
                                             cfg.candidate_topk_blocks, cfg.candidate_block_size, bf16)
            blocks[rows] = blk.to(torch.int32)
        else:
            cand = slots.cand_blocks[rows] if reads else None
            sel = ops.indexer_topk_mx(q[rows], wts[rows], keys, visible, cfg.index_topk, cand,
                                      cfg.candidate_block_size, bf16)
        topk[rows] = sel.long()
    if is_cand:
        slots.cand_blocks = blocks
