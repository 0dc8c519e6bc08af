"""V4 sparse attention on Hopper: one shared 512-dim K=V head, 64 query heads, joint softmax with sinks.

One program owns one query token and ``BLOCK_H`` heads and walks that token's key list, which is the
virtual concatenation of

* its sliding window, positions ``max(0, t-W+1) .. t``: rows of this step's ``kv`` for positions at or
  after the sequence's ``context_len``, rows of the per-sequence ring (``t % ring``) before it;
* its compressed entries, read straight from the paged cache through the block table (entry ``w`` of
  ratio ``m`` sits in block ``block_table[w*m // block_size]`` at offset ``(w*m % block_size) // m``):
  either the indexer's top-k list (``topk[t]``, ``-1`` = empty) or every visible entry
  ``w < (t+1) // m``.

Keys are gathered once per block and used twice (``S = Q·Kᵀ`` and ``O += P·K``, since V = K). The sink
joins the softmax denominator only. Short key lists with few tokens (decode) are split over several
programs per token and merged by a second kernel. The inverse RoPE of the output's rope slice is fused:
two small accumulators carry the rope columns and their pair-swapped copy, so the epilogue rotates in
registers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import (LOG2E, ConfigTuner, as_i32, cdiv, check_last_dim_contiguous, dot_precision,
                                            next_pow2, sm_count)

try:  # Gluon ships with Triton >= 3.5; without it the prefill tuners never offer the Gluon forms
    import triton.experimental.gluon  # noqa: F401
    GLUON = True
except ImportError:  # pragma: no cover - older Triton
    GLUON = False

COMP_NONE, COMP_TOPK, COMP_ALL = 0, 1, 2


@dataclass(frozen=True)
class AttnConfig:
    """Launch shape of the attention kernel (``num_splits=0``: chosen from the problem size)."""
    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 1
    num_splits: int = 0
    prefetch: bool = False  # compute the next key block's row pointers (top-k id, block table) one block ahead


@dataclass(frozen=True)
class AttnDecodeConfig(AttnConfig):
    """A decode-step launch shape whose key splits may be as short as ``split_keys`` keys (``AttnConfig``: four
    key blocks at least). At batch 1 a step's 128-640 keys otherwise make one to five programs of 64 heads,
    each walking its blocks one after another; short splits and fewer heads per program spread the same reads
    over more SMs, for a merge of more partial rows."""
    split_keys: int = 32


@dataclass(frozen=True)
class PrefillTConfig:
    """Launch shape of the transposed prefill kernel (``attention_prefill``: keys on the MMA's M side), a
    candidate of ``ATTN_PREFILL_TUNER`` only (unsplit launches, bf16 rows)."""
    block_n: int = 128   # keys per online-softmax step: 64 per warpgroup
    num_warps: int = 8
    d_split: int = 4     # column chunks of the 512-wide rows (1, 2 or 4)
    block_h: int = 64    # heads per program
    num_stages: int = 1
    prefetch: bool = False  # the next block's row pointers one block ahead


@dataclass(frozen=True)
class PrefillWGConfig:
    """Launch shape of the Gluon prefill kernel (``attention_prefill_wg``), a candidate of ``ATTN_PREFILL_TUNER``
    (bf16 rows, 64-head programs, 8 warps). Shared memory: Q (64 x D bf16) + ``stages`` key buffers
    (block_n x D bf16) + P (64 x block_n bf16): 200 KB at D = 512, block_n 64, 2 stages."""
    block_n: int = 64
    stages: int = 2


@triton.jit
def _finalize(acc, acc_r, acc_sw, m_i, l_i, sink_ptr, cos_ptr, sin_ptr, out_ptr, tok, offs_h, offs_d, offs_r,
              stride_ot, stride_oh, H: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, HAS_SINK: tl.constexpr,
              ROPE: tl.constexpr):
    """Sink, normalisation, inverse RoPE of the rope columns, store."""
    hmask = offs_h < H
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        l_f = l_i * alpha + tl.exp2(sink - m_f)
    else:
        alpha = tl.full(m_i.shape, 1.0, tl.float32)
        l_f = l_i
    factor = alpha / l_f
    o = acc * factor[:, None]
    row = out_ptr + tok.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
    if ROPE:
        tl.store(row + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & (offs_d[None, :] < D - RD))
        half = offs_r // 2
        c = tl.load(cos_ptr + tok.to(tl.int64) * (RD // 2) + half)
        s = tl.load(sin_ptr + tok.to(tl.int64) * (RD // 2) + half)
        sign = tl.where(offs_r % 2 == 0, 1.0, -1.0)
        rot = acc_r * factor[:, None] * c[None, :] + acc_sw * factor[:, None] * (sign * s)[None, :]
        tl.store(row + (D - RD) + offs_r[None, :], rot.to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        tl.store(row + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _key_rows(kb, k_hi, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr,
              topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt, stride_tk,
              ring_size, ratio, block_size, BLOCK_N: tl.constexpr, COMP: tl.constexpr,
              HAS_RING: tl.constexpr):
    """Row pointers and validity of the virtual keys ``kb .. kb+BLOCK_N``."""
    return key_rows_at(kb + tl.arange(0, BLOCK_N), k_hi, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr,
                       cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce,
                       stride_bt, stride_tk, ring_size, ratio, block_size, COMP, HAS_RING)


@triton.jit
def key_rows_at(kv_i, k_hi, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr, topk_ptr,
                stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt, stride_tk, ring_size, ratio,
                block_size, COMP: tl.constexpr, HAS_RING: tl.constexpr):
    """Row pointers and validity of the virtual keys ``kv_i`` (in the layout ``kv_i`` has: the Gluon prefill
    kernel calls this with its own): the window's rows from this step's ``kv`` or the ring, then the compressed
    entries through the top-k list (COMP 1) or by index (COMP 2) and the block table."""
    in_rng = kv_i < k_hi
    is_swa = kv_i < n_swa
    p = lo + kv_i
    ptr = kv_ptr + (qs + p - ctx).to(tl.int64) * stride_kvt
    if HAS_RING:
        ring_row = slot.to(tl.int64) * stride_rs + (p % ring_size).to(tl.int64) * stride_rr
        ptr = tl.where(p >= ctx, ptr, ring_ptr + ring_row)
    valid = in_rng & is_swa
    if COMP != 0:
        ci = kv_i - n_swa
        comp_ok = in_rng & (kv_i >= n_swa)
        if COMP == 1:
            w = tl.load(topk_ptr + tok.to(tl.int64) * stride_tk + ci, mask=comp_ok, other=-1)
            comp_ok = comp_ok & (w >= 0)
        else:
            w = ci
        first = w * ratio
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + first // block_size, mask=comp_ok, other=0)
        crow = blk.to(tl.int64) * stride_cb + ((first % block_size) // ratio).to(tl.int64) * stride_ce
        ptr = tl.where(is_swa, ptr, cache_ptr + crow)
        valid = valid | comp_ok
    return ptr, valid


@triton.jit
def _query_span(tok, tok_seq_ptr, pos_ptr, ctx_ptr, qstart_ptr, slot_ptr, window, ratio, num_topk,
                COMP: tl.constexpr, HAS_RING: tl.constexpr):
    """Query ``tok``'s sequence ``b``, context length, first query row, ring slot, first window
    key ``lo`` and its window / compressed key counts."""
    b = tl.load(tok_seq_ptr + tok)
    t = tl.load(pos_ptr + tok)
    ctx = tl.load(ctx_ptr + b)
    qs = tl.load(qstart_ptr + b)
    slot = 0
    if HAS_RING:
        slot = tl.load(slot_ptr + b)
    lo = tl.maximum(t - window + 1, 0)
    n_swa = t - lo + 1
    n_comp = 0
    if COMP == 1:
        n_comp = num_topk
    elif COMP == 2:
        n_comp = (t + 1) // ratio
    return b, ctx, qs, slot, lo, n_swa, n_comp


@triton.jit
def _sparse_attn_fwd(q_ptr, kv_ptr, ring_ptr, cache_ptr, out_ptr, pacc_ptr, prope_ptr, pml_ptr,
                     tok_seq_ptr, pos_ptr, ctx_ptr, qstart_ptr, slot_ptr, bt_ptr, topk_ptr, sink_ptr,
                     cos_ptr, sin_ptr, nsplit,
                     stride_qt, stride_qh, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce,
                     stride_ot, stride_oh, stride_bt, stride_tk,
                     qk_scale, ring_size, window, ratio, block_size, num_topk,
                     H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, RD: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_N: tl.constexpr, COMP: tl.constexpr, SPLIT: tl.constexpr, HAS_RING: tl.constexpr,
                     HAS_SINK: tl.constexpr, ROPE: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    tok = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_s = tl.program_id(2)
    b, ctx, qs, slot, lo, n_swa, n_comp = _query_span(tok, tok_seq_ptr, pos_ptr, ctx_ptr, qstart_ptr, slot_ptr,
                                                      window, ratio, num_topk, COMP, HAS_RING)
    n_tot = n_swa + n_comp
    chunk = tl.cdiv(tl.cdiv(n_tot, nsplit), BLOCK_N) * BLOCK_N
    k_lo = pid_s * chunk
    k_hi = tl.minimum(k_lo + chunk, n_tot)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, RD)
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h < H)[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    acc_r = tl.zeros([BLOCK_H, RD], tl.float32)
    acc_sw = tl.zeros([BLOCK_H, RD], tl.float32)
    ptr_nx, valid_nx = _key_rows(k_lo, k_hi, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr,
                                 cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb,
                                 stride_ce, stride_bt, stride_tk, ring_size, ratio, block_size, BLOCK_N,
                                 COMP, HAS_RING)
    for kb in range(k_lo, k_hi, BLOCK_N):
        if PREFETCH:  # the index loads of block kb+BLOCK_N overlap this block's key load and dots
            ptr, valid = ptr_nx, valid_nx
            ptr_nx, valid_nx = _key_rows(kb + BLOCK_N, k_hi, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr,
                                         cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb,
                                         stride_ce, stride_bt, stride_tk, ring_size, ratio, block_size, BLOCK_N,
                                         COMP, HAS_RING)
        else:
            ptr, valid = _key_rows(kb, k_hi, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr,
                                   cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb,
                                   stride_ce, stride_bt, stride_tk, ring_size, ratio, block_size, BLOCK_N,
                                   COMP, HAS_RING)
        k = tl.load(ptr[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pk = p.to(k.dtype)
        acc = acc * alpha[:, None] + tl.dot(pk, k, input_precision=PREC)
        if ROPE:
            kr = tl.load(ptr[:, None] + (D - RD) + offs_r[None, :], mask=valid[:, None], other=0.0)
            ksw = tl.load(ptr[:, None] + (D - RD) + (offs_r ^ 1)[None, :], mask=valid[:, None], other=0.0)
            acc_r = acc_r * alpha[:, None] + tl.dot(pk, kr, input_precision=PREC)
            acc_sw = acc_sw * alpha[:, None] + tl.dot(pk, ksw, input_precision=PREC)
        m_i = m_new

    if not SPLIT:
        _finalize(acc, acc_r, acc_sw, m_i, l_i, sink_ptr, cos_ptr, sin_ptr, out_ptr, tok, offs_h, offs_d,
                  offs_r, stride_ot, stride_oh, H, D, RD, HAS_SINK, ROPE)
    else:
        # rows of the partial buffers, padded heads included so the merge reads whole blocks
        part = (tok.to(tl.int64) * nsplit + pid_s) * HP + offs_h  # [BLOCK_H]
        tl.store(pacc_ptr + part[:, None] * D + offs_d[None, :], acc)
        tl.store(pml_ptr + part * 2, m_i)
        tl.store(pml_ptr + part * 2 + 1, l_i)
        if ROPE:
            tl.store(prope_ptr + part[:, None] * (2 * RD) + offs_r[None, :], acc_r)
            tl.store(prope_ptr + part[:, None] * (2 * RD) + RD + offs_r[None, :], acc_sw)


@triton.jit
def _sparse_attn_merge(pacc_ptr, prope_ptr, pml_ptr, sink_ptr, cos_ptr, sin_ptr, out_ptr, stride_ot, stride_oh,
                       nsplit, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, RD: tl.constexpr,
                       NSP2: tl.constexpr, DC: tl.constexpr, HAS_SINK: tl.constexpr, ROPE: tl.constexpr):
    """One (query row, head, column chunk) of a split launch: every split's partial loaded at once ([NSP2, DC]:
    one load latency, not one per split) and summed with the splits' softmax weights, then the sink and the
    normalisation as ``_finalize``. Chunks 0 .. D/DC-1 are the plain columns; with ROPE a last chunk is the rope
    columns, rotated back from the two partial sums (``acc_r``, ``acc_sw``)."""
    tok = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    sp = tl.arange(0, NSP2)
    smask = sp < nsplit
    part = (tok.to(tl.int64) * nsplit + sp) * HP + h  # [NSP2]
    m = tl.load(pml_ptr + part * 2, mask=smask, other=float("-inf"))
    l = tl.load(pml_ptr + part * 2 + 1, mask=smask, other=0.0)
    m_g = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_g == float("-inf"), 0.0, m_g))  # an empty split (m = -inf) weighs 0
    l_g = tl.sum(w * l, 0)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_g, sink)
        factor = tl.exp2(m_g - m_f) / (l_g * tl.exp2(m_g - m_f) + tl.exp2(sink - m_f))
    else:
        factor = 1.0 / l_g
    row = out_ptr + tok.to(tl.int64) * stride_ot + h * stride_oh
    if c < D // DC:
        cols = c * DC + tl.arange(0, DC)
        acc = tl.sum(w[:, None] * tl.load(pacc_ptr + part[:, None] * D + cols[None, :], mask=smask[:, None],
                                          other=0.0), 0)
        keep = cols < (D - RD if ROPE else D)
        tl.store(row + cols, (acc * factor).to(out_ptr.dtype.element_ty), mask=keep)
    else:
        offs_r = tl.arange(0, RD)
        base = prope_ptr + part[:, None] * (2 * RD) + offs_r[None, :]
        acc_r = tl.sum(w[:, None] * tl.load(base, mask=smask[:, None], other=0.0), 0)
        acc_sw = tl.sum(w[:, None] * tl.load(base + RD, mask=smask[:, None], other=0.0), 0)
        half = offs_r // 2
        cs = tl.load(cos_ptr + tok.to(tl.int64) * (RD // 2) + half)
        sn = tl.load(sin_ptr + tok.to(tl.int64) * (RD // 2) + half)
        sign = tl.where(offs_r % 2 == 0, 1.0, -1.0)
        rot = acc_r * factor * cs + acc_sw * factor * (sign * sn)
        tl.store(row + (D - RD) + offs_r, rot.to(out_ptr.dtype.element_ty))


def _choose_splits(cfg: AttnConfig, num_tokens: int, num_hblocks: int, max_keys: int, device_sms: int) -> int:
    if cfg.num_splits > 0:
        return cfg.num_splits
    programs = num_tokens * num_hblocks
    if programs >= 2 * device_sms:
        return 1
    want = cdiv(2 * device_sms, programs)
    # Each split should still own a few key blocks, or the merge costs more than it saves (a decode shape
    # names its own floor).
    per_split = max(cfg.block_n, getattr(cfg, "split_keys", 4 * cfg.block_n))
    return max(1, min(want, cdiv(max_keys, per_split), 64))


ATTN_TUNER = ConfigTuner("sparse_attention", [
    AttnConfig(block_h=64, block_n=32, num_warps=8, num_stages=2),
    AttnConfig(block_h=64, block_n=64, num_warps=8, num_stages=1),
    AttnConfig(block_h=64, block_n=32, num_warps=8, num_stages=1),
])
# Measured on the H200 (ms; CSA prefill chunk of 8192 queries at 8K / SWA the same / CSA-HCA decode b2):
# 64/32/8w/2st 8.94 / 1.05 / 0.12; 64/64/8w/1st 12.4 / 1.03 / 0.16; 64/32/8w/1st 9.35 / 1.04 / 0.14.
# Dropped after measuring: 4 stages (Triton's pipelining of the top-k -> block-table -> key chain) 11.3;
# index loads issued a block ahead (``prefetch``) 9.18; 32 heads per program, 4 or 8 warps, 15.0 / 14.4.
# Prefill classes of bf16 rows: the same shapes, then the transposed prefill kernel
# (``attention_prefill``, 128 keys per step over two warpgroups, the rows in four column chunks): 64 heads with
# the row pointers in step or a block ahead, 32 heads (no spills, every row read twice per query); each only
# after its first-use check against the oracle. Not measured on the H200.
# Decode classes (few query rows): the same shapes, then splits of one or two key blocks with 16-64 heads a
# program. Not measured on the H200 yet.
ATTN_DECODE_TUNER = ConfigTuner("sparse_attention_decode", ATTN_TUNER.candidates + [
    AttnDecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=1, split_keys=32),
    AttnDecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, split_keys=32),
    AttnDecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=1, split_keys=64),
    AttnDecodeConfig(block_h=32, block_n=32, num_warps=4, num_stages=1, split_keys=64)])
ATTN_PREFILL_TUNER = ConfigTuner("sparse_attention_prefill", ATTN_TUNER.candidates + [
    PrefillTConfig(128, 8, 4, 64), PrefillTConfig(128, 8, 4, 64, prefetch=True), PrefillTConfig(128, 8, 4, 32)]
    + ([PrefillWGConfig(64, 2), PrefillWGConfig(32, 3), PrefillWGConfig(32, 4)] if GLUON else []))


def sparse_attention_paged(q: torch.Tensor, kv: torch.Tensor, *, token_seq: torch.Tensor, positions: torch.Tensor,
                           context_lens: torch.Tensor, query_start: torch.Tensor, window: int,
                           sink: Optional[torch.Tensor], scale: float,
                           ring: Optional[torch.Tensor] = None, seq_slots: Optional[torch.Tensor] = None,
                           cache: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                           ratio: int = 0, block_size: int = 0, topk: Optional[torch.Tensor] = None,
                           rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None,
                           out: Optional[torch.Tensor] = None, config: Optional[AttnConfig] = None) -> torch.Tensor:
    """Sparse V4 attention for the ``T`` query tokens of one step (sequences concatenated).

    q ``[T, H, D]``; kv ``[T, D]`` (this step's K=V rows); token_seq/positions ``[T]``; per sequence
    ``context_lens`` (first position of the step), ``query_start`` (its first row in ``q``), ``seq_slots``;
    ring ``[num_slots, ring, D]`` (rows for positions before the step); cache ``[num_blocks,
    block_size // ratio, D]`` with ``block_table [B, max_blocks]``; ``topk [T, K]`` selects entries
    (CSA), otherwise every visible entry is used (HCA) when a cache is given; ``topk`` and
    ``block_table`` may be int32 or int64; sink ``[H]`` fp32; ``rope_cos/sin [T, rope_dim // 2]`` fp32 at
    each query's position: the output's last ``rope_dim`` columns are rotated back by the query position
    (interleaved pairs). ``config=None`` picks the launch shape by measurement per problem class.
    """
    T, H, D = q.shape
    for name, t in (("q", q), ("kv", kv)):
        check_last_dim_contiguous(name, t)
    out = torch.empty_like(q) if out is None else out
    if T == 0:
        return out
    dummy_i = as_i32(positions)
    args = dict(q=q, kv=kv, token_seq=as_i32(token_seq), positions=dummy_i, context_lens=as_i32(context_lens),
                query_start=as_i32(query_start), window=window, sink=sink, scale=scale, ring=ring,
                seq_slots=as_i32(seq_slots) if seq_slots is not None else dummy_i, cache=cache,
                block_table=block_table, ratio=ratio, block_size=block_size, topk=topk,
                rope_cos=rope_cos.float().contiguous() if rope_cos is not None else None,
                rope_sin=rope_sin.float().contiguous() if rope_sin is not None else None, out=out)
    if config is None:
        comp = COMP_NONE if cache is None else (COMP_TOPK if topk is not None else COMP_ALL)
        phase = "decode" if T * H < 128 * sm_count(q) else "prefill"
        key = (comp, phase, H, D, str(q.dtype), rope_cos is not None)
        if phase == "decode":  # batch 1 and batch 32 want different splits: the row count's power of two
            key += (next_pow2(T),)
        tuner = (ATTN_DECODE_TUNER if phase == "decode" else
                 ATTN_PREFILL_TUNER if q.dtype == torch.bfloat16 else ATTN_TUNER)
        config = tuner.pick(key, lambda cfg: _run(cfg, args), q.device)
    return _run(config, args)


def _run(cfg, args: dict) -> torch.Tensor:
    """``cfg``'s kernel: ``AttnConfig`` this module's, ``PrefillTConfig`` the transposed prefill kernel (bf16 rows,
    after its first-use check on a GPU)."""
    if isinstance(cfg, (PrefillTConfig, PrefillWGConfig)):
        from redknot.kernels.triton import attention_prefill
        q = args["q"]
        if q.dtype != torch.bfloat16:
            raise ValueError(f"sparse_attention_paged: {cfg} takes bf16 rows, not {q.dtype}")
        comp = "none" if args["cache"] is None else ("topk" if args["topk"] is not None else "all")
        if q.is_cuda and not attention_prefill.first_use_ok(cfg, q.device, args["rope_cos"] is not None, comp):
            raise RuntimeError(f"sparse_attention_paged: {cfg} failed its first-use check against the oracle")
        return attention_prefill.launcher(cfg)(cfg, **args)
    return _launch(cfg, **args)


def _launch(cfg: AttnConfig, *, q, kv, token_seq, positions, context_lens, query_start, window, sink, scale, ring,
            seq_slots, cache, block_table, ratio, block_size, topk, rope_cos, rope_sin, out) -> torch.Tensor:
    T, H, D = q.shape
    block_h = max(16, min(cfg.block_h, next_pow2(H)))  # tensor-core dots need >= 16 rows; extra heads are masked
    n_hblocks = cdiv(H, block_h)
    hp = n_hblocks * block_h
    comp = COMP_NONE if cache is None else (COMP_TOPK if topk is not None else COMP_ALL)
    rope = rope_cos is not None
    rd = 2 * rope_cos.shape[-1] if rope else 16
    ring_t = ring if ring is not None else kv
    cache_t = cache if cache is not None else kv
    bt = block_table if block_table is not None else positions.view(1, -1)
    tk = topk if topk is not None else positions.view(-1, 1)
    cos = rope_cos if rope else q
    sin = rope_sin if rope else q
    max_keys = window + (tk.shape[1] if comp == COMP_TOPK else
                         (bt.shape[1] * block_size // max(ratio, 1) if comp == COMP_ALL else 0))
    nsplit = _choose_splits(cfg, T, n_hblocks, max_keys, sm_count(q))
    if nsplit > 1:
        pacc = torch.empty(T * nsplit * hp, D, device=q.device, dtype=torch.float32)  # [T*S*HP, D]
        prope = torch.empty(T * nsplit * hp, 2 * rd, device=q.device, dtype=torch.float32)  # [T*S*HP, 2*RD]
        pml = torch.empty(T * nsplit * hp, 2, device=q.device, dtype=torch.float32)  # [T*S*HP, (m, l)]
    else:
        pacc = prope = pml = out
    sink_t = sink if sink is not None else q
    _sparse_attn_fwd[(T, n_hblocks, nsplit)](
        q, kv, ring_t, cache_t, out, pacc, prope, pml, token_seq, positions, context_lens, query_start,
        seq_slots, bt, tk, sink_t, cos, sin, nsplit,
        q.stride(0), q.stride(1), kv.stride(0),
        ring_t.stride(0) if ring is not None else 0, ring_t.stride(1) if ring is not None else 0,
        cache_t.stride(0) if cache is not None else 0, cache_t.stride(1) if cache is not None else 0,
        out.stride(0), out.stride(1), bt.stride(0), tk.stride(0),
        scale * LOG2E, ring.shape[1] if ring is not None else 1, window, max(ratio, 1), max(block_size, 1),
        tk.shape[1] if comp == COMP_TOPK else 0,
        H=H, HP=hp, D=D, RD=rd, BLOCK_H=block_h, BLOCK_N=cfg.block_n, COMP=comp, SPLIT=nsplit > 1,
        HAS_RING=ring is not None, HAS_SINK=sink is not None, ROPE=rope, PREC=dot_precision(q.dtype),
        PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if nsplit > 1:
        dc = min(128, D)
        _sparse_attn_merge[(T, H, D // dc + (1 if rope else 0))](
            pacc, prope, pml, sink_t, cos, sin, out, out.stride(0), out.stride(1), nsplit,
            H=H, HP=hp, D=D, RD=rd, NSP2=next_pow2(nsplit), DC=dc, HAS_SINK=sink is not None, ROPE=rope,
            num_warps=4)
    return out
