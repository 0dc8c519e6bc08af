"""Lightning indexer fused with a streaming top-k, reading indexer keys from the paged cache.

``score(t, w) = scale · Σ_h weights[t, h] · relu(q[t, h] · K[w])`` over the entries ``w < (t+1) // ratio``
visible to the query at position ``t``; the result is the ``topk`` best entries per token, ordered by
score (descending) then entry id (ascending): ties go to the lower id, the same on every run.

The full score matrix is never written. A program takes a tile of ``BLOCK_T`` consecutive tokens of one
sequence (they share the keys, so each key block is loaded once for the tile) and scores its entries
block by block, newest first (recent entries tend to score high and so raise the bar early). Each token
keeps a candidate buffer in a private scratch row: a score enters only if it beats that token's current
``topk``-th best (``theta``). Scores and ids travel packed in one int64 key (order-preserving float
bits in the high word, ``2^31-1-id`` in the low word), so one comparison orders by score then id and
every key is unique. When a buffer fills, a bitonic top-k cuts it back to ``topk`` and raises
``theta``. Few tokens (decode) split their entries over several programs; a second kernel merges the
per-split lists and unpacks ids (``-1`` where fewer than ``topk`` entries are visible).

A second, pipelined prefill form (``IndexerXConfig``, candidates of the same tuner): ``_gather_keys`` copies each
sequence's visible entries out of the paged pool into plain rows once per call, then ``_indexer_select_x`` streams
them as V4.1's expanded stream does (``indexer_kernels_mx._stream_x_rows``: plain key tiles that the compiler
software-pipelines, entries on the MMA's M axis so a token's head sum stays in its accumulator rows, the buffer
cut between segments of blocks outside the pipelined loop). Same scores up to the order of the head sum, same
packing, thresholds and final cut.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import (
    ConfigTuner,
    as_i32,
    cdiv,
    check_last_dim_contiguous,
    dot_precision,
    interpreting,
    next_pow2,
    sm_count,
)

log = logging.getLogger(__name__)
_EMPTY = tl.constexpr(-9223372036854775807)  # below every packed key of a finite score


@dataclass(frozen=True)
class IndexerConfig:
    """Launch shape (``num_splits=0``: chosen from the problem size; ``capacity=0``: 2·topk).

    ``block_t`` tokens of one sequence share a program when there are enough tokens (prefill);
    decode-sized steps use one token per program and split its entries instead.
    """
    block_t: int = 2
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 0
    capacity: int = 0
    prefetch: bool = False  # load the next key block's block-table entries one iteration ahead
    heads_on_n: bool = False  # entries on the dot's M axis, heads on N: the head sum stays inside a warp


@dataclass(frozen=True)
class IndexerXConfig:
    """The pipelined prefill form's launch shape (``_gather_keys`` + ``_indexer_select_x``; no entry split)."""
    block_t: int = 2
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    cut: str = ""   # "select": buffer cuts by counting (``indexer_kernels_mx._kth_largest``), not by sorting
    max_regs: int = 0   # registers a thread at most (ptxas ``.maxnreg``; 0: the compiler's choice)
    late_keys: bool = False   # packed keys and masks only in blocks where a score reaches a bar (``_stream_x_rows``)

    def __repr__(self) -> str:   # stored choices name shapes by this text: unset new fields leave it as it was
        text = (f"IndexerXConfig(block_t={self.block_t}, block_n={self.block_n}, num_warps={self.num_warps}, "
                f"num_stages={self.num_stages}")
        text += f", cut={self.cut!r}" if self.cut else ""
        text += f", max_regs={self.max_regs}" if self.max_regs else ""
        return text + (", late_keys=True)" if self.late_keys else ")")


@triton.jit
def _order_bits(score):   # fp32 scores as int32 in the same order: the high word of ``_pack``'s key
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _pack(score, ids):
    return (_order_bits(score).to(tl.int64) << 32) | (2147483647 - ids.to(tl.int64))


@triton.jit
def _compact(buf, count, rows_ok, BLOCK_T: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr):
    """Keep each row's best K keys at the front of its buffer; return (new counts, new thetas)."""
    tl.debug_barrier()  # appends by other threads of this program are visible after the barrier
    offs = tl.arange(0, CAP)
    vals = tl.load(buf + offs[None, :], mask=(offs[None, :] < count[:, None]) & rows_ok[:, None], other=_EMPTY)
    best = tl.topk(vals, K)  # [BLOCK_T, K], descending
    offs_k = tl.arange(0, K)
    tl.store(buf + offs_k[None, :], best, mask=rows_ok[:, None])
    tl.debug_barrier()
    return tl.minimum(count, K), tl.min(best, 1)


@triton.jit
def _append(buf, count, theta, key, keep, rows_ok, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
            CAP: tl.constexpr, K: tl.constexpr):
    """Append each row's kept keys to its buffer (compacting first when a full block might not fit);
    return (new counts, new thetas)."""
    if tl.max(count, 0) + BLOCK_N > CAP:
        count, theta = _compact(buf, count, rows_ok, BLOCK_T, CAP, K)
        keep = keep & (key > theta[:, None])
    slot = count[:, None] + tl.cumsum(keep.to(tl.int32), 1) - 1
    tl.store(buf + slot, key, mask=keep)
    count += tl.sum(keep.to(tl.int32), 1)
    return count, theta


@triton.jit
def _store_best(buf, count, rows_ok, rows, cand_ptr, BLOCK_T: tl.constexpr, CAP: tl.constexpr, K: tl.constexpr):
    """Each row's best K keys (descending, padded with the empty key) to ``cand_ptr[rows]``."""
    count, _theta = _compact(buf, count, rows_ok, BLOCK_T, CAP, K)
    offs_k = tl.arange(0, K)
    best = tl.load(buf + offs_k[None, :], mask=(offs_k[None, :] < count[:, None]) & rows_ok[:, None],
                   other=_EMPTY)
    tl.store(cand_ptr + rows[:, None] * K + offs_k[None, :], best, mask=rows_ok[:, None])


@triton.jit
def _indexer_select(q_ptr, w_ptr, keys_ptr, bt_ptr, pos_ptr, tile_tok_ptr, tile_len_ptr, tile_seq_ptr,
                    buf_ptr, cand_ptr, nsplit,
                    stride_qt, stride_qh, stride_wt, stride_kb, stride_ke, stride_bt,
                    scale, ratio, block_size,
                    H: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr, HEADS_ON_N: tl.constexpr):
    tile = tl.program_id(0)
    pid_s = tl.program_id(1)
    tok0 = tl.load(tile_tok_ptr + tile)
    n_tok = tl.load(tile_len_ptr + tile)
    b = tl.load(tile_seq_ptr + tile)
    offs_t = tl.arange(0, BLOCK_T)
    rows_ok = offs_t < n_tok
    toks = (tok0 + offs_t).to(tl.int64)
    t = tl.load(pos_ptr + toks, mask=rows_ok, other=-1)
    n_vis = (t + 1) // ratio  # [BLOCK_T]
    n_max = tl.max(n_vis, 0)
    chunk = tl.cdiv(tl.cdiv(n_max, nsplit), BLOCK_N) * BLOCK_N
    e_lo = pid_s * chunk
    e_hi = tl.minimum(e_lo + chunk, n_max)
    n_blocks = tl.cdiv(tl.maximum(e_hi - e_lo, 0), BLOCK_N)

    offs_h = tl.arange(0, HP)  # heads padded to a tensor-core shape; padded rows have q = 0, weight 0
    offs_d = tl.arange(0, DI)
    hmask = rows_ok[:, None] & (offs_h < H)[None, :]
    qrow = toks[:, None] * stride_qt + offs_h[None, :] * stride_qh  # [BLOCK_T, HP]
    q = tl.load(q_ptr + qrow[:, :, None] + offs_d[None, None, :], mask=hmask[:, :, None], other=0.0)
    q = tl.reshape(q, [BLOCK_T * HP, DI])
    w = tl.load(w_ptr + toks[:, None] * stride_wt + offs_h[None, :], mask=hmask, other=0.0)
    w = tl.reshape(w.to(tl.float32), [BLOCK_T * HP])
    rows = (toks * nsplit + pid_s)  # scratch / candidate row of each token
    buf = buf_ptr + rows[:, None] * CAP  # [BLOCK_T, 1] row bases
    count = tl.zeros([BLOCK_T], tl.int32)
    theta = tl.full([BLOCK_T], _EMPTY, tl.int64)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    ents_nx = e_hi - BLOCK_N + tl.arange(0, BLOCK_N)
    blk_nx = tl.load(bt_row + (ents_nx * ratio) // block_size, mask=(ents_nx >= e_lo) & (ents_nx * 0 + n_blocks > 0), other=0)
    for j in range(n_blocks):
        ents = e_hi - (j + 1) * BLOCK_N + tl.arange(0, BLOCK_N)  # newest block first
        ok = ents >= e_lo
        first = ents * ratio
        if PREFETCH:  # the block-table lookup of block j+1 overlaps block j's loads and dot
            blk = blk_nx
            ents_nx = ents - BLOCK_N
            blk_nx = tl.load(bt_row + (ents_nx * ratio) // block_size, mask=(ents_nx >= e_lo) & (ents_nx * 0 + j + 1 < n_blocks),
                             other=0)
        else:
            blk = tl.load(bt_row + first // block_size, mask=ok, other=0)
        krow = blk.to(tl.int64) * stride_kb + ((first % block_size) // ratio).to(tl.int64) * stride_ke
        k = tl.load(keys_ptr + krow[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)  # [BLOCK_N, DI]
        if HEADS_ON_N:  # the accumulator row of one entry holds its heads: a quad-local reduction
            st = tl.maximum(tl.dot(k, tl.trans(q), input_precision=PREC), 0.0) * w[None, :]  # [BLOCK_N, BLOCK_T*H]
            score = tl.trans(tl.sum(tl.reshape(st, [BLOCK_N, BLOCK_T, HP]), 2)) * scale
        else:
            s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC), 0.0) * w[:, None]  # [BLOCK_T*H, BLOCK_N]
            score = tl.sum(tl.reshape(s, [BLOCK_T, HP, BLOCK_N]), 1) * scale
        key = _pack(score, ents[None, :])
        vis = ok[None, :] & (ents[None, :] < n_vis[:, None]) & rows_ok[:, None]
        keep = vis & (key > theta[:, None])
        count, theta = _append(buf, count, theta, key, keep, rows_ok, BLOCK_T, BLOCK_N, CAP, K)
    _store_best(buf, count, rows_ok, rows, cand_ptr, BLOCK_T, CAP, K)


@triton.jit
def _sort_bitonic_desc(x, K: tl.constexpr, LOG_K: tl.constexpr):
    """A bitonic sequence ``x`` [K] (K = 2**LOG_K) in descending order: LOG_K half-cleaner stages, each a
    compare-exchange of the elements ``d`` apart (d = K/2, K/4, .., 1), the larger one first."""
    side = tl.arange(0, 2)[None, :, None]
    for i in tl.static_range(LOG_K):   # stage i: 2**i groups of two halves of K >> (i + 1)
        x3 = tl.reshape(x, [1 << i, 2, K >> (i + 1)])
        a = tl.sum(tl.where(side == 0, x3, 0), 1)   # one term is not zero: the sum is that element
        b = tl.sum(tl.where(side == 1, x3, 0), 1)
        x = tl.reshape(tl.where(side == 0, tl.maximum(a, b)[:, None, :], tl.minimum(a, b)[:, None, :]), [K])
    return x


@triton.jit
def _indexer_merge(cand_ptr, buf_ptr, out_ptr, stride_ot, nsplit, K: tl.constexpr, CAP: tl.constexpr,
                   ONE_SPLIT: tl.constexpr, SORT: tl.constexpr, SORTED_SPLITS: tl.constexpr = False,
                   LOG_K: tl.constexpr = 0, PACKED: tl.constexpr = False):
    """Stream the per-split lists of one token through the same thresholded buffer, then unpack ids.
    ``ONE_SPLIT`` (``nsplit == 1``): the token's one list is already its best K, padded with the empty key;
    its ids are unpacked directly (no buffer, no second top-k), in the list's order: descending where the
    stream's last cut sorted it (``_store_best``), any order otherwise, which only a caller that sorts the ids
    afterwards may take (V4.1's ``stream_topk``); ``SORT`` puts the K keys in descending order first (a sort of
    K keys where the buffer pass took a top-K of CAP): the order the buffer pass gives. ``SORTED_SPLITS`` (every
    split's list descending, K = 2**LOG_K): the keys are distinct (the id is in the low bits), so the best K of
    two descending lists are the elementwise maxima of one and the other reversed (a bitonic sequence), put in
    order by a bitonic merge: LOG_K compare-exchange stages per further split, where the buffer takes a top-K of
    CAP keys per split (no buffer). ``PACKED``: the best K keys themselves (descending) go to ``out_ptr``'s row
    (int64), not their ids: one level of a merge tree, whose program ``p`` merges lists ``p·nsplit ..``."""
    tok = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, K)
    if ONE_SPLIT:
        best = tl.load(cand_ptr + tok * K + offs_k)[None, :]   # [1, K]
        if SORT:
            best = tl.sort(best, dim=1, descending=True)
    elif SORTED_SPLITS:
        acc = tl.load(cand_ptr + (tok * nsplit) * K + offs_k)                         # [K], descending
        for s in range(1, nsplit):
            rev = tl.load(cand_ptr + (tok * nsplit + s) * K + (K - 1 - offs_k))       # ascending
            acc = _sort_bitonic_desc(tl.maximum(acc, rev), K, LOG_K)
        best = acc[None, :]
    else:
        buf = buf_ptr + (tok * nsplit) * CAP + tl.zeros([1, 1], tl.int64)  # this token's first scratch row
        one = tl.full([1], True, tl.int1)
        count = tl.zeros([1], tl.int32)
        theta = tl.full([1], _EMPTY, tl.int64)
        for s in range(nsplit):
            key = tl.load(cand_ptr + (tok * nsplit + s) * K + offs_k)[None, :]  # [1, K], descending
            keep = (key > theta[:, None]) & (key != _EMPTY)
            if tl.max(count, 0) + K > CAP:
                count, theta = _compact(buf, count, one, 1, CAP, K)
                keep = keep & (key > theta[:, None])
            slot = count[:, None] + tl.cumsum(keep.to(tl.int32), 1) - 1
            tl.store(buf + slot, key, mask=keep)
            count += tl.sum(keep.to(tl.int32), 1)
        count, theta = _compact(buf, count, one, 1, CAP, K)
        best = tl.load(buf + offs_k[None, :], mask=offs_k[None, :] < count[:, None], other=_EMPTY)
    if PACKED:
        tl.store(out_ptr + tok * stride_ot + offs_k[None, :], best)
    else:
        ids = tl.where(best == _EMPTY, -1, 2147483647 - (best & 0xFFFFFFFF))
        tl.store(out_ptr + tok * stride_ot + offs_k[None, :], ids.to(out_ptr.dtype.element_ty))


@triton.jit
def _gather_keys(keys_ptr, bt_ptr, lim_ptr, out_ptr, ncap, stride_kb, stride_ke, stride_bt, ratio, block_size,
                 DI: tl.constexpr, BLOCK: tl.constexpr):
    """Entries ``0 .. lim[b]`` of sequence ``b`` out of the paged key pool (the rows ``_indexer_select`` reads
    through the block table) into plain rows ``out[b, e]`` ([B, ncap, DI], the pool's dtype; rows past
    ``lim[b]`` are not written and never read)."""
    b = tl.program_id(1)
    ents = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = ents < tl.load(lim_ptr + b)
    first = ents * ratio
    blk = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + first // block_size, mask=ok, other=0)
    krow = blk.to(tl.int64) * stride_kb + ((first % block_size) // ratio).to(tl.int64) * stride_ke
    offs_d = tl.arange(0, DI)
    k = tl.load(keys_ptr + krow[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(out_ptr + (b.to(tl.int64) * ncap + ents)[:, None] * DI + offs_d[None, :], k, mask=ok[:, None])


@triton.jit
def _indexer_select_x(q_ptr, w_ptr, kx_ptr, pos_ptr, tile_tok_ptr, tile_len_ptr, tile_seq_ptr, buf_ptr, cand_ptr,
                      stride_qt, stride_qh, stride_wt, stride_kxb, scale, ratio,
                      H: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, STAGES: tl.constexpr,
                      CUT_SELECT: tl.constexpr, LATE_KEYS: tl.constexpr = False):
    """``_indexer_select``'s selection for one tile of tokens (one sequence, no entry split) over the sequence's
    plain key rows ``kx_ptr + b · stride_kxb`` (``_gather_keys``): V4.1's expanded stream (``_stream_x_rows``:
    entries on the MMA's M axis, (token, head) columns on N, key tiles software-pipelined over ``STAGES`` steps,
    the buffer cut between segments of blocks), the weighted head sum in fp32 times ``scale`` after the sum, as
    here. The sum runs in another order than ``_indexer_select``'s (last-bit differences of fp32 scores, inside
    the op's tolerance; exact wherever every partial sum is, as with integer-valued inputs)."""
    tile = tl.program_id(0)
    tok0 = tl.load(tile_tok_ptr + tile)
    n_tok = tl.load(tile_len_ptr + tile)
    b = tl.load(tile_seq_ptr + tile)
    offs_t = tl.arange(0, BLOCK_T)
    rows_ok = offs_t < n_tok
    t64 = (tok0 + offs_t).to(tl.int64)
    vis = (tl.load(pos_ptr + t64, mask=rows_ok, other=-1) + 1) // ratio   # [BLOCK_T]; 0 for rows past the tile
    n_max = tl.max(vis, 0)
    hs = tl.arange(0, HP)   # heads padded to a tensor-core shape: padded columns have q = 0 and weight 0
    hmask = rows_ok[:, None] & (hs < H)[None, :]
    q = tl.load(q_ptr + t64[:, None, None] * stride_qt + hs[None, :, None] * stride_qh +
                tl.arange(0, DI)[None, None, :], mask=hmask[:, :, None], other=0.0)
    q_t = tl.trans(tl.reshape(q, (BLOCK_T * HP, DI)))   # [DI, BT*HP]
    w = tl.load(w_ptr + t64[:, None] * stride_wt + hs[None, :], mask=hmask, other=0.0).to(tl.float32)
    w = tl.reshape(w, (BLOCK_T * HP,))
    _kx._stream_x_rows(kx_ptr + b.to(tl.int64) * stride_kxb, q_t, w, rows_ok, t64, vis, t64, 0, n_max,
                       tl.cdiv(n_max, BLOCK_N), buf_ptr, cand_ptr, cand_ptr, cand_ptr, 0, 0, 0, 0, scale, HP, DI, K,
                       CAP, BLOCK_T, BLOCK_N, False, False, 1, False, STAGES, False, False, PREC, True, CUT_SELECT,
                       LATE_KEYS)


@triton.jit
def _token_tiles(qsl_ptr, tok_ptr, len_ptr, seq_ptr, nseq, bound, BT: tl.constexpr, SP: tl.constexpr,
                 BLOCK_J: tl.constexpr):
    """Tiles j of one block: ``token_tiles_torch``'s arithmetic (int64) for every sequence at once (SP >= nseq
    lanes: each sequence's tile count, their running sum; the tile's sequence is the count of running sums <= j)."""
    s = tl.arange(0, SP)
    sm = s < nseq
    lo = tl.load(qsl_ptr + s, mask=sm, other=0).to(tl.int64)
    hi = tl.load(qsl_ptr + s + 1, mask=sm, other=0).to(tl.int64)
    per = tl.where(sm, (hi - lo + BT - 1) // BT, 0)
    cum = tl.cumsum(per, 0)
    total = tl.sum(per, 0)
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    jm = j < bound
    j64 = j.to(tl.int64)
    b = tl.sum(((cum[None, :] <= j64[:, None]) & sm[None, :]).to(tl.int64), 1)
    b = tl.minimum(b, nseq - 1)
    before = tl.sum(tl.where(s[None, :] < b[:, None], per[None, :], 0), 1)   # cum[b] - per[b]
    start = tl.load(qsl_ptr + b, mask=jm, other=0).to(tl.int64)
    end = tl.load(qsl_ptr + b + 1, mask=jm, other=0).to(tl.int64)
    tok0 = start + (j64 - before) * BT
    length = tl.maximum(tl.minimum(end - tok0, BT), 0)
    length = tl.where(j64 < total, length, 0)
    tl.store(tok_ptr + j, tok0.to(tl.int32), mask=jm)
    tl.store(len_ptr + j, length.to(tl.int32), mask=jm)
    tl.store(seq_ptr + j, b.to(tl.int32), mask=jm)


def token_tiles(query_start_loc: torch.Tensor, num_tokens: int, block_t: int):
    """Tiles of at most ``block_t`` consecutive tokens of one sequence, computed on the device.

    Returns (first token ``[n]``, tokens in the tile ``[n]``, sequence ``[n]``) int32, ``n`` an upper bound
    (``cdiv(T, block_t) + B``); surplus tiles have 0 tokens. One launch (``_token_tiles``) on the GPU or under the
    interpreter; ``token_tiles_torch`` (about twenty PyTorch launches) elsewhere, and as the tests' oracle.
    """
    if not (query_start_loc.is_cuda or interpreting()) or query_start_loc.numel() < 2:
        return token_tiles_torch(query_start_loc, num_tokens, block_t)
    return token_tiles_launch(query_start_loc, num_tokens, block_t)


def token_tiles_launch(query_start_loc: torch.Tensor, num_tokens: int, block_t: int):
    """``token_tiles`` as the one launch (at least one sequence)."""
    nseq = query_start_loc.numel() - 1
    bound = cdiv(num_tokens, block_t) + nseq
    out = torch.empty(3, bound, dtype=torch.int32, device=query_start_loc.device)
    sp = next_pow2(nseq)
    bj = max(16, min(1024, 8192 // sp))
    _token_tiles[(cdiv(bound, bj),)](query_start_loc, out[0], out[1], out[2], nseq, bound, BT=block_t, SP=sp,
                                     BLOCK_J=bj, num_warps=4)
    return out[0], out[1], out[2], bound


def token_tiles_torch(query_start_loc: torch.Tensor, num_tokens: int, block_t: int):
    """``token_tiles`` in PyTorch ops."""
    qsl = query_start_loc.to(torch.int64)
    nseq = qsl.numel() - 1
    n = qsl[1:] - qsl[:-1]
    per = (n + block_t - 1) // block_t
    cum = torch.cumsum(per, 0)
    bound = cdiv(num_tokens, block_t) + nseq
    j = torch.arange(bound, device=qsl.device)
    b = torch.searchsorted(cum, j, right=True).clamp(max=nseq - 1)
    tok0 = qsl[b] + (j - (cum[b] - per[b])) * block_t
    length = torch.clamp(torch.minimum(qsl[b + 1] - tok0, torch.full_like(tok0, block_t)), min=0)
    length = torch.where(j < cum[-1], length, torch.zeros_like(length))
    return tok0.to(torch.int32), length.to(torch.int32), b.to(torch.int32), bound


def _choose_splits(cfg: IndexerConfig, num_tokens: int, max_entries: int, device_sms: int) -> int:
    if cfg.num_splits > 0:
        return cfg.num_splits
    if num_tokens >= 2 * device_sms:
        return 1
    want = cdiv(2 * device_sms, num_tokens)
    return max(1, min(want, cdiv(max_entries, 8 * cfg.block_n), 32))


INDEXER_TUNER = ConfigTuner("indexer_topk.2", [
    IndexerConfig(block_t=2, block_n=64, num_warps=4, num_stages=2, heads_on_n=True),
    IndexerConfig(block_t=2, block_n=64, num_warps=4, num_stages=2),
    IndexerConfig(block_t=2, block_n=128, num_warps=8, num_stages=2),
    IndexerXConfig(2, 64, 4, 3), IndexerXConfig(4, 64, 8, 3), IndexerXConfig(2, 128, 8, 3),
    IndexerXConfig(2, 64, 4, 3, cut="select"), IndexerXConfig(2, 64, 4, 2, cut="select", max_regs=168),
])
# Measured on the H200 (ms; prefill chunk of 8192 queries at 8K / decode b2 at 8K): heads on N 2.44 / 0.57;
# heads on M 2.87 / 0.39; heads on M, 128-entry blocks 3.13 / 0.36. Dropped: 4 tokens a tile, heads on N 2.55;
# 4 stages 2.88; ``prefetch`` 2.87. ``IndexerXConfig``: prefill classes only, after a first-use check; V4.1's stream
# (H100): select 22.1 -> 17.6 ms, max_regs 15.4 -> 12.9. V4 on the H100 (32768-query chunks; classes of 8K / 16K /
# 32K entries): select 12.6 / 28.5 / 41.9 ms, max_regs 10.2 / 23.3 / 34.4; dropped: ``late_keys`` 3-4 % slower.
TUNE_ENTRIES = 1 << 16   # prefill classes: the longest stream's entries as a power of two, counts above merged


def prefill_entry_class(max_entries: int | None) -> int:
    """The stream-length part of a prefill tuning class (0: not known on the host, one class for every length)."""
    return 0 if max_entries is None else min(next_pow2(max(int(max_entries), 1)), TUNE_ENTRIES)


def indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, *, positions: torch.Tensor,
                       query_start_loc: torch.Tensor, keys: torch.Tensor, block_table: torch.Tensor, ratio: int,
                       block_size: int, topk: int, scale: float, out: torch.Tensor | None = None,
                       config: IndexerConfig | IndexerXConfig | None = None,
                       max_entries: int | None = None) -> torch.Tensor:
    """Top-``topk`` entry ids per token, ``[T, topk]`` (int32 unless ``out`` says otherwise), ``-1`` padded.

    q ``[T, H, DI]`` (roped indexer queries), weights ``[T, H]``, keys ``[num_blocks, block_size // ratio,
    DI]`` paged through ``block_table [B, max_blocks]``; positions ``[T]``; ``query_start_loc [B+1]``.
    ``config=None`` picks the launch shape by measurement per problem class; ``max_entries`` (the most entries a
    token sees, from the host's context lengths) splits prefill classes by stream length (``prefill_entry_class``).
    """
    T, H, DI = q.shape
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("keys", keys)
    if topk & (topk - 1):
        raise ValueError(f"topk={topk}: the streaming selection needs a power of two")
    out = torch.empty(T, topk, dtype=torch.int32, device=q.device) if out is None else out
    if T == 0:
        return out
    args = {"q": q, "weights": weights, "positions": as_i32(positions), "query_start_loc": query_start_loc,
            "keys": keys, "block_table": block_table, "ratio": ratio, "block_size": block_size, "topk": topk,
            "scale": scale, "out": out}
    if config is None:
        key = ("decode", H, DI, topk, str(q.dtype)) if T < 2 * sm_count(q) else \
            ("prefill", H, DI, topk, str(q.dtype)) + ((prefill_entry_class(max_entries),) if max_entries else ())
        config = INDEXER_TUNER.pick(key, lambda cfg: _run(cfg, args), q.device)
    return _run(config, args)


def _run(cfg, args: dict) -> torch.Tensor:
    """``cfg``'s kernel: ``IndexerConfig`` the paged ``_indexer_select``, ``IndexerXConfig`` the pipelined prefill
    form (prefill-sized steps, after its first-use check on a GPU)."""
    if isinstance(cfg, IndexerXConfig):
        q = args["q"]
        if q.shape[0] < 2 * sm_count(q):
            raise ValueError(f"indexer_topk_paged: {cfg} is a prefill form ({q.shape[0]} tokens)")
        if q.is_cuda and not first_use_ok(cfg, q.device, q.dtype):
            raise RuntimeError(f"indexer_topk_paged: {cfg} failed its first-use check against the oracle")
        return _launch_x(cfg, **args)
    return _launch(cfg, **args)


def _launch(cfg: IndexerConfig, *, q, weights, positions, query_start_loc, keys, block_table, ratio, block_size,
            topk, scale, out) -> torch.Tensor:
    T, H, DI = q.shape
    cap = cfg.capacity or max(2 * topk, next_pow2(topk + cfg.block_n))
    if cap < topk + cfg.block_n or cap & (cap - 1):
        raise ValueError(f"capacity={cap}: needs a power of two >= topk + block_n ({topk + cfg.block_n})")
    nsplit = _choose_splits(cfg, T, block_table.shape[1] * block_size // ratio, sm_count(q))
    block_t = 1 if nsplit > 1 else cfg.block_t
    tile_tok, tile_len, tile_seq, n_tiles = token_tiles(query_start_loc, T, block_t)
    buf = torch.empty(T * nsplit, cap, dtype=torch.int64, device=q.device)  # [T*S, CAP] scratch
    cand = torch.empty(T * nsplit, topk, dtype=torch.int64, device=q.device)  # [T*S, K] packed keys
    _indexer_select[(n_tiles, nsplit)](
        q, weights, keys, block_table, positions, tile_tok, tile_len, tile_seq, buf, cand, nsplit,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1), block_table.stride(0),
        scale, ratio, block_size,
        H=H, HP=max(next_pow2(H), cdiv(16, block_t)), DI=DI, K=topk, CAP=cap, BLOCK_T=block_t, BLOCK_N=cfg.block_n, PREC=dot_precision(q.dtype),
        PREFETCH=cfg.prefetch, HEADS_ON_N=cfg.heads_on_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return merge_sorted_splits(cand, buf, out, nsplit, topk, cap)


MERGE_FAN_IN = 4   # lists a first-level program merges, where a token's splits are many (``merge_sorted_splits``)


def merge_sorted_splits(cand: torch.Tensor, buf: torch.Tensor, out: torch.Tensor, nsplit: int, topk: int,
                        cap: int) -> torch.Tensor:
    """Ids of each token's best ``topk`` over its ``nsplit`` descending lists (``cand`` [T·nsplit, topk]) into ``out``.
    Many splits (32 at 128K): a first launch merges groups of ``MERGE_FAN_IN`` lists in parallel, the second the
    groups' lists (3 + 7 bitonic merges in series, not 31); each merge keeps the best of distinct keys: same result."""
    T = out.shape[0]
    log_k = topk.bit_length() - 1
    g = MERGE_FAN_IN
    if nsplit >= 2 * g and nsplit % g == 0:
        part = torch.empty(T * (nsplit // g), topk, dtype=torch.int64, device=cand.device)
        _indexer_merge[(T * (nsplit // g),)](cand, buf, part, part.stride(0), g, K=topk, CAP=cap, ONE_SPLIT=False,
                                             SORT=False, SORTED_SPLITS=True, LOG_K=log_k, PACKED=True,
                                             num_warps=4)
        cand, nsplit = part, nsplit // g
    # every list is descending (``_store_best``, or the first level's merges): the bitonic merge
    _indexer_merge[(T,)](cand, buf, out, out.stride(0), nsplit, K=topk, CAP=cap, ONE_SPLIT=nsplit == 1,
                         SORT=False, SORTED_SPLITS=True, LOG_K=log_k, num_warps=4)
    return out


GATHER_BLOCK = 64   # entries per program of the key gather


def seq_entries(query_start_loc: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Per sequence, the most entries any of its tokens sees (``max (t+1)//ratio``), int32 ``[B]``, on the device."""
    qsl = query_start_loc.to(torch.int64)
    nseq, t = qsl.numel() - 1, positions.numel()
    seq = torch.repeat_interleave(torch.arange(nseq, device=qsl.device), qsl[1:] - qsl[:-1], output_size=t)
    n_vis = (positions.to(torch.int64) + 1) // ratio
    lim = torch.zeros(nseq, dtype=torch.int64, device=qsl.device).scatter_reduce_(0, seq, n_vis, "amax")
    return lim.to(torch.int32)


def gather_keys(keys: torch.Tensor, block_table: torch.Tensor, lim: torch.Tensor, ratio: int,
                block_size: int) -> torch.Tensor:
    """Sequence ``b``'s first ``lim[b]`` entries of the paged pool as plain rows ``[B, ncap, DI]`` (the pool's
    dtype; ``ncap`` the entries the block table can address; rows past ``lim[b]`` left unwritten)."""
    nseq, DI = block_table.shape[0], keys.shape[-1]
    ncap = block_table.shape[1] * (block_size // ratio)
    out = torch.empty(nseq, ncap, DI, dtype=keys.dtype, device=keys.device)
    if nseq and ncap:
        _gather_keys[(cdiv(ncap, GATHER_BLOCK), nseq)](
            keys, block_table, lim, out, ncap, keys.stride(0), keys.stride(1), block_table.stride(0), ratio,
            block_size, DI=DI, BLOCK=GATHER_BLOCK, num_warps=4)
    return out


def _launch_x(cfg: IndexerXConfig, *, q, weights, positions, query_start_loc, keys, block_table, ratio, block_size,
              topk, scale, out) -> torch.Tensor:
    """The pipelined prefill form: the sequences' keys gathered into plain rows, then one program per tile of
    ``block_t`` tokens streams them (``_indexer_select_x``), then the merge kernel unpacks the ids."""
    T, H, DI = q.shape
    if block_size % ratio:
        raise ValueError(f"block_size={block_size}: the pool's pages hold whole entries of ratio {ratio}")
    cap = max(4 * topk, next_pow2(topk + 4 * cfg.block_n))   # room for segments of blocks between buffer cuts
    ncap = block_table.shape[1] * (block_size // ratio)
    lim = seq_entries(query_start_loc, positions, ratio).clamp_(max=ncap)   # no row past the table's reach
    kx = gather_keys(keys, block_table, lim, ratio, block_size)
    tile_tok, tile_len, tile_seq, n_tiles = token_tiles(query_start_loc, T, cfg.block_t)
    buf = torch.empty(T, cap, dtype=torch.int64, device=q.device)
    cand = torch.empty(T, topk, dtype=torch.int64, device=q.device)
    _indexer_select_x[(n_tiles,)](
        q, weights, kx, positions, tile_tok, tile_len, tile_seq, buf, cand,
        q.stride(0), q.stride(1), weights.stride(0), kx.stride(0), scale, ratio,
        H=H, HP=max(next_pow2(H), cdiv(16, cfg.block_t)), DI=DI, K=topk, CAP=cap, BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n, PREC=dot_precision(q.dtype), STAGES=cfg.num_stages, CUT_SELECT=cfg.cut == "select",
        LATE_KEYS=cfg.late_keys, num_warps=cfg.num_warps, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}))
    # SORT: the merge sorts every row's K keys into descending order (the stream's last cut may leave them unsorted)
    _indexer_merge[(T,)](cand, buf, out, out.stride(0), 1, K=topk, CAP=cap, ONE_SPLIT=True, SORT=True, num_warps=4)
    return out


_FIRST_USE: dict[tuple[IndexerXConfig, str, str], bool] = {}


def first_use_ok(cfg: IndexerXConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``cfg``'s pipelined form selects a valid top-512 of the float64 scores (the indexer's rule, see
    ``checks.indexer``) on fresh random inputs at V4 width (64 heads x 128; a sequence of 48 queries whose
    entries outnumber the buffer several times over, so rows are cut between segments, and one of 16 queries
    seeing fewer entries than the top-k); checked once per device and dtype, a build error counts as a
    mismatch. The tuner's pipelined candidates run only where this holds."""
    key = (cfg, str(device), str(dtype))
    if key not in _FIRST_USE and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False  # no check inside a CUDA-graph capture: run the shape once before capturing it
    if key not in _FIRST_USE:
        try:
            from redknot.kernels.triton.checks.indexer import (
                RTOL_RANDOM,
                check_inputs,
                topk_violations,
            )
            args, scores = check_inputs(device, dtype, seed=int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
            got = _launch_x(cfg, **args)
            bad = topk_violations(got, scores, args["positions"], args["ratio"], args["topk"], rtol=RTOL_RANDOM)
            if bad:
                log.warning("indexer_topk_paged: %s failed its first-use check: %s", cfg, "; ".join(bad[:2]))
            _FIRST_USE[key] = not bad
        except Exception as exc:  # noqa: BLE001 - a launch shape the compiler refuses on this device
            log.warning("indexer_topk_paged: %s failed to run its first-use check (%s: %s)", cfg,
                        type(exc).__name__, str(exc).splitlines()[0][:160] if str(exc) else "")
            _FIRST_USE[key] = False
    return _FIRST_USE[key]


from redknot.kernels.triton import indexer_kernels_mx as _kx
