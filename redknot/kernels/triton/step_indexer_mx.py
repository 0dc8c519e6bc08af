"""Indexer scores and top-k over paged FP4 index keys for the tensor-only step (CUDA-graph safe).

The span kernels of :mod:`indexer_mx` take one sequence's keys as a contiguous list the host gathered.
Here each query row reads its own request's pages on the device: entry ``e`` of a row lives in page row
``table[row, (e·r) // block_size] · per + ((e·r) mod block_size) // r`` of the source's key cache
(68-byte rows: packed e2m1 + E8M0 per 32). A program scores ``BLOCK_N`` entries of one row,
``I[t, e] = Σ_h w[t, h] · relu(q[t, h] · k[e])`` (fp32, or with the reference's bf16 roundings), and
writes -inf for entries the row cannot see (``e >= visible[t]``); a block wholly past ``visible`` loads
nothing. Every row scores the ``n_max`` entries its block table can address, so the launch shape
depends only on the row count and the table width. The selection is a top-k on the device: valid ids
ascending, then -1, exact ties to the lower entry id (the model's rule; ``indexer_topk_mx`` leaves them open).
``select_topk`` and ``candidate_entries`` state it in PyTorch; the tensor step runs the same selections
through the radix-select launches of :mod:`step_select`, checked against these on first use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2
from redknot.kernels.triton.indexer_kernels_mx import _index_keys


@triton.jit
def _step_index_scores(q_ptr, w_ptr, key_ptr, tab_ptr, vis_ptr, cand_ptr, out_ptr, NMAX, NCOLS, PER, RATIO, BS, HI,
                       stride_qt, stride_qh, stride_wt, stride_k, stride_tt, stride_ct, stride_ot, wscale,
                       HI_P: tl.constexpr, DI: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                       CAND: tl.constexpr):
    """Columns are entries 0..NMAX-1, or (CAND) the row's listed entries cand[t, :NCOLS] (-1: none)."""
    t = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    vis = tl.load(vis_ptr + t).to(tl.int64)
    if CAND:
        ent = tl.load(cand_ptr + t * stride_ct + cols, mask=cols < NCOLS, other=-1).to(tl.int64)
        ok = (ent >= 0) & (ent < NMAX) & (ent < vis)
        live = c0 < NCOLS
    else:
        ent = cols.to(tl.int64)
        ok = (ent < NMAX) & (ent < vis)
        live = c0 < vis
    p = tl.where(ok, ent, 0) * RATIO
    blk = tl.load(tab_ptr + t * stride_tt + p // BS, mask=ok, other=0).to(tl.int64)
    row = blk * PER + (p % BS) // RATIO
    hs = tl.arange(0, HI_P)
    hmask = hs < HI
    s = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if live:
        keys = _index_keys(key_ptr, tl.where(ok, row, 0), ok, stride_k, DI, BLOCK_N)        # [BN, DI]
        q = tl.load(q_ptr + t * stride_qt + hs[:, None] * stride_qh + tl.arange(0, DI)[None, :],
                    mask=hmask[:, None], other=0.0).to(tl.bfloat16)
        d = tl.dot(q, tl.trans(keys))                                                     # [HI_P, BN] fp32
        w = tl.load(w_ptr + t * stride_wt + hs, mask=hmask, other=0.0).to(tl.float32) * wscale
        if BF16:
            d = d.to(tl.bfloat16).to(tl.float32)
            w = w.to(tl.bfloat16).to(tl.float32)
            sc = tl.sum((tl.maximum(d, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32), 0)
            sc = sc.to(tl.bfloat16).to(tl.float32)
        else:
            sc = tl.sum(tl.maximum(d, 0.0) * w[:, None], 0)
        s = tl.where(ok, sc, float("-inf"))
    tl.store(out_ptr + t * stride_ot + cols, s, mask=cols < NCOLS)


@triton.jit
def _score_block(q, w, key_ptr, tab_ptr, cand_ptr, out_ptr, t, c0, vis, NMAX, NCOLS, PER, RATIO, BS, stride_k,
                 stride_tt, stride_ct, stride_ot, DI: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                 CAND: tl.constexpr, PAGE: tl.constexpr = False):
    """Entries [c0, c0 + BLOCK_N) of row t, scored and stored: ``_step_index_scores``' per-block code for a block
    that holds a visible entry (the same loads, product and roundings), q [HI_P, DI] bf16 and w [HI_P] fp32
    (scaled) loaded by the caller once per row. PAGE (no candidate list, BLOCK_N a divisor of a page's ``PER``
    entries): the block lies in one page, so one table entry and ``BLOCK_N`` consecutive key rows (the same rows)."""
    cols = c0 + tl.arange(0, BLOCK_N)
    if CAND:
        ent = tl.load(cand_ptr + t * stride_ct + cols, mask=cols < NCOLS, other=-1).to(tl.int64)
        ok = (ent >= 0) & (ent < NMAX) & (ent < vis)
    else:
        ent = cols.to(tl.int64)
        ok = (ent < NMAX) & (ent < vis)
    if PAGE:
        blk0 = tl.load(tab_ptr + t * stride_tt + (c0 * RATIO) // BS).to(tl.int64)
        row = blk0 * PER + (c0 % PER) + tl.arange(0, BLOCK_N)
    else:
        p = tl.where(ok, ent, 0) * RATIO
        blk = tl.load(tab_ptr + t * stride_tt + p // BS, mask=ok, other=0).to(tl.int64)
        row = blk * PER + (p % BS) // RATIO
    keys = _index_keys(key_ptr, tl.where(ok, row, 0), ok, stride_k, DI, BLOCK_N)        # [BN, DI]
    d = tl.dot(q, tl.trans(keys))                                                     # [HI_P, BN] fp32
    if BF16:
        d = d.to(tl.bfloat16).to(tl.float32)
        sc = tl.sum((tl.maximum(d, 0.0) * w[:, None]).to(tl.bfloat16).to(tl.float32), 0)
        sc = sc.to(tl.bfloat16).to(tl.float32)
    else:
        sc = tl.sum(tl.maximum(d, 0.0) * w[:, None], 0)
    tl.store(out_ptr + t * stride_ot + cols, tl.where(ok, sc, float("-inf")), mask=cols < NCOLS)


@triton.jit
def _step_index_scores_loop(q_ptr, w_ptr, key_ptr, tab_ptr, vis_ptr, cand_ptr, out_ptr, NMAX, NCOLS, PER, RATIO, BS,
                            HI, stride_qt, stride_qh, stride_wt, stride_k: tl.constexpr, stride_tt, stride_ct, stride_ot,
                            wscale, HI_P: tl.constexpr, DI: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                            CAND: tl.constexpr, PAGE: tl.constexpr = False):
    """``_step_index_scores`` with the column blocks of a row strided over ``num_programs(1)`` programs: a program
    loads its row's query and weights once and walks its blocks that hold a visible entry (a loop the compiler may
    pipeline: the next block's table and key loads during this block's decode and product), then writes -inf over
    its blocks past them. Each entry's score has the bits of the one-block kernel (the same per-block code).
    ``stride_k`` is a compile-time constant (68 bytes for V4.1's keys): the compiler then knows each key row starts on
    a 4-byte boundary and loads words, not bytes (a runtime stride that 16 does not divide tells it nothing)."""
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1)
    step = tl.num_programs(1)
    vis = tl.load(vis_ptr + t).to(tl.int64)
    hs = tl.arange(0, HI_P)
    hmask = hs < HI
    q = tl.load(q_ptr + t * stride_qt + hs[:, None] * stride_qh + tl.arange(0, DI)[None, :],
                mask=hmask[:, None], other=0.0).to(tl.bfloat16)
    w = tl.load(w_ptr + t * stride_wt + hs, mask=hmask, other=0.0).to(tl.float32) * wscale
    if BF16:
        w = w.to(tl.bfloat16).to(tl.float32)
    nblocks = tl.cdiv(NCOLS, BLOCK_N)
    if CAND:
        live = nblocks
    else:
        live = tl.minimum(tl.cdiv(tl.minimum(vis, NCOLS), BLOCK_N), nblocks)   # blocks holding a visible entry
    for i in range(tl.cdiv(tl.maximum(live - first, 0), step)):   # this program's blocks first, first + step, ...
        _score_block(q, w, key_ptr, tab_ptr, cand_ptr, out_ptr, t, (first + i * step) * BLOCK_N, vis, NMAX, NCOLS,
                     PER, RATIO, BS, stride_k, stride_tt, stride_ct, stride_ot, DI, BLOCK_N, BF16, CAND, PAGE)
    dead0 = first + tl.cdiv(tl.maximum(live - first, 0), step) * step   # this program's first block past them
    for b in range(dead0, nblocks, step):
        cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t * stride_ot + cols, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=cols < NCOLS)


@dataclass(frozen=True)
class StepIndexConfig:
    block_n: int = 64   # entries per program
    num_warps: int = 4
    loop: int = 1       # > 1: ``_step_index_scores_loop`` with ~``loop`` column blocks per program
    # ``_step_index_scores_loop`` at any ``loop`` (1: one block a program, the one-block kernel's grid, its word loads);
    # with no candidate list a block's key rows read as one page's consecutive rows (one table entry a block) where
    # ``block_n`` divides a page's entries, else the per-entry table lookup
    page: bool = False


STEP_INDEX_TUNER = ConfigTuner("step_index_scores", [
    StepIndexConfig(64, 4), StepIndexConfig(128, 4), StepIndexConfig(128, 8), StepIndexConfig(256, 8),
    StepIndexConfig(32, 4),
    # decode batches (H100 run 3: 0.110 / 0.413 ms a b32 / b128 step for ~12 / 48 us of key bytes; one program per
    # 128 entries, 4096 / 16384 programs, each loading its row's query and weights again): a row's blocks strided over
    # fewer programs (``loop``), the query loaded once per program, the key rows' 68-byte stride a compile-time
    # constant. sm_90a (32 heads x 128): the one-block kernel (runtime stride) loads the keys byte by byte, 198-254
    # registers; the strided kernel loads words and pipelines the key loads (async copies): 96-168 registers, no
    # spills; ``page``: one table entry a block, 128 registers at 64-entry blocks. Not measured on the H200.
    StepIndexConfig(128, 4, 2), StepIndexConfig(128, 4, 4), StepIndexConfig(128, 8, 4), StepIndexConfig(64, 4, 8),
    StepIndexConfig(32, 4, 8), StepIndexConfig(128, 4, 2, True), StepIndexConfig(128, 4, 4, True),
    StepIndexConfig(64, 4, 8, True), StepIndexConfig(128, 4, 1, True), StepIndexConfig(64, 4, 1, True),
])


def step_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                      visible: torch.Tensor, ratio: int, block_size: int, bf16_scores: bool = False,
                      entries: Optional[torch.Tensor] = None, config: Optional[StepIndexConfig] = None,
                      weights_scale: float = 1.0) -> torch.Tensor:
    """Scores [T, n_max] fp32 (-inf where invisible) of rows q [T, Hi, Di] (rotated, FP4-QDQ'd) with
    weights [T, Hi] (scale folded in) over their pages: keys uint8 [pages·per, Di/2 + Di/32] (the source's
    flat key cache, ``per = block_size // ratio`` entries a page), table [T, W] each row's block ids,
    visible [T]. n_max = W·block_size // ratio (see :func:`step_index_scores_reference`).
    ``entries`` [T, C] (-1: none): score only those entry ids of each row -> [T, C] (candidate lists).
    ``config=None``: the launch shape is measured once per problem class on a GPU (outside capture).
    ``weights_scale``: the weights are ``fp32(weights) · weights_scale`` (fp32 product, as PyTorch's
    ``weights.float() * scale``): a 16-bit weights GEMV output without the two launches of that cast and product."""
    T, HI, DI = q.shape
    n_max = table.shape[1] * block_size // ratio
    ncols = n_max if entries is None else entries.shape[1]
    out = torch.empty(T, ncols, dtype=torch.float32, device=q.device)
    if T == 0 or ncols == 0:
        return out
    q = q.contiguous()
    weights = weights.contiguous()
    cand = visible if entries is None else entries.contiguous()
    if config is None:
        key = (min(next_pow2(T), 4096), HI, DI, next_pow2(ncols), bf16_scores, entries is not None)
        config = STEP_INDEX_TUNER.pick(key, lambda c: step_index_scores(
            q, weights, keys, table, visible, ratio, block_size, bf16_scores, entries, c, weights_scale), q.device)
    block_n = max(16, min(config.block_n, next_pow2(ncols)))
    if config.loop > 1 or config.page:
        _step_index_scores_loop[(T, cdiv(ncols, block_n * config.loop))](
            q, weights, keys, table, visible, cand, out, n_max, ncols, block_size // ratio, ratio, block_size, HI,
            q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), table.stride(0),
            cand.stride(0) if entries is not None else 0, out.stride(0), float(weights_scale),
            HI_P=max(16, next_pow2(HI)), DI=DI, BLOCK_N=block_n, BF16=bf16_scores, CAND=entries is not None,
            PAGE=config.page and entries is None and block_size % ratio == 0 and (block_size // ratio) % block_n == 0,
            num_warps=config.num_warps)
        return out
    _step_index_scores[(T, cdiv(ncols, block_n))](
        q, weights, keys, table, visible, cand, out, n_max, ncols, block_size // ratio, ratio, block_size, HI,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), table.stride(0),
        cand.stride(0) if entries is not None else 0, out.stride(0), float(weights_scale),
        HI_P=max(16, next_pow2(HI)), DI=DI, BLOCK_N=block_n, BF16=bf16_scores, CAND=entries is not None,
        num_warps=config.num_warps)
    return out


def candidate_entries(scores: torch.Tensor, visible: torch.Tensor, num_blocks: int, block: int
                      ) -> torch.Tensor:
    """The candidate source's blocks as entry lists (§3.5(d)): block score = max of its ``block``
    entries, the newest visible entry's block pinned, the best ``num_blocks`` blocks with a finite score
    (ties to the lower block) -> int64 [T, num_blocks·block] entry ids ascending, -1 for none."""
    t, n = scores.shape
    nblk = -(-n // block)
    pad = torch.nn.functional.pad(scores, (0, nblk * block - n), value=float("-inf"))
    bscore = pad.view(t, nblk, block).amax(-1)
    blk = torch.arange(nblk, device=scores.device)
    pinned = (visible[:, None] > 0) & (blk[None, :] == ((visible - 1).clamp(min=0) // block)[:, None])
    ids = select_topk(bscore.masked_fill(pinned, float("inf")), num_blocks)           # [T, NB] ascending
    ent = ids[:, :, None] * block + torch.arange(block, device=scores.device)
    return torch.where(ids[:, :, None] >= 0, ent, torch.full_like(ent, -1)).flatten(1)


@triton.jit
def _page_rows(sel_ptr, tab_ptr, out_ptr, K, W, RATIO, BS, PER, stride_st, stride_tt, stride_ot,
               BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < K
    e = tl.load(sel_ptr + t * stride_st + cols, mask=m, other=-1).to(tl.int64)
    p = tl.maximum(e, 0) * RATIO
    blk = tl.load(tab_ptr + t * stride_tt + tl.minimum(p // BS, W - 1), mask=m, other=0).to(tl.int64)
    tl.store(out_ptr + t * stride_ot + cols, tl.where(e >= 0, blk * PER + (p % BS) // RATIO, -1), mask=m)


def page_rows(sel: torch.Tensor, table: torch.Tensor, ratio: int, block_size: int, per: int) -> torch.Tensor:
    """Flat cache rows of selected entries ``sel`` [T, K] (-1: none) of each row's block table [T, W]:
    ``table[t, (e·r) // block_size] · per + ((e·r) mod block_size) // r``, -1 kept (one launch; the
    step's ``_Rows.page`` math with the column clamped to the table)."""
    t, k = sel.shape
    out = torch.empty(t, k, dtype=torch.long, device=sel.device)
    if t == 0 or k == 0:
        return out
    if sel.stride(1) != 1:
        sel = sel.contiguous()
    if table.stride(1) != 1:
        table = table.contiguous()
    block = min(1024, max(16, next_pow2(k)))
    _page_rows[(t, cdiv(k, block))](sel, table, out, k, table.shape[1], ratio, block_size, per,
                                    sel.stride(0), table.stride(0), out.stride(0), BLOCK=block)
    return out


def page_rows_reference(sel: torch.Tensor, table: torch.Tensor, ratio: int, block_size: int,
                        per: int) -> torch.Tensor:
    """:func:`page_rows` in PyTorch."""
    p = sel.long().clamp(min=0) * ratio
    col = (p // block_size).clamp(max=table.shape[1] - 1)
    row = table.long().gather(1, col) * per + (p % block_size) // ratio
    return torch.where(sel >= 0, row, torch.full_like(row, -1))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, n] fp32 scores (-inf: not selectable) -> int64 [T, topk]: the ``topk`` best entry ids
    ascending, then -1. Exact ties go to the lower entry id (the model's ``topk_ids`` rule), so the
    choice does not depend on ``n`` or on the device's top-k: each score becomes an order-preserving
    integer key with the complemented entry id below it, and the top-k runs on those unique keys."""
    t, n = scores.shape
    k = min(topk, n)
    out = torch.full((t, topk), -1, dtype=torch.long, device=scores.device)
    if k == 0:
        return out
    bits = (scores.float() + 0.0).view(torch.int32).long()          # + 0.0: -0 and +0 are one key
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)              # float order as integer order
    ent = torch.arange(n, device=scores.device)
    ids = torch.topk(key * (1 << 32) + ((1 << 32) - 1 - ent), k, dim=-1).indices
    big = torch.iinfo(torch.long).max
    ids = torch.where(scores.gather(1, ids) > float("-inf"), ids, torch.full_like(ids, big))
    ids = torch.sort(ids, dim=-1).values
    out[:, :k] = torch.where(ids == big, torch.full_like(ids, -1), ids)
    return out


def step_index_scores_reference(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                                table: torch.Tensor, visible: torch.Tensor, ratio: int, block_size: int,
                                bf16_scores: bool = False, entries: Optional[torch.Tensor] = None
                                ) -> torch.Tensor:
    """The same scores in plain PyTorch (exact decoding; fp32, or rounded as the reference's bf16 einsum)."""
    if entries is not None:
        full = step_index_scores_reference(q, weights, keys, table, visible, ratio, block_size, bf16_scores)
        n = full.shape[1]
        got = full.gather(1, entries.clamp(min=0, max=n - 1))
        return got.masked_fill((entries < 0) | (entries >= n), float("-inf"))
    t = q.shape[0]
    n_max = table.shape[1] * block_size // ratio
    ent = torch.arange(n_max, device=q.device)
    p = ent * ratio
    rows = table.long()[:, p // block_size] * (block_size // ratio) + (p % block_size) // ratio   # [T, n_max]
    k = mx.unpack_index_keys(keys[rows.reshape(-1)], torch.float32).view(t, n_max, -1)
    d = torch.einsum("thd,tnd->tnh", q.float(), k)
    if bf16_scores:
        d = d.to(torch.bfloat16).float()
        w = weights.to(torch.bfloat16).float()
        sc = (torch.relu(d) * w[:, None, :]).to(torch.bfloat16).float().sum(-1).to(torch.bfloat16).float()
    else:
        sc = (torch.relu(d) * weights.float()[:, None, :]).sum(-1)
    return sc.masked_fill(ent[None, :] >= visible.long()[:, None], float("-inf"))
