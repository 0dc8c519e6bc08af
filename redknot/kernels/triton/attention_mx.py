"""Sparse attention with sinks reading the V4.1 byte caches directly (§3.5(e)).

A program owns one query token and ``BLOCK_H`` of its heads. It walks the token's window indices and
then its compressed indices in blocks of ``BLOCK_N``, gathers those rows as bytes (window: e4m3 + E8M0
per 32, 528 B; compressed: packed e2m1 + e4m3 per 16, 288 B), decodes them to bf16 in registers
(exactly: every stored value is representable in bf16), and runs an online softmax: scores in fp32,
probabilities cast to bf16 for the PV product, denominator in fp32, as the reference kernel does. The
running maximum starts at the sink logit, so the sink term ``e^{sink}`` joins the denominator at the
end and a row with no valid index returns 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import LOG2E, ConfigTuner, cdiv, interpreting, next_pow2
from redknot.kernels.triton.attention_prefill_mx import (
    PrefillAttnConfig,
    first_use_ok,
    launcher,
)
from redknot.kernels.triton.attention_prefill_mx_wg import AVAILABLE as GLUON
from redknot.kernels.triton.attention_prefill_mx_wg import PrefillMXWGConfig
from redknot.kernels.triton.quant_mx import e2m1_half, e8m0_decode
from redknot.kernels.triton.step_rope_v41 import _rotate_pairs


@triton.jit
def _window_keys(cache_ptr, idx, ok, stride_c, D: tl.constexpr, BLOCK_N: tl.constexpr):
    base = cache_ptr + idx.to(tl.int64)[:, None] * stride_c
    q = tl.load(base + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    sb = tl.load(base + D + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=127)
    v = tl.reshape(tl.reshape(v, (BLOCK_N, D // 32, 32)) * e8m0_decode(sb)[:, :, None], (BLOCK_N, D))
    return v.to(tl.bfloat16)


@triton.jit
def _compressed_keys(cache_ptr, idx, ok, stride_c, D: tl.constexpr, BLOCK_N: tl.constexpr):
    base = cache_ptr + idx.to(tl.int64)[:, None] * stride_c
    p = tl.load(base + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(p, p >> 4), (BLOCK_N, D))          # e2m1_half reads only each nibble's bits
    v = e2m1_half(codes).to(tl.float32)                           # value * 2^-14, exact
    s8 = tl.load(base + D // 2 + tl.arange(0, D // 16)[None, :], mask=ok[:, None], other=0)
    s = s8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    v = tl.reshape(tl.reshape(v, (BLOCK_N, D // 16, 16)) * s[:, :, None], (BLOCK_N, D))
    return v.to(tl.bfloat16)


@triton.jit
def _softmax_step(q, kv, ok, m, l, acc, qk_scale):
    z = tl.dot(q, tl.trans(kv)) * qk_scale  # [BH, BN], log2 units
    z = tl.where(ok[None, :], z, float("-inf"))
    m_new = tl.maximum(m, tl.max(z, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(z - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), kv)
    return m_new, l, acc


@triton.jit
def _sparse_attn_mx(q_ptr, win_ptr, widx_ptr, comp_ptr, cidx_ptr, sink_ptr, out_ptr, ml_ptr, H, NW, NC,
                    stride_qt, stride_qh, stride_w, stride_wi, stride_c, stride_ci, stride_ot, stride_oh, qk_scale,
                    W_CHUNK, C_CHUNK, HAS_COMP: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """SPLIT: program (t, head block, s) takes rows [s·W_CHUNK, (s+1)·W_CHUNK) of the window list and the
    same of the compressed list, and writes its unnormalised (acc, running max, running sum) to
    ``out_ptr`` [T, S, H, D] / ``ml_ptr`` [T, S, H, 2] fp32 for the merge."""
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
    w_end = tl.minimum(NW, (sp + 1) * W_CHUNK)
    for j0 in range(sp * W_CHUNK, w_end, BLOCK_N):
        js = j0 + tl.arange(0, BLOCK_N)
        idx = tl.load(widx_ptr + t * stride_wi + js, mask=js < w_end, other=-1)
        ok = idx >= 0
        kv = _window_keys(win_ptr, tl.where(ok, idx, 0), ok, stride_w, D, BLOCK_N)
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
        row = (t * nsp + sp) * H + heads  # [BH] rows of the [T, S, H] partials
        tl.store(out_ptr + row[:, None] * D + dims[None, :], acc, mask=hmask[:, None])
        tl.store(ml_ptr + row * 2, m, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l, mask=hmask)
    else:
        denom = l + tl.exp2(sink - m)
        o = acc / denom[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _merge_splits_kernel(part_ptr, ml_ptr, sink_ptr, out_ptr, cos_ptr, sin_ptr, H, stride_ot, stride_oh, stride_c,
                         S: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr = 0,
                         ASM: tl.constexpr = False):
    """One (query row, head): its ``S`` split partials [T, S, H, D] (unnormalised fp32 sums, each split's
    running max and denominator in ``ml`` [T, S, H, 2], log2 units) merged with the sink term. ``HALF`` > 0:
    the merged row, rounded to the output dtype, then rotated back by the row's RoPE angles (``cos`` /
    ``sin`` [T, HALF], the last ``2·HALF`` dims in interleaved pairs), as ``step_rope_v41.rope_rows(...,
    inverse=True)`` does after it: the same arithmetic, in this launch."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < S
    rows = (t * S + sp) * H + h
    m = tl.load(ml_ptr + rows * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + rows * 2 + 1, mask=smask, other=0.0)
    top = tl.max(m, 0)
    wgt = tl.exp2(m - top)          # 0 past S; every split's max started at the sink, so none is -inf
    denom = tl.sum(wgt * l, 0) + tl.exp2(tl.load(sink_ptr + h) * 1.4426950408889634 - top)
    dims = tl.arange(0, D)
    part = tl.load(part_ptr + rows.to(tl.int64)[:, None] * D + dims[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(wgt[:, None] * part, 0) / denom
    if HALF > 0:   # rope_rows' inverse rotation of the rounded row (step_rope_v41._rotate_pairs)
        re, im = tl.split(tl.reshape(o.to(out_ptr.dtype.element_ty).to(tl.float32), (D // 2, 2)))
        c_off = t.to(tl.int64) * stride_c
        re, im = _rotate_pairs(re, im, tl.arange(0, D // 2), cos_ptr + c_off, sin_ptr + c_off, D // 2 - HALF,
                               D // 2, True, out_ptr.dtype.element_ty, ASM)
        o = tl.reshape(tl.join(re, im), (D,))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, o.to(out_ptr.dtype.element_ty))


def merge_splits(part: torch.Tensor, ml: torch.Tensor, sink: torch.Tensor, out: torch.Tensor,
                 rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
    """``out`` [T, H, D] from a split launch's partials ``part`` [T, S, H, D] and ``ml`` [T, S, H, 2] (fp32,
    contiguous) and the fp32 sink logits [H], in one launch (the span and the step kernels merge alike);
    ``rope`` = (cos, sin) [T, half] fp32: each merged row also gets the inverse RoPE of its last ``2·half``
    dims (``rope_rows(out, cos, sin, inverse=True)``'s bits) in the same launch."""
    T, S, H, D = part.shape
    half = 0 if rope is None else rope[0].shape[-1]
    cos, sin = (sink, sink) if rope is None else (rope[0].contiguous(), rope[1].contiguous())
    if half and (2 * half > D or cos.shape != (T, half) or sin.shape != cos.shape):
        raise ValueError(f"merge_splits: rope tables {tuple(cos.shape)} / {tuple(sin.shape)} for {T} rows of "
                         f"{D} dims: want [T, half] each with 2·half <= {D}")
    _merge_splits_kernel[(T, H)](part, ml, sink, out, cos, sin, H, out.stride(0), out.stride(1), max(half, 1), S=S,
                                 BLOCK_S=next_pow2(S), D=D, HALF=half, ASM=not interpreting() and out.is_cuda,
                                 num_warps=4)
    return out


@dataclass(frozen=True)
class AttnMxConfig:
    block_h: int = 16   # heads per program: each gathered row is decoded once per head block
    block_n: int = 32   # rows per online-softmax step
    num_warps: int = 8
    splits: int = 1     # > 1: the rows of a query are split over programs and merged (decode batches)
    # The step kernel (``step_attention_mx``) only: a window row's bytes as two masked loads (ring rows, the step's
    # own rows) combined by value, instead of one load through a pointer chosen per row: plain pointer arithmetic
    # that Triton's pipeliner takes (sm_90a: the one-load window loop is not pipelined, the compressed loop is).
    window_two_loads: bool = False


ATTN_MX_TUNER = ConfigTuner("sparse_attention_mx", [
    AttnMxConfig(16, 32, 8), AttnMxConfig(32, 32, 8), AttnMxConfig(64, 16, 8), AttnMxConfig(32, 64, 8),
    AttnMxConfig(64, 32, 8), AttnMxConfig(16, 64, 4), AttnMxConfig(32, 32, 8, 5), AttnMxConfig(16, 32, 8, 10),
    # a decode row alone: 64 heads in 4 blocks x 16 or 32 splits = 64 / 128 programs (1 split: 2-4)
    AttnMxConfig(16, 32, 4, 16), AttnMxConfig(16, 16, 4, 32),
    # decode batches of ~32 rows: one wave of programs. On the H100 (run 3 tuning, 128 + 512 keys, 64 heads of 512)
    # a program's 32-key step took ~5.7 us whatever its head block (64 heads, 1 split: 0.114 ms at 128 rows and at
    # 32 rows), and ~250 registers keep one program per SM: time ~ waves x steps. At 32 rows 32 heads x 5 splits
    # (0.075 ms): chunks of 32 window + 128 compressed keys, so the fifth split is empty: 256 working programs in 2
    # waves of 5 steps; 64 heads x 4 splits is 128 programs in one wave of 5 steps (x 2: 64 programs of 10 steps);
    # 32 heads x 4 splits the same 256 x 5 without the empty programs. Not measured on the H200.
    AttnMxConfig(64, 32, 8, 4), AttnMxConfig(64, 32, 8, 2), AttnMxConfig(32, 32, 8, 4),
    # the window rows as two pipelined loads (the step kernel; the span kernel runs these as the shapes above)
    AttnMxConfig(64, 32, 8, 4, True), AttnMxConfig(64, 32, 8, 1, True), AttnMxConfig(32, 32, 8, 4, True),
])
# Prefill-sized problems (a program per query and head block already fills the device many times over)
# time only the unsplit shapes: each candidate is a compile in the first chunk.
PREFILL_QUERIES = 1024
# All 64 heads in one program with 16 warps: each gathered row decoded once per query, the [64, 512]
# fp32 accumulator over 512 threads. Then the transposed prefill kernel (``attention_prefill_mx``: keys on
# the MMA's M side, 128 keys per step over two warpgroups, the latent in four decoded chunks), all heads (each
# chunk's bytes loaded where decoded, or a chunk ahead) or 32 heads per program (a chunk ahead); each runs only
# after its first-use check against the reference on the device.
ATTN_MX_PREFILL_TUNER = ConfigTuner("sparse_attention_mx_prefill",
                                    [c for c in ATTN_MX_TUNER.candidates if c.splits == 1 and not c.window_two_loads]
                                    + [AttnMxConfig(64, 32, 16), PrefillAttnConfig(128, 8, 4, 64, 1),
                                       PrefillAttnConfig(128, 8, 4, 64, 1, lookahead=True),
                                       PrefillAttnConfig(128, 8, 4, 32, 1, lookahead=True)]
                                    + ([PrefillMXWGConfig(32, 3), PrefillMXWGConfig(32, 4), PrefillMXWGConfig(16, 4)]
                                       if GLUON else []))


def sparse_attention_mx(q: torch.Tensor, window_cache: torch.Tensor, window_idx: torch.Tensor,
                        sinks: torch.Tensor, scale: float, comp_cache: torch.Tensor | None = None,
                        comp_idx: torch.Tensor | None = None, config=None
                        ) -> torch.Tensor:
    """See ``ref_v41.sparse_attention_mx``; q [T, H, D] (D a power of two), int32/int64 indices.
    ``config=None``: the launch shape is measured per problem class on a GPU; an ``AttnMxConfig`` runs this
    module's kernel, a ``PrefillAttnConfig`` the transposed prefill kernel (after its first-use check)."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    if config is None:
        key = (min(next_pow2(T), 4096), H, D, window_idx.shape[1], 0 if comp_idx is None else comp_idx.shape[1])
        tuner = ATTN_MX_PREFILL_TUNER if T >= PREFILL_QUERIES else ATTN_MX_TUNER
        config = tuner.pick(key, lambda cfg: sparse_attention_mx(
            q, window_cache, window_idx, sinks, scale, comp_cache, comp_idx, cfg), q.device)
    if isinstance(config, (PrefillAttnConfig, PrefillMXWGConfig)):
        if q.is_cuda and not first_use_ok(config, q.device):
            raise RuntimeError(f"sparse_attention_mx: {config} failed its first-use check against the reference")
        return launcher(config)(q, window_cache, window_idx, sinks, scale, comp_cache, comp_idx, config)
    block_h, block_n, num_warps, splits = config.block_h, config.block_n, config.num_warps, config.splits
    has_comp = comp_idx is not None and comp_cache is not None and comp_idx.shape[1] > 0
    widx = window_idx.contiguous()
    cidx = comp_idx.contiguous() if has_comp else widx
    ccache = comp_cache if has_comp else window_cache
    nw, nc = widx.shape[1], cidx.shape[1] if has_comp else 0
    w_chunk = cdiv(cdiv(nw, splits), block_n) * block_n
    c_chunk = cdiv(cdiv(nc, splits), block_n) * block_n if nc else block_n
    sink = sinks.float().contiguous()
    if splits > 1:
        part = torch.empty(T, splits, H, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(T, splits, H, 2, dtype=torch.float32, device=q.device)
    else:
        part, ml = out, sink
    _sparse_attn_mx[(T, cdiv(H, block_h), splits)](
        q, window_cache, widx, ccache, cidx, sink, part, ml, H, nw, nc, q.stride(0), q.stride(1),
        window_cache.stride(0), widx.stride(0), ccache.stride(0), cidx.stride(0), out.stride(0), out.stride(1),
        float(scale) * LOG2E, w_chunk, c_chunk, HAS_COMP=has_comp, SPLIT=splits > 1, D=D, BLOCK_H=block_h,
        BLOCK_N=block_n, num_warps=num_warps)
    if splits > 1:
        merge_splits(part, ml, sink, out)
    return out
