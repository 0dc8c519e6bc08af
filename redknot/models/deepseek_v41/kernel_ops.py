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


# ---------------------------------------------------------------------- per-step index tensors
SMALL_SPAN = 16               # spans of at most this many rows share one indexer launch (decode, verify)
KEY_BATCH_ENTRIES = 1 << 22   # index-key entries gathered for one shared launch (68 B each: 272 MiB)


def host_ints(rows, device: torch.device) -> torch.Tensor:
    """Host integers (a list, or a list of tuples) as an int64 tensor on ``device``. On a GPU the copy
    goes through pinned memory and does not block: a pageable copy would wait for the whole queue."""
    t = torch.tensor(rows, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def segments(lengths: torch.Tensor, total: int):
    """Concatenated ranges 0..lengths[b]-1 of segments b ([B] on the device; ``total`` their host-side sum)
    -> (seg [total], k [total]): element e is number k of segment seg. No host sync (output size given)."""
    seg = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths, output_size=total)
    first = torch.cumsum(lengths, 0) - lengths
    return seg, torch.arange(total, device=lengths.device) - first[seg]


def block_table(spans) -> torch.Tensor:
    """[B, max_blocks] block tables of the spans (one row each)."""
    if len(spans) == 1:
        return spans[0].blocks[None]
    return torch.nn.utils.rnn.pad_sequence([sp.blocks for sp in spans], batch_first=True)


def page_rows(table: torch.Tensor, seg: torch.Tensor, entry: torch.Tensor, ratio: int, block_size: int) -> torch.Tensor:
    """Flat page rows of entries ``entry`` of spans ``seg`` (broadcast together); entry j of a sequence
    lives in the block of position j*ratio (``attention._page_index`` for many spans at once)."""
    per = block_size // ratio
    pos = entry * ratio
    return table[seg, pos // block_size] * per + (pos % block_size) // ratio


def span_rows(spans):
    """The step rows of the spans, in span order: a slice when they are contiguous (they are, in every
    step the model builds), else an index tensor."""
    contiguous = all(b.start == a.start + a.n for a, b in zip(spans, spans[1:]))
    if contiguous:
        return slice(spans[0].start, spans[-1].start + spans[-1].n)
    return torch.cat([torch.arange(sp.start, sp.start + sp.n, device=spans[0].blocks.device) for sp in spans])


# ---------------------------------------------------------------------- attention (routed bodies)
def insert_rows(ops: V41Ops, cache: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Quantise x [n, D] into the flat rows ``rows`` of a paged uint8 cache [..., bytes] (in place)."""
    ops.cache_insert_mx(cache.view(-1, cache.shape[-1]), rows, x, fmt)


def attend_spans(layer, q: torch.Tensor, kv: torch.Tensor, spans, state, slots, out: torch.Tensor) -> torch.Tensor:
    """Window + selected compressed entries for every span in one ``sparse_attention_mx`` call -> the output:
    the op's own tensor when the spans cover every row of ``out`` in order (no copy: 1.07 GB at 8192 rows of
    64 heads x 512), else ``out`` with the spans' rows written.

    The window rows each span reads (the ring's previous rows, then its own new rows, quantised on
    insert) are laid out span after span in one byte scratch; the ring keeps the last ``window_ring``
    of each. Every step of it runs once for all spans (one gather from the rings, one insert, one ring
    write), with the per-span numbers in one small tensor."""
    ops = ops_of(layer.w)
    cfg = layer.cfg
    dev = q.device
    win = cfg.window_size
    ring = state.windows[layer.layer]
    size, nbytes = ring.shape[1], ring.shape[2]
    flat_ring = ring.view(-1, nbytes)
    lo = [max(sp.floor, sp.ctx - win + 1, 0) for sp in spans]
    n_old = [sp.ctx - x for sp, x in zip(spans, lo)]
    keep = [min(sp.n, size) for sp in spans]
    at, total = [], 0
    for o, sp in zip(n_old, spans):
        at.append(total)
        total += o + sp.n
    t = sum(sp.n for sp in spans)
    lo_, nold, at_, ctx, slot, n, floor, keep_ = host_ints(
        list(zip(lo, n_old, at, [sp.ctx for sp in spans], [sp.slot for sp in spans], [sp.n for sp in spans],
                 [max(sp.floor, 0) for sp in spans], keep)), dev).unbind(1)
    scratch = torch.empty(total, nbytes, dtype=torch.uint8, device=dev)
    if sum(n_old):
        seg, k = segments(nold, sum(n_old))
        scratch[at_[seg] + k] = flat_ring[slot[seg] * size + (lo_[seg] + k) % size]
    rows = span_rows(spans)
    seg, i = segments(n, t)                                              # every row of the spans, in order
    ops.cache_insert_mx(scratch, at_[seg] + nold[seg] + i, kv[rows], "window")
    ks, kk = segments(keep_, sum(keep))
    local = n[ks] - keep_[ks] + kk                                       # the last ``keep`` new rows
    flat_ring[slot[ks] * size + (ctx[ks] + local) % size] = scratch[at_[ks] + nold[ks] + local]
    w = torch.arange(win, device=dev)
    loc = (nold[seg] + i)[:, None] - w                                   # [t, W] rows of the span's window
    valid = ((ctx[seg] + i)[:, None] - w >= floor[seg][:, None]) & (loc >= 0)
    widx = torch.where(valid, loc + at_[seg][:, None], -1)
    comp = layer.ratio and any(sp.end // layer.ratio for sp in spans)
    comp_cache = comp_idx = None
    if comp:
        src = state.sources[layer.kv_source]
        sel = slots.topk[rows]
        comp_idx = _page_entries(layer, q, sel, seg, (ctx + n) // layer.ratio > 0, block_table(spans),
                                 state.layout.block_size)
        comp_cache = src.entries.view(-1, src.entries.shape[-1])
    sink = layer.w.float(f"{layer.p}.attn_sink")
    o = ops.sparse_attention_mx(q[rows], scratch, widx, sink, cfg.head_dim ** -0.5, comp_cache, comp_idx)
    if isinstance(rows, slice) and rows.start == 0 and rows.stop == out.shape[0] and o.shape == out.shape \
            and o.dtype == out.dtype:
        return o
    out[rows] = o
    return out


def _page_entries(layer, q, sel, seg, live, table, block_size: int) -> torch.Tensor:
    """Page rows of the selected entries sel [t, K] (-1: none or a span without entries): one launch where the row
    kernels run (``prefill_rows_v41.page_entries``, the same integers), else the PyTorch ops."""
    from redknot.models.deepseek_v41 import fused_rows

    if fused_rows.PREFILL_ROWS["page_entries"] and fused_rows.fused(layer.w, q):
        from redknot.kernels.triton.prefill_rows_v41 import page_entries

        got = fused_rows._guarded(page_entries, sel, seg, live, table, layer.ratio, block_size)
        if got is not None:
            return got
    prow = page_rows(table, seg[:, None], sel.clamp(min=0), layer.ratio, block_size)
    return torch.where((sel >= 0) & live[seg][:, None], prow, -1)


def index_spans(layer, q: torch.Tensor, wts: torch.Tensor, pos: torch.Tensor, spans, state, slots,
                topk: torch.Tensor) -> None:
    """The indexer of one index source over every span: top-k (inside the candidate blocks on the
    layers that read them) and, on the candidate source, the candidate blocks it publishes.

    Spans of at most ``SMALL_SPAN`` rows (decode, verify) share one ``indexer_topk_mx`` launch: their
    keys are gathered one sequence after the other, each padded to whole candidate blocks, and each
    row may only pick from its own sequence's blocks (the op's candidate-block list: the blocks it
    read from the candidate source, or all of its sequence's blocks) below its own visibility bound;
    the picked ids are shifted back. The candidate source shares the launch for its top-k when no
    short span has more blocks than it keeps (``candidate_topk_blocks``; below 16,384 entries on
    V4.1-Flash): its candidates are then every block holding a visible entry, which is what the
    selection returns (each such block has a finite max or is pinned). Otherwise, and for longer
    spans, one launch per span (``indexer_source_mx`` on the candidate source)."""
    ops = ops_of(layer.w)
    cfg = layer.cfg
    r = layer.ratio
    dev = q.device
    is_cand = cfg.is_candidate_source(layer.layer)
    last_src = max(cfg.kv_source_layers)
    bs = cfg.candidate_block_size
    blocks = None
    if is_cand:
        blocks = torch.full((q.shape[0], cfg.candidate_topk_blocks), -1, dtype=torch.int32, device=dev)
    short = [sp for sp in spans if 0 < sp.n <= SMALL_SPAN and sp.end // r]
    share_cand = is_cand and len(short) > 1 and all(
        -(-(sp.end // r) // cfg.candidate_block_size) <= cfg.candidate_topk_blocks for sp in short)
    batches = {}   # owner -> lists of spans sharing a launch
    for sp in spans:
        n = sp.end // r
        if n == 0:
            continue
        owner = layer.kv_source
        if (layer.index_keys == "shipped" and sp.n == 1 and r == 2 and cfg.is_kv_source(layer.layer)
                and (sp.ctx + 1) % r != 0 and last_src != layer.layer):
            owner = last_src   # the shipped reference scores the last published keys (§5.2)
        if (is_cand and not share_cand) or sp.n > SMALL_SPAN:
            _index_one(layer, ops, q, wts, pos, sp, state.sources[owner], state, slots, topk, blocks)
            continue
        groups = batches.setdefault(owner, [[]])
        used = sum(-(-(s.end // r) // bs) * bs for s in groups[-1])
        if groups[-1] and used + -(-n // bs) * bs > KEY_BATCH_ENTRIES:
            groups.append([])
        groups[-1].append(sp)
    for owner, groups in batches.items():
        for group in groups:
            if len(group) == 1:
                _index_one(layer, ops, q, wts, pos, group[0], state.sources[owner], state, slots, topk, blocks)
            else:
                _index_many(layer, ops, q, wts, pos, group, state.sources[owner], state, slots, topk, blocks)
    if is_cand:
        slots.cand_blocks = blocks


def _index_one(layer, ops, q, wts, pos, sp, src, state, slots, topk, blocks) -> None:
    from redknot.models.deepseek_v41.attention import _page_index

    cfg = layer.cfg
    r = layer.ratio
    n = sp.end // r
    keys = src.keys.view(-1, src.keys.shape[-1])[
        _page_index(sp, torch.arange(n, device=q.device), src.ratio, state.layout.block_size)]
    rows = slice(sp.start, sp.start + sp.n)
    visible = (pos[rows] + 1) // r
    bf16 = layer.num.act_quant
    if blocks is not None:
        sel, blk = ops.indexer_source_mx(q[rows], wts[rows], keys, visible, cfg.index_topk,
                                         cfg.candidate_topk_blocks, cfg.candidate_block_size, bf16)
        blocks[rows] = blk.to(torch.int32)
    else:
        # Candidate blocks matter once a sequence has more blocks than the source keeps; below that they
        # are every block holding a visible entry, i.e. the visibility bound alone (a shared-key launch).
        held_all = -(-n // cfg.candidate_block_size) <= cfg.candidate_topk_blocks
        cand = slots.cand_blocks[rows] if cfg.reads_candidates(layer.layer) and not held_all else None
        sel = ops.indexer_topk_mx(q[rows], wts[rows], keys, visible, cfg.index_topk, cand,
                                  cfg.candidate_block_size, bf16)
    topk[rows] = sel.long()


def _index_many(layer, ops, q, wts, pos, group, src, state, slots, topk, blocks=None) -> None:
    """One ``indexer_topk_mx`` launch for the rows of several short spans (see :func:`index_spans`);
    ``blocks``: the candidate source's published blocks, every block holding a visible entry."""
    cfg = layer.cfg
    r = layer.ratio
    bs = cfg.candidate_block_size
    dev = q.device
    n = [sp.end // r for sp in group]
    nb = [-(-x // bs) for x in n]
    off, acc = [], 0
    for x in nb:
        off.append(acc)
        acc += x
    n_, nb_, off_, rows_n = host_ints(list(zip(n, nb, off, [sp.n for sp in group])), dev).unbind(1)
    seg, j = segments(nb_ * bs, acc * bs)
    ent = torch.minimum(j, n_[seg] - 1)          # the padding of a sequence's last block: any row (never visible)
    keys = src.keys.view(-1, src.keys.shape[-1])[
        page_rows(block_table(group), seg, ent, src.ratio, state.layout.block_size)]
    rows = span_rows(group)
    rseg, _ = segments(rows_n, sum(sp.n for sp in group))
    first = (off_ * bs)[rseg]                    # each row's first entry in the gathered keys
    visible = (pos[rows] + 1) // r + first
    if cfg.reads_candidates(layer.layer):
        cand = slots.cand_blocks[rows].long()
        cand = torch.where(cand >= 0, cand + off_[rseg][:, None], -1)
    else:
        b = torch.arange(max(nb), device=dev)[None]
        cand = torch.where(b < nb_[rseg][:, None], b + off_[rseg][:, None], -1)
    sel = ops.indexer_topk_mx(q[rows], wts[rows], keys, visible, cfg.index_topk, cand, bs,
                              layer.num.act_quant).long()
    topk[rows] = torch.where(sel >= 0, sel - first[:, None], -1)
    if blocks is not None:
        b = torch.arange(blocks.shape[1], device=dev)[None]
        held = (visible - first + bs - 1) // bs                                  # blocks with a visible entry
        blocks[rows] = torch.where(b < held[:, None], b, -1).to(torch.int32)
