"""Decode / verify attention over the V4.1 byte caches for the tensor-only step (CUDA-graph safe).

The span kernel (:mod:`attention_mx`) takes window row lists the host lays out per sequence. A captured
step knows only device tensors, so here every per-row fact is read on the device: a program owns one
query row and ``BLOCK_H`` of its heads and walks window offsets ``s = 0..window-1`` (position
``p - s``). Offsets the row's own request holds in this step (``s <= back``: rows ``t - s``) come from
the step's freshly packed rows, the older ones from the layer's ring (``slot·ring + (p - s) mod ring``,
read before this step's rows are stored); positions below 0 are masked. Then the row's compressed
entries (flat page rows, -1 = none) follow. Decoding and arithmetic are those of the span kernel:
bytes decoded in registers, fp32 scores, online softmax started at the sink logit, probabilities cast to
bf16 for PV, fp32 denominator. Rows may be split over programs (``splits``) and merged on the device
(the span kernel's merge).

Shapes depend only on the row count, the window and the compressed list width, never on values, so a
graph captured for one row count replays any step of that row count.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton._common import LOG2E, cdiv, next_pow2
from redknot.kernels.triton.attention_mx import (
    ATTN_MX_TUNER,
    AttnMxConfig,
    _compressed_keys,
    _softmax_step,
    merge_splits,
)
from redknot.kernels.triton.quant_mx import e8m0_decode


@triton.jit
def _window_rows(ring_ptr, new_ptr, ring_row, new_row, outer, inner, stride_r, stride_n,
                 D: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, D] bf16 window rows: ring rows where ``outer``, step rows where ``inner``, else 0."""
    ok = outer | inner
    base = tl.where(inner[:, None], new_ptr + new_row.to(tl.int64)[:, None] * stride_n,
                    ring_ptr + ring_row.to(tl.int64)[:, None] * stride_r)
    q = tl.load(base + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    sb = tl.load(base + D + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=127)
    v = tl.reshape(tl.reshape(v, (BLOCK_N, D // 32, 32)) * e8m0_decode(sb)[:, :, None], (BLOCK_N, D))
    return v.to(tl.bfloat16)


@triton.jit
def _window_rows2(ring_ptr, new_ptr, ring_row, new_row, outer, inner, stride_r, stride_n,
                  D: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_window_rows`` with the ring rows and the step's rows as two masked loads combined by value (each row's
    bytes are read once, from where ``_window_rows`` reads them): the same values."""
    rp = ring_ptr + ring_row.to(tl.int64)[:, None] * stride_r
    npp = new_ptr + new_row.to(tl.int64)[:, None] * stride_n
    cols = tl.arange(0, D)[None, :]
    scols = D + tl.arange(0, D // 32)[None, :]
    q = tl.where(inner[:, None], tl.load(npp + cols, mask=inner[:, None], other=0),
                 tl.load(rp + cols, mask=outer[:, None], other=0))
    sb = tl.where(inner[:, None], tl.load(npp + scols, mask=inner[:, None], other=127),
                  tl.load(rp + scols, mask=outer[:, None], other=127))
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v = tl.reshape(tl.reshape(v, (BLOCK_N, D // 32, 32)) * e8m0_decode(sb)[:, :, None], (BLOCK_N, D))
    return v.to(tl.bfloat16)


@triton.jit
def _step_attn_mx(q_ptr, ring_ptr, new_ptr, slot_ptr, pos_ptr, back_ptr, comp_ptr, cidx_ptr, sink_ptr,
                  out_ptr, ml_ptr, H, NC, RING, WIN, stride_qt, stride_qh, stride_r, stride_n, stride_c,
                  stride_ci, stride_ot, stride_oh, qk_scale, W_CHUNK, C_CHUNK, dest_ptr, HAS_COMP: tl.constexpr,
                  SPLIT: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                  TWO_LOADS: tl.constexpr = False, WRITE: tl.constexpr = False):
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dims = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(tl.bfloat16)
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0) * 1.4426950408889634  # sink, log2 units
    sink = m
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    back = tl.load(back_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    w_end = tl.minimum(WIN, (sp + 1) * W_CHUNK)
    for j0 in range(sp * W_CHUNK, w_end, BLOCK_N):
        s = (j0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        lpos = pos - s
        ok = (s < w_end) & (lpos >= 0)
        inner = ok & (s <= back)
        outer = ok & (s > back)
        ring_row = slot * RING + tl.where(ok, lpos, 0) % RING
        new_row = tl.where(inner, t - s, 0)
        if TWO_LOADS:
            kv = _window_rows2(ring_ptr, new_ptr, ring_row, new_row, outer, inner, stride_r, stride_n, D, BLOCK_N)
        else:
            kv = _window_rows(ring_ptr, new_ptr, ring_row, new_row, outer, inner, stride_r, stride_n, D, BLOCK_N)
        m, l, acc = _softmax_step(q, kv, ok, m, l, acc, qk_scale)
    if HAS_COMP:
        c_end = tl.minimum(NC, (sp + 1) * C_CHUNK)
        for j0 in range(sp * C_CHUNK, c_end, BLOCK_N):
            js = j0 + tl.arange(0, BLOCK_N)
            idx = tl.load(cidx_ptr + t * stride_ci + js, mask=js < c_end, other=-1)
            ok = idx >= 0
            kv = _compressed_keys(comp_ptr, tl.where(ok, idx, 0), ok, stride_c, D, BLOCK_N)
            m, l, acc = _softmax_step(q, kv, ok, m, l, acc, qk_scale)
    if SPLIT:
        nsp = tl.num_programs(2)
        row = (t * nsp + sp) * H + heads
        tl.store(out_ptr + row[:, None] * D + dims[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l, mask=hmask)
    else:
        denom = l + tl.exp2(sink - m)
        o = acc / denom[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    if WRITE:   # the row's ring write, by one program of the row (no program of the launch reads that ring row)
        if (tl.program_id(1) == 0) & (sp == 0):
            dst = ring_ptr + tl.load(dest_ptr + t).to(tl.int64) * stride_r
            src = new_ptr + t * stride_n
            tl.store(dst + dims, tl.load(src + dims))
            sc = D + tl.arange(0, D // 32)
            tl.store(dst + sc, tl.load(src + sc))


def step_attention_mx(q: torch.Tensor, ring: torch.Tensor, ring_size: int, new_rows: torch.Tensor,
                      slot: torch.Tensor, pos: torch.Tensor, back: torch.Tensor, window: int,
                      sinks: torch.Tensor, scale: float, comp_cache: Optional[torch.Tensor] = None,
                      comp_idx: Optional[torch.Tensor] = None, config: Optional[AttnMxConfig] = None,
                      splits: Optional[int] = None, ring_dest: Optional[torch.Tensor] = None,
                      rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """Attention of rows q [T, H, D] (bf16, rotated) over their window and compressed entries.

    ring uint8 [S·ring_size, D + D/32]: the layer's window rings, flat (row ``slot·ring_size + p mod
    ring_size`` holds position p), as they were before this step; new_rows uint8 [T, D + D/32]: this
    step's rows packed; slot, pos, back [T]: each row's state slot, position and the number of rows of
    its request before it in this step; comp_cache uint8 [N, D/2 + D/16] with comp_idx [T, K] flat rows
    (-1 = none). Returns [T, H, D] in q.dtype (see :func:`step_attention_reference`).

    ``config=None``: the launch shape of the span kernel's problem class with the same row count, heads,
    window and compressed width (one tuner for both, so the eager span kernel and this one block and
    split the rows alike and round alike); ``splits`` overrides the split count (tests).

    ``ring_dest`` [T] (flat ring rows): the launch also stores each step row at ``ring[ring_dest[t]]``, the
    write the caller would otherwise make after it. Only where no row of the step reads a ring row another
    row writes: a request's rows read positions ``p0 - window + 1 .. p0 - 1`` (p0 its first row in the step)
    and write ``p0 .. p0 + n - 1``, so ``n <= ring_size - window + 1`` keeps them apart; padding rows sit at
    position 0 and read no ring row.

    ``rope`` = (cos, sin) [T, half]: the output comes back with the inverse RoPE of its last ``2·half`` dims
    (``rope_rows(out, cos, sin, inverse=True)``, the same bits): in the split merge's launch when the rows
    are split, else by ``rope_rows`` after the launch."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    has_comp = comp_idx is not None and comp_cache is not None and comp_idx.shape[1] > 0
    cidx = comp_idx.contiguous() if has_comp else pos
    ccache = comp_cache if has_comp else ring
    nc = cidx.shape[1] if has_comp else 0
    if config is None:
        key = (min(next_pow2(T), 4096), H, D, window, nc)
        config = ATTN_MX_TUNER.pick(key, lambda c: step_attention_mx(   # timed without the ring write
            q, ring, ring_size, new_rows, slot, pos, back, window, sinks, scale, comp_cache, comp_idx, c), q.device)
    block_h, block_n, num_warps = config.block_h, config.block_n, config.num_warps
    splits = config.splits if splits is None else splits
    w_chunk = cdiv(cdiv(window, splits), block_n) * block_n
    c_chunk = cdiv(cdiv(nc, splits), block_n) * block_n if nc else block_n
    sink = sinks.float().contiguous()
    if splits > 1:
        part = torch.empty(T, splits, H, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(T, splits, H, 2, dtype=torch.float32, device=q.device)
    else:
        part, ml = out, sink
    _step_attn_mx[(T, cdiv(H, block_h), splits)](
        q, ring, new_rows, slot, pos, back, ccache, cidx, sink, part, ml, H, nc, ring_size, window,
        q.stride(0), q.stride(1), ring.stride(0), new_rows.stride(0), ccache.stride(0),
        cidx.stride(0) if has_comp else 0, out.stride(0), out.stride(1), float(scale) * LOG2E, w_chunk, c_chunk,
        pos if ring_dest is None else ring_dest.contiguous(),
        HAS_COMP=has_comp, SPLIT=splits > 1, D=D, BLOCK_H=block_h, BLOCK_N=block_n,
        TWO_LOADS=getattr(config, "window_two_loads", False), WRITE=ring_dest is not None, num_warps=num_warps)
    if splits > 1:
        merge_splits(part, ml, sink, out, rope)
    elif rope is not None:
        from redknot.kernels.triton.step_rope_v41 import rope_rows

        out = rope_rows(out, rope[0], rope[1], inverse=True)
    return out


def step_attention_reference(q: torch.Tensor, ring: torch.Tensor, ring_size: int, new_rows: torch.Tensor,
                             slot: torch.Tensor, pos: torch.Tensor, back: torch.Tensor, window: int,
                             sinks: torch.Tensor, scale: float, comp_cache: Optional[torch.Tensor] = None,
                             comp_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same attention in plain PyTorch (exact decoding, fp32 math, no probability rounding)."""
    t = q.shape[0]
    dev = q.device
    s = torch.arange(window, device=dev)
    lpos = pos.long()[:, None] - s                                             # [T, W]
    ok = lpos >= 0
    inner = ok & (s[None, :] <= back.long()[:, None])
    ring_rows = ring[slot.long()[:, None] * ring_size + lpos.clamp(min=0) % ring_size]
    new = new_rows[(torch.arange(t, device=dev)[:, None] - s).clamp(min=0)]
    raw = torch.where(inner[..., None], new, ring_rows)
    kv = mx.unpack_window_rows(raw.reshape(t * window, -1), torch.float32).view(t, window, -1)
    valid = ok
    if comp_idx is not None and comp_cache is not None and comp_idx.shape[1] > 0:
        ent = mx.unpack_compressed_entries(comp_cache[comp_idx.clamp(min=0).reshape(-1)], torch.float32)
        kv = torch.cat([kv, ent.view(t, comp_idx.shape[1], -1)], dim=1)
        valid = torch.cat([valid, comp_idx >= 0], dim=1)
    z = torch.einsum("thd,tmd->thm", q.float(), kv) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(t, -1, 1)
    m = torch.maximum(z.amax(-1, keepdim=True), sink)
    e = torch.exp(z - m)
    o = torch.einsum("thm,tmd->thd", e, kv) / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
    return o.to(q.dtype)
