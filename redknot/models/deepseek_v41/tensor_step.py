"""A V4.1 step that reads every per-step value from device tensors (CUDA graphs, varlen verify).

The eager engine path (:mod:`model`, :mod:`attention`) walks Python spans: it slices each
sequence's rows, sizes its tensors by the sequence's length and branches on where compressor
groups close. A captured graph replays fixed kernels over whatever its input buffers hold, so
here every shape depends only on the padded row count ``T``, the request count ``B`` and the
block-table width ``W``, and every per-step fact is a tensor computed on the device:

* rows -> requests from ``query_start_loc`` (requests may have 1..γ+1 rows: decode and
  DSpark's variable-length verify alike); the first position of each request is the position of
  its first row, so a row looks back ``row - first`` rows inside the step and reads the rest from
  the rings;
* window, ratio-2 compressor carry-over and Engram look-back read the rings *before* this
  step's rows are stored (exactly the eager order); a request stores only its last ``ring`` rows,
  the others go to the spare slot;
* ratio-2 groups close on odd positions: every row computes a pooled entry and only closing rows
  store it; the rest store into the spare block, which no request's table names;
* the indexer scores all ``W·block_size/r`` entries a block table can address and masks those
  a row cannot see (``j >= (p+1)//r``), so the top-k over each request's valid entries needs
  no host-side count; -1 marks "none", as in the eager path;
* the MoE runs every expert on every row with zero routing weight where a row does not use it
  (no per-expert row counts on the host) unless the registry's grouped op takes it.

Padding rows belong to padding requests whose slot is the spare slot and whose block table
names only the spare block, so they touch nothing a real request reads. The spare slot and
block are the last ones of the state (the engine runner's ``padding_slot``/``padding_block``).
Attention, indexer and compressor are the PyTorch math of the eager path, unless the model's
attention ops resolve to Triton: then the window/compressed attention and the indexer scores run the
graph-safe kernels of :mod:`redknot.kernels.triton.step_attention_mx` and ``step_indexer_mx`` (every
per-row fact read on the device; the registry's span kernels take host spans) and cache rows are
quantised on insert by ``cache_insert_mx``. The dense linears and the grouped MoE go through the
registry where the model has ops. The compressor and the indexer (the global-cache sources) are in
:mod:`tensor_step_sources`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.attention import grouped_output, sparse_attend
from redknot.models.deepseek_v41.engram import engram_forward
from redknot.models.deepseek_v41.kernel_ops import ops_of
from redknot.models.deepseek_v41.mhc import hc_collapse, hc_expand, hc_mixes, one_hot_pre
from redknot.models.deepseek_v41.moe import moe_post, moe_step_kernels, route, swiglu_expert
from redknot.models.deepseek_v41.ref_math import linear, rms_norm
from redknot.models.deepseek_v41.tensor_step_sources import _compress, _index, step_kernels
from redknot.step.overlap import beside


@dataclass
class TensorStep:
    """One step as device tensors only: T rows of B requests (padding requests included)."""
    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64 absolute positions
    query_start_loc: torch.Tensor  # [B+1] row offsets; rows at or past query_start_loc[B] are padding
    seq_slots: torch.Tensor        # [B] state slot of each request (padding: the spare slot)
    block_tables: torch.Tensor     # [B, W] block ids (padding: the spare block)
    # The most rows one request has in this step, where the caller knows it from the step's shape (1 for a
    # decode step); None: up to T. Decides which writes may share a launch with the reads before them.
    max_rows: Optional[int] = None

    @classmethod
    def from_meta(cls, meta) -> "TensorStep":
        return cls(meta.input_ids, meta.positions, meta.query_start_loc, meta.seq_slots, meta.block_tables,
                   max(meta.num_tokens_per_seq, default=0))

    @classmethod
    def from_varlen(cls, input_ids: torch.Tensor, layout, seq_slots: torch.Tensor,
                    block_tables: torch.Tensor) -> "TensorStep":
        """A padded verify step from :func:`redknot.speculative.varlen.varlen_layout`'s layout (rows past
        ``query_start_loc[R]`` are padding) and the R requests' slots and block tables."""
        return cls(input_ids, layout.positions, layout.query_start_loc, seq_slots, block_tables)


class _Rows:
    """Per-row facts derived on the device (no host read)."""

    def __init__(self, step: TensorStep, state, block_size: int, fused: bool = False):
        t = step.input_ids.shape[0]
        dev = step.input_ids.device
        self.t = t
        self.max_rows = t if step.max_rows is None else min(t, step.max_rows)   # rows of one request, at most
        self.spare_slot = state.num_slots - 1
        self.spare_block = state.num_blocks - 1
        self.block_size = block_size
        self._memo = {}   # per-step index tensors every layer would otherwise recompute (launches)
        self.fused = fused and self._fused_facts(step, state)
        if self.fused:
            return
        qsl = step.query_start_loc.long()
        self.row = torch.arange(t, device=dev)
        b = qsl.shape[0] - 1
        raw = torch.searchsorted(qsl[1:].contiguous(), self.row, right=True)    # B past the last request
        real = raw < b
        self.seq = raw.clamp(max=b - 1)
        # A padding row is a request of its own on the spare slot and block.
        self.first = torch.where(real, qsl[self.seq], self.row)     # first row of the row's request
        self.last = torch.where(real, qsl[self.seq + 1] - 1, self.row)
        self.back = self.row - self.first                           # rows of its request before it
        self.pos = step.positions.long()
        self.slot = torch.where(real, step.seq_slots.long()[self.seq], torch.full_like(self.row, self.spare_slot))
        self.blocks = torch.where(real[:, None], step.block_tables.long()[self.seq],
                                  torch.full_like(step.block_tables.long()[self.seq], self.spare_block))  # [T, W]

    def _fused_facts(self, step: TensorStep, state) -> bool:
        """The same facts, and the ring writes / visible counts of every ring size and ratio the state has,
        in one launch (:func:`redknot.kernels.triton.step_rows_v41.step_rows`); False: the kernel does not
        build here (the PyTorch math then)."""
        from redknot.kernels.triton.step_rows_v41 import FIELDS, MAX_KINDS, step_rows

        rings = {w.shape[1] for w in state.windows}
        rings |= {src.kv_rows.shape[1] for src in state.sources.values() if src.kv_rows is not None}
        if state.engram_ids is not None:
            rings.add(state.engram_ids.shape[1])
        rings = sorted(rings)[:MAX_KINDS]          # any other size: ring_dest's PyTorch math
        ratios = sorted({src.ratio for src in state.sources.values() if src.ratio > 0})[:MAX_KINDS]
        got = fused_rows._guarded(step_rows, step.query_start_loc, step.positions, step.seq_slots,
                                  step.block_tables, self.spare_slot, self.spare_block, rings, ratios)
        if got is None:
            return False
        facts, self.blocks = got
        self.row, self.seq, self.first, self.last, self.back, self.slot = facts[:len(FIELDS)]
        self.pos = step.positions.long()
        for k, ring in enumerate(rings):
            self._memo[("dest", ring)] = facts[len(FIELDS) + k]
        for k, ratio in enumerate(ratios):
            self._memo[("visible", ratio)] = facts[len(FIELDS) + len(rings) + k]
        return True

    def memo(self, key, make):
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = make()
        return got

    def ring_dest(self, ring: int) -> torch.Tensor:
        """Flat [slot*ring + p % ring] of each row's ring write; rows that are not among their
        request's last ``ring`` rows (the eager path keeps only those) write the spare slot."""
        def make():
            keep = (self.last - self.row) < ring
            slot = torch.where(keep, self.slot, torch.full_like(self.slot, self.spare_slot))
            return slot * ring + self.pos.remainder(ring)
        return self.memo(("dest", ring), make)

    def visible(self, ratio: int) -> torch.Tensor:
        """Compressed entries each row sees: (p + 1) // ratio."""
        return self.memo(("visible", ratio), lambda: (self.pos + 1) // ratio)

    def ring_lookback(self, ring_t: torch.Tensor, step_vals: torch.Tensor, depth: int) -> torch.Tensor:
        """Values at positions p-s, s = 0..depth-1, per row -> [T, depth, ...]: from the step's own
        rows where the request has them, else from ``ring_t`` [S, ring, ...] (read before writing)."""
        ring = ring_t.shape[1]
        s = torch.arange(depth, device=self.pos.device)
        lpos = self.pos[:, None] - s                                            # [T, depth]
        flat = ring_t.reshape(ring_t.shape[0] * ring, *ring_t.shape[2:])
        old = flat[self.slot[:, None] * ring + lpos.remainder(ring)]
        inner = s[None, :] <= self.back[:, None]
        new = step_vals[(self.row[:, None] - s).clamp(min=0)]
        shape = inner.shape + (1,) * (old.dim() - 2)
        return torch.where(inner.view(shape), new.to(old.dtype), old)

    def page(self, entry: torch.Tensor, ratio: int, per: int) -> torch.Tensor:
        """Flat page rows of entries ``entry`` [T, ...] of each row's request."""
        p = entry * ratio
        col = (p // self.block_size).clamp(max=self.blocks.shape[1] - 1)
        blk = self.blocks.gather(1, col.reshape(self.t, -1)).view_as(entry)
        return blk * per + (p % self.block_size) // ratio


def tensor_step_blocker(model) -> Optional[str]:
    """Why ``model`` cannot run tensor-only steps (None: it can)."""
    if model.index_keys != "owner":
        return (f"model.index_keys={model.index_keys!r}: the tensor-only step follows the owners' keys only; "
                "use model.index_keys=owner (or eager steps)")
    if getattr(model.w, "expert_dispatch", None):
        return "features.parallel.ep > 1: expert-parallel MoE dispatch is not part of the tensor-only step"
    return None


def check_tensor_step(model) -> None:
    reason = tensor_step_blocker(model)
    if reason is not None:
        raise ValueError(reason)



@torch.no_grad()
def tensor_forward(model, step: TensorStep, state) -> torch.Tensor:
    """One step of ``model`` (:class:`DeepseekV41`) -> pre-head rows [T, D], no host sync."""
    check_tensor_step(model)
    cfg, w, num = model.cfg, model.w, model.num
    with region("rows+hashes"):
        rows = _Rows(step, state, state.layout.block_size, fused=step_kernels(w))
        hashes = _hashes(model, step, rows, state)
    table = w.dense("embed.weight", model.dtype)
    if fused_mhc(model, table):
        from redknot.kernels.triton.step_mhc_v41 import embed_streams

        h = embed_streams(step.input_ids, table, cfg.hc_mult)
    else:
        h = table[step.input_ids].unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    pre = _first_pre(model, h)
    shared = {"topk": None, "cand": None, "cand_entries": None, "rope": {}}
    site = site_fns(model, h)
    for i in range(cfg.n_layers):
        p = f"layers.{i}"
        if cfg.is_engram(i):
            with region("engram"):
                h = engram_forward(h, hashes[:, cfg.engram_index(i)], w, i, num, cfg.norm_eps)
        if model.tap_hook is not None:  # DSpark taps: the streams entering layer i (a replay refills them)
            model.tap_hook(i, h, None)
        with region("mhc_pre"):
            u, pre_a, post_a, c_a = site.pre(h, pre, f"{p}.hc_attn", f"{p}.attn_norm.weight")
        mix = (h, post_a, c_a) if isinstance(site, _SiteFused) else None   # wo_b may run the post mix too
        got = _attention(model.attn[i], u, rows, state, shared, mix)
        y, mixed = got if mix is not None else (got, False)
        with region("mhc_post"):
            h = y if mixed else site.post(y, h, post_a, c_a)
        with region("mhc_pre"):
            u, pre, post_f, c_f = site.pre(h, pre_a, f"{p}.hc_ffn", f"{p}.ffn_norm.weight")
        mix = (h, post_f, c_f) if isinstance(site, _SiteFused) else None   # the MoE's last launch may mix too
        with region("moe"):
            y, mixed = _moe(u, w, i, cfg, num, mix)
        with region("mhc_post"):
            h = y if mixed else site.post(y, h, post_f, c_f)
    return fused_rows.collapse(h, pre, w)   # the eager forward's last step too (same bits)


def _first_pre(model, h: torch.Tensor) -> torch.Tensor:
    """``one_hot_pre`` of the step's rows (layer 0 collapses with stream 0), kept on the model per row count:
    a constant the step only reads, so it costs no launch a step. One first made inside a graph capture is
    not kept (its fill runs only at the replays)."""
    key = (h.shape[0], model.cfg.hc_mult, model.dtype, h.device)
    kept = model.__dict__.setdefault("_first_pre", {})
    got = kept.get(key)
    if got is None:
        got = one_hot_pre(*key)
        if not (h.is_cuda and torch.cuda.is_current_stream_capturing()):
            kept[key] = got
    return got


# ---------------------------------------------------------------------- profiling regions
PROFILE_REGIONS = False   # benchmarks set it: named ranges for torch.profiler (host-only, nothing in a graph)


def region(name: str):
    """A ``torch.profiler`` range ``v41_step.<name>`` while ``PROFILE_REGIONS`` is set, else nothing."""
    if PROFILE_REGIONS:
        return torch.profiler.record_function(f"v41_step.{name}")
    return contextlib.nullcontext()


# ---------------------------------------------------------------------- mHC sites
class _SiteTorch:
    """The lagged mHC site as the eager path computes it (:mod:`mhc`, ``rms_norm``)."""

    def __init__(self, model):
        self.cfg, self.w = model.cfg, model.w
        self.mix = (self.cfg.hc_mult, self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps, self.cfg.norm_eps)

    def pre(self, h, pre_in, hc: str, norm: str):
        w = self.w
        pre, post, comb = hc_mixes(h, w.float(f"{hc}_fn"), w.float(f"{hc}_base"), w.float(f"{hc}_scale"), *self.mix)
        return rms_norm(hc_collapse(h, pre_in), w.float(norm), self.cfg.norm_eps), pre, post, comb

    def post(self, y, h, post, comb):
        return hc_expand(y, h, post, comb)


class _SiteFused:
    """The same site in three launches (:mod:`redknot.kernels.triton.step_mhc_v41`), with the small fp32
    weights it reads kept contiguous."""

    def __init__(self, model):
        self.cfg, self.w = model.cfg, model.w
        self.f32 = model.__dict__.setdefault("_step_f32", {})

    def _f(self, name: str) -> torch.Tensor:
        got = self.f32.get(name)
        if got is None:
            got = self.f32[name] = self.w.float(name).contiguous()
        return got

    def pre(self, h, pre_in, hc: str, norm: str):
        from redknot.kernels.triton.step_mhc_v41 import site_pre

        cfg = self.cfg
        args = (h, pre_in, self._f(f"{hc}_fn"), self._f(f"{hc}_base"), self._f(f"{hc}_scale"), self._f(norm),
                cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps)
        # a kernel that does not build: the PyTorch site; many rows: the collapse in the mixing pass (same function
        # for the eager layers and the tensor step, so both keep the same bits)
        got = fused_rows._guarded(site_pre, *args, one_pass=fused_rows.PREFILL_ROWS["mhc_one_pass"])
        return got if got is not None else _SiteTorch(self).pre(h, pre_in, hc, norm)

    def post(self, y, h, post, comb):
        from redknot.kernels.triton.step_mhc_v41 import site_post

        return site_post(y, h, post, comb)


def fused_mhc(model, h: torch.Tensor) -> bool:
    """Whether the step runs the fused mHC sites: with the step's Triton kernels (:func:`step_kernels`)
    on 16-bit streams and a power-of-two stream count (elsewhere the PyTorch math of the eager path)."""
    n = model.cfg.hc_mult
    return (step_kernels(model.w) and h.dtype in (torch.bfloat16, torch.float16) and n & (n - 1) == 0
            and not fused_rows._FAILED)


def site_fns(model, h: torch.Tensor):
    """The mHC site functions (``pre``: mixes + lagged collapse + norm; ``post``) the step and the eager
    path run, so both compute the same bits."""
    return _SiteFused(model) if fused_mhc(model, h) else _SiteTorch(model)


# ---------------------------------------------------------------------- Engram
_HASH_KERNEL_ROWS = 1024   # rows up to which the hashing kernel runs (one program walks them)


def _hashes(model, step: TensorStep, rows: _Rows, state) -> Optional[torch.Tensor]:
    if model.hasher is None:
        return None
    ring = state.engram_ids.shape[1]
    if rows.fused and step.input_ids.shape[0] <= _HASH_KERNEL_ROWS:   # look-back, hash and ring write: one launch
        from redknot.kernels.triton.step_rows_v41 import step_hashes

        hs = model.hasher
        got = fused_rows._guarded(step_hashes, step.input_ids, model.token_map, state.engram_ids, rows.slot,
                                  rows.pos, rows.back, rows.ring_dest(ring), hs.multipliers, hs.primes, hs.offsets,
                                  hs.layout.pad_c)
        if got is not None:
            return got
    lb = model.hasher.layout.lookback
    comp = model.token_map[step.input_ids]                                      # [T]
    hist = rows.ring_lookback(state.engram_ids, comp, lb + 1).flip(1)           # [T, lb+1], oldest first
    out = model.hasher.hash(hist, rows.pos)[:, 0]                               # [T, L, cols]
    state.engram_ids.view(-1).index_copy_(0, rows.ring_dest(ring), comp)
    return out


# ---------------------------------------------------------------------- MoE
def _moe(u: torch.Tensor, w, layer: int, cfg, num, mix=None):
    """(the MoE's output [T, D], mixed): ``mixed`` tells that the output is already the fused mHC site's post
    mix with ``mix`` = (h, post, comb)."""
    prefix = f"layers.{layer}.ffn"
    fused = moe_step_kernels(u, w, prefix, cfg, num, mix)   # few rows on the step kernels: ~12 launches, not ~38
    if fused is not None:
        return fused if mix is not None else (fused, False)
    if mix is not None:   # more rows on the fused site: the combine and the post mix in one pass (as the eager layers)
        got = moe_post(u, w, layer, cfg, num, mix)
        if got is not None:
            return got, True
    return _moe_unfused(u, w, prefix, cfg, num), False


def _moe_unfused(u: torch.Tensor, w, prefix: str, cfg, num) -> torch.Tensor:
    ids, weights = route(u, w, prefix, cfg, num.acc)
    ops = ops_of(w)
    routed, shared = beside(u, lambda: None if ops is None else ops.moe(u, ids, weights, w, prefix, cfg, num),
                            lambda: swiglu_expert(u, w, f"{prefix}.shared_experts", num, cfg.swiglu_limit, None))
    if routed is not None:
        return (routed.to(num.acc) + shared).to(num.dtype)
    out = torch.zeros(u.shape[0], cfg.dim, dtype=num.acc, device=u.device)
    experts = torch.arange(cfg.n_routed_experts, device=u.device)
    # [T, E] routing weight of every expert (0 where a row does not route to it); same summation
    # order per row as the eager grouped loop (expert ascending, then the shared expert).
    dense_w = ((ids[:, :, None] == experts) * weights[:, :, None]).sum(1)
    for e in range(cfg.n_routed_experts):
        out += swiglu_expert(u, w, f"{prefix}.experts.{e}", num, cfg.swiglu_limit, dense_w[:, e])
    out += shared
    return out.to(num.dtype)


# ---------------------------------------------------------------------- attention
def _attention(layer, u: torch.Tensor, rows: _Rows, state, shared, mix=None):
    """The attention sublayer's output [T, D]; with ``mix`` (grouped_output's) the pair (out, mixed)."""
    cfg, w, num, p = layer.cfg, layer.w, layer.num, layer.p
    pos = rows.pos
    inv = _shared_inv(layer, u)

    def q_kv():
        with region("attn.q_kv"):
            index = cfg.is_index_source(layer.layer)
            pack = step_kernels(w) and state.windows[layer.layer].shape[-1] == mx.window_row_bytes(cfg.head_dim)
            # few rows: 4 launches
            got = fused_rows.q_kv_rows(u, w, p, cfg, num, pos, inv, shared["rope"], index, pack)
            return got if got is not None else (*_q_kv(layer, u, pos, inv, shared["rope"]), None, None)

    def compress():   # the kv source's compressor reads u and writes its source's state only
        with region("compressor"):
            _compress(layer, u, rows, state)

    # a kv source's compressor on the side stream next to the projections (redknot.step.overlap, where it is on;
    # elsewhere wkv takes the side stream next to the q chain in _q_kv)
    qr, q, kv, shared["index_q"], packed = beside(u, q_kv, compress)[0] if cfg.is_kv_source(layer.layer) else q_kv()
    if packed is not None:   # kv's window rows, quantised by the kv epilogue (_attend_kernel's insert)
        rows._memo[("packed", id(kv))] = packed
    if cfg.is_index_source(layer.layer):
        with region("indexer"):
            _index(layer, u, qr, rows, state, shared)
    with region("attend"):
        o, rotated = _attend(layer, q, kv, rows, state, shared["topk"], inv, shared["rope"])
    with region("attn.out"):
        return grouped_output(o, pos, inv, cfg, w, p, num, shared["rope"], mix, rotated=rotated)


def _q_kv(layer, u: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, tables):
    """(qr, q, kv) through ``linear`` and the row functions (``fused_rows.q_kv_rows`` does not apply); ``wkv``
    on the side stream next to the q chain (``redknot.step.overlap``, where it is on)."""
    cfg, w, num, p = layer.cfg, layer.w, layer.num, layer.p

    def q_chain():
        qr = fused_rows.norm(linear(u, w, f"{p}.wq_a.weight", num), w, f"{p}.q_norm.weight", cfg.norm_eps)
        return qr, linear(qr, w, f"{p}.wq_b.weight", num).view(u.shape[0], cfg.n_heads, cfg.head_dim)

    (qr, q), kv = beside(u, q_chain, lambda: linear(u, w, f"{p}.wkv.weight", num))
    got = _rope_q_kv(w, q, kv, pos, inv, tables, f"{p}.kv_norm.weight", cfg.norm_eps)
    if got is not None:   # both row epilogues in one launch (the bits of the two below)
        return (qr, *got)
    q = fused_rows.rope(q, w, pos, inv, tables)
    kv = fused_rows.norm_rope(kv, w, f"{p}.kv_norm.weight", cfg.norm_eps, pos, inv, tables)
    return qr, q, kv


def _rope_q_kv(w, q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor, tables, norm: str,
               eps: float):
    """(fused_rows.rope(q), fused_rows.norm_rope(kv)) in one launch (:mod:`redknot.kernels.triton.step_qkv_v41`)
    where both would run the row kernel; None elsewhere."""
    if not (fused_rows.fused(w, q) and fused_rows._ok(q, inv) and kv.dtype == q.dtype
            and kv.shape == (q.shape[0], q.shape[-1])):
        return None
    from redknot.kernels.triton.step_qkv_v41 import rope_q_kv

    cos, sin = fused_rows._table(tables, pos, inv)
    return fused_rows._guarded(rope_q_kv, q, kv, cos, sin, w.float(norm), eps)


def _shared_inv(layer, u: torch.Tensor) -> torch.Tensor:
    """The layer's RoPE frequencies as the first earlier layer's tensor with the same values (the V4.1 layers
    use two tables: θ 10000 on ratio-0 layers, θ 160000 + YaRN on the others), so the step computes each
    cos/sin table once instead of once per layer (six launches each). The values are compared once per
    layer, outside graph capture (a host read); a layer first met inside a capture keeps its own tensor.
    The layer's other rotation on these positions (the indexer's query) reads the same tensor
    (:func:`step_inv`)."""
    inv = layer.inv
    if not fused_rows.fused(layer.w, u):
        return inv
    got = layer.__dict__.get("_step_inv")
    if got is None:
        if inv.is_cuda and torch.cuda.is_current_stream_capturing():
            return inv
        seen = layer.w.__dict__.setdefault("_step_invs", [])
        got = next((c for c in seen if c.shape == inv.shape and c.dtype == inv.dtype and c.device == inv.device
                    and torch.equal(c, inv)), None)
        if got is None:
            seen.append(inv)
            got = inv
        layer.__dict__["_step_inv"] = got
    return got


def _attend(layer, q, kv, rows: _Rows, state, topk: Optional[torch.Tensor], inv: torch.Tensor, tables):
    """(attention output [T, H, D], whether its inverse RoPE is applied already: the step kernel's launch does
    it where ``grouped_output``'s inverse RoPE would run the row kernel on these rows, with the same bits)."""
    if step_kernels(layer.w):
        rope = fused_rows.rope_tables(q, layer.w, rows.pos, inv, tables) if q.dtype == layer.num.dtype else None
        return _attend_kernel(layer, q, kv, rows, state, topk, rope), rope is not None
    return _attend_torch(layer, q, kv, rows, state, topk), False


def _attend_kernel(layer, q, kv, rows: _Rows, state, topk: Optional[torch.Tensor], rope=None) -> torch.Tensor:
    """The step's rows packed once (quantise on insert), attention over ring + step rows + selected
    compressed pages in one kernel, then the ring write (after the read, as in the eager order): in the
    attention's launch where no request has more rows than the ring's spare rows plus one (a decode step:
    a request's reads and writes are then different ring rows), else one launch after it."""
    from redknot.kernels.triton.step_attention_mx import step_attention_mx
    from redknot.kernels.triton.step_indexer_mx import page_rows

    cfg = layer.cfg
    ops = ops_of(layer.w)
    ring_t = state.windows[layer.layer]                                         # [S, ring, bytes]
    nbytes = ring_t.shape[-1]
    packed = rows._memo.pop(("packed", id(kv)), None)   # quantised already by the q / kv launches
    if packed is None:
        packed = torch.empty(rows.t, nbytes, dtype=torch.uint8, device=q.device)
        ops.cache_insert_mx(packed, rows.row, kv, "window")
    comp_cache = comp_idx = None
    if layer.ratio:
        src = state.sources[layer.kv_source]
        per = src.entries.shape[1]

        def pages():   # the consumers of one index source's top-k share these (one launch)
            return page_rows(topk, rows.blocks, layer.ratio, rows.block_size, per), topk
        comp_idx = rows.memo(("comp", id(topk), layer.ratio, per), pages)[0]
        comp_cache = src.entries.view(-1, src.entries.shape[-1])
    ring = ring_t.shape[1]
    flat = ring_t.view(-1, nbytes)
    sink = layer.w.float(f"{layer.p}.attn_sink")
    one_launch = rows.max_rows <= ring - cfg.window_size + 1
    o = step_attention_mx(q, flat, ring, packed, rows.slot, rows.pos, rows.back, cfg.window_size, sink,
                          cfg.head_dim ** -0.5, comp_cache, comp_idx,
                          ring_dest=rows.ring_dest(ring) if one_launch else None, rope=rope)
    if not one_launch:
        flat.index_copy_(0, rows.ring_dest(ring), packed)
    return o


def _attend_torch(layer, q, kv, rows: _Rows, state, topk: Optional[torch.Tensor]) -> torch.Tensor:
    cfg, num = layer.cfg, layer.num
    ring_t = state.windows[layer.layer]                                         # [S, ring, bytes]
    win = cfg.window_size
    packed = mx.pack_window_rows(kv)                                            # [T, bytes]
    raw = rows.ring_lookback(ring_t, packed, win)                               # [T, W, bytes]
    cand = mx.unpack_window_rows(raw.reshape(-1, raw.shape[-1]), num.dtype).view(rows.t, win, -1)
    lpos = rows.pos[:, None] - torch.arange(win, device=q.device)
    valid = lpos >= 0
    if layer.ratio:
        src = state.sources[layer.kv_source]
        sel = topk                                                              # [T, K]
        idx = rows.page(sel.clamp(min=0), layer.ratio, src.entries.shape[1])
        ent = mx.unpack_compressed_entries(src.entries.view(-1, src.entries.shape[-1])[idx.reshape(-1)],
                                           num.dtype).view(rows.t, sel.shape[1], -1)
        cand = torch.cat([cand, ent], dim=1)
        valid = torch.cat([valid, sel >= 0], dim=1)
    ring = ring_t.shape[1]
    ring_t.view(-1, ring_t.shape[-1]).index_copy_(0, rows.ring_dest(ring), packed)
    sink = layer.w.float(f"{layer.p}.attn_sink")
    return sparse_attend(q, cand, valid, sink, cfg.head_dim ** -0.5)
