"""Lightning indexer fused with a streaming top-k, reading indexer keys from the paged cache.

``score(t, w) = scale · Σ_h weights[t, h] · relu(q[t, h] · K[w])`` over the entries ``w < (t+1) // ratio``
visible to the query at position ``t``; the result is the ``topk`` best entries per token, ordered by
score (descending) then entry id (ascending): ties go to the lower id, the same on every run.

The full score matrix is never written. Each program scores one token's entries block by block
(newest first, since recent entries tend to score high and so raise the bar early) and keeps a
candidate buffer in a private scratch row: a score enters only if it beats the current ``topk``-th
best (``theta``). Scores and ids travel packed in one int64 sort key (order-preserving float bits in
the high word, ``2^31-1-id`` in the low word), so one comparison does score-then-id ordering and every
key is unique. When the buffer fills it is sorted and cut back to ``topk``, raising ``theta``. Few
tokens (decode) split their entries over several programs; a second kernel merges the per-split
lists and unpacks ids (``-1`` where fewer than ``topk`` entries are visible).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import as_i32, cdiv, check_last_dim_contiguous, dot_precision, next_pow2, sm_count

_EMPTY = tl.constexpr(-9223372036854775807)  # below every packed key of a finite score


@dataclass(frozen=True)
class IndexerConfig:
    """Launch shape (``num_splits=0``: chosen from the problem size; ``capacity=0``: 4·topk)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 0
    capacity: int = 0


@triton.jit
def _pack(score, ids):
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (2147483647 - ids.to(tl.int64))


@triton.jit
def _compact(buf, count, CAP: tl.constexpr, K: tl.constexpr):
    """Sort the buffer, keep its best K keys at the front; return (new count, new theta)."""
    tl.debug_barrier()  # appends by other threads of this program are visible after the barrier
    offs = tl.arange(0, CAP)
    vals = tl.load(buf + offs, mask=offs < count, other=_EMPTY)
    srt = tl.sort(vals, descending=True)
    tl.store(buf + offs, srt, mask=offs < K)
    theta = tl.max(tl.where(offs == K - 1, srt, _EMPTY))
    tl.debug_barrier()
    return tl.minimum(count, K), theta


@triton.jit
def _indexer_select(q_ptr, w_ptr, keys_ptr, bt_ptr, tok_seq_ptr, pos_ptr, buf_ptr, cand_ptr,
                    stride_qt, stride_qh, stride_wt, stride_kb, stride_ke, stride_bt,
                    scale, ratio, block_size,
                    H: tl.constexpr, DI: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr, BLOCK_N: tl.constexpr,
                    NSPLIT: tl.constexpr, PREC: tl.constexpr):
    tok = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.load(tok_seq_ptr + tok)
    t = tl.load(pos_ptr + tok)
    n_vis = (t + 1) // ratio
    chunk = tl.cdiv(tl.cdiv(n_vis, NSPLIT), BLOCK_N) * BLOCK_N
    e_lo = pid_s * chunk
    e_hi = tl.minimum(e_lo + chunk, n_vis)
    n_blocks = tl.cdiv(tl.maximum(e_hi - e_lo, 0), BLOCK_N)

    offs_h = tl.arange(0, H)
    offs_d = tl.arange(0, DI)
    q = tl.load(q_ptr + tok.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :])
    w = tl.load(w_ptr + tok.to(tl.int64) * stride_wt + offs_h).to(tl.float32)
    row = (tok.to(tl.int64) * NSPLIT + pid_s)
    buf = buf_ptr + row * CAP
    count = 0
    theta = _EMPTY
    for j in range(n_blocks):
        ents = e_hi - (j + 1) * BLOCK_N + tl.arange(0, BLOCK_N)  # newest block first
        ok = ents >= e_lo
        first = ents * ratio
        blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + first // block_size, mask=ok, other=0)
        krow = blk.to(tl.int64) * stride_kb + ((first % block_size) // ratio).to(tl.int64) * stride_ke
        k = tl.load(keys_ptr + krow[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, DI]
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC), 0.0)  # [H, BLOCK_N]
        score = tl.sum(s * w[:, None], 0) * scale
        key = _pack(score, ents)
        keep = ok & (key > theta)
        if count + BLOCK_N > CAP:
            count, theta = _compact(buf, count, CAP, K)
            keep = keep & (key > theta)
        slot = count + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(buf + slot, key, mask=keep)
        count += tl.sum(keep.to(tl.int32), 0)
    count, theta = _compact(buf, count, CAP, K)
    offs_k = tl.arange(0, K)
    best = tl.load(buf + offs_k, mask=offs_k < count, other=_EMPTY)
    tl.store(cand_ptr + row * K + offs_k, best)


@triton.jit
def _indexer_merge(cand_ptr, out_ptr, stride_ot, K: tl.constexpr, NSPLIT: tl.constexpr, NS_P2: tl.constexpr):
    tok = tl.program_id(0)
    offs = tl.arange(0, NS_P2 * K)
    keys = tl.load(cand_ptr + tok.to(tl.int64) * (NSPLIT * K) + offs, mask=offs < NSPLIT * K, other=_EMPTY)
    if NSPLIT > 1:
        keys = tl.sort(keys, descending=True)
    ids = tl.where(keys == _EMPTY, -1, 2147483647 - (keys & 0xFFFFFFFF))
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + offs, ids.to(out_ptr.dtype.element_ty), mask=offs < K)


def _choose_splits(cfg: IndexerConfig, num_tokens: int, max_entries: int, device_sms: int) -> int:
    if cfg.num_splits > 0:
        return cfg.num_splits
    if num_tokens >= 2 * device_sms:
        return 1
    want = cdiv(2 * device_sms, num_tokens)
    splits = max(1, min(want, cdiv(max_entries, 8 * cfg.block_n), 16))
    return 1 << (splits.bit_length() - 1)  # a power of two keeps the merge sort exact-sized


def indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, *, token_seq: torch.Tensor, positions: torch.Tensor,
                       keys: torch.Tensor, block_table: torch.Tensor, ratio: int, block_size: int, topk: int,
                       scale: float, out: Optional[torch.Tensor] = None,
                       config: Optional[IndexerConfig] = None) -> torch.Tensor:
    """Top-``topk`` entry ids per token, ``[T, topk]`` int32, ``-1`` padded.

    q ``[T, H, DI]`` (roped indexer queries), weights ``[T, H]``, keys ``[num_blocks, block_size // ratio,
    DI]`` paged through ``block_table [B, max_blocks]``; token_seq/positions ``[T]``.
    """
    cfg = config or IndexerConfig()
    T, H, DI = q.shape
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("keys", keys)
    if topk & (topk - 1):
        raise ValueError(f"topk={topk}: the streaming selection needs a power of two")
    out = torch.empty(T, topk, dtype=torch.int32, device=q.device) if out is None else out
    if T == 0:
        return out
    bt = block_table
    cap = cfg.capacity or max(4 * topk, next_pow2(topk + cfg.block_n))
    if cap < topk + cfg.block_n or cap & (cap - 1):
        raise ValueError(f"capacity={cap}: needs a power of two >= topk + block_n ({topk + cfg.block_n})")
    max_entries = bt.shape[1] * block_size // ratio
    nsplit = _choose_splits(cfg, T, max_entries, sm_count(q))
    buf = torch.empty(T * nsplit, cap, dtype=torch.int64, device=q.device)  # [T*S, CAP] scratch
    cand = torch.empty(T * nsplit, topk, dtype=torch.int64, device=q.device)  # [T*S, K] packed keys
    _indexer_select[(T, nsplit)](
        q, weights, keys, bt, as_i32(token_seq), as_i32(positions), buf, cand,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1), bt.stride(0),
        scale, ratio, block_size,
        H=H, DI=DI, K=topk, CAP=cap, BLOCK_N=cfg.block_n, NSPLIT=nsplit, PREC=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _indexer_merge[(T,)](cand, out, out.stride(0), K=topk, NSPLIT=nsplit, NS_P2=next_pow2(nsplit),
                         num_warps=4 if nsplit * topk <= 2048 else 8)
    return out
