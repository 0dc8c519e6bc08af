"""Exact top-k selection by radix select, graph safe (fixed grids, no host read), ids ascending.

The indexer keeps, per row, the ``k`` best entries of a score row (``-inf``: not selectable), exact ties
to the lower entry id, and hands them on as ids ascending then -1 (:func:`step_indexer_mx.select_topk`
is the PyTorch statement of that rule). A sort is more than that needs: the kept set is fixed by one
threshold. Each score becomes an order-preserving int32 key (``+0``/``-0`` one key); four passes of
8-bit digits, most significant first, histogram the keys that match the prefix found so far and pick
the digit where the count from the top reaches the ``k`` still wanted. After them the threshold key
``thr`` and the number ``need`` of entries equal to it that are kept are known; one more pass in entry
order keeps ``key > thr`` and the first ``need`` entries with ``key == thr`` and writes their ids by an
exclusive prefix count, so the output is ascending for free. A row with at most ``k`` selectable
entries keeps them all, and once every key of the threshold's bin is wanted the lower digits do not
matter: the remaining digit passes then read nothing.

A counting form (``RadixSelectConfig.step_bits``, for a segment resident in registers) finds the same
threshold without histograms: keys as order-preserving uint32 (0: not selectable), 1 or 2 bits of the
threshold per step from the top, each step one count of the keys at or above the candidate values (a few
instructions a key, where an 8-bit ``tl.histogram`` pass costs about a hundred), stopping once exactly k keys
lie at or above the bits found or at the lowest bit any key has set (bf16 scores: 16 bits); its end pass scans (above, tied) counts packed in one int32 instead of two
scans. Same threshold, same tie rule, same output. For few rows (the batch-1 decode step: one program per
row at latency) it is a tuner candidate (:data:`CANDIDATES`), not measured on a GPU yet.

Long rows split in two launches: segments of ``seg`` entries each keep their own top-k (the row's
top-k is inside the union of the segments' top-k under the same total order), as (key, id) lists in
entry order, and one program per row selects again over those lists. Either launch's grid depends on
the row count and the row width only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2


@triton.jit
def _keys(src_ptr, ids_ptr, vis_ptr, bm_ptr, t, row_src, row_ids, row_bm, cols, m, N_ENT, NB_M,
          KEYS_IN: tl.constexpr, IDS_IN: tl.constexpr, GROUP: tl.constexpr, MASK_G: tl.constexpr):
    """(key int32, id, selectable) of columns ``cols`` of row t. GROUP > 1: column c is the block of
    entries [c·GROUP, c·GROUP + GROUP) scored by its max, the block of the newest visible entry pinned
    (+inf). MASK_G > 0: only columns whose block ``c // MASK_G`` is set in ``bm`` are selectable."""
    if KEYS_IN:
        key = tl.load(src_ptr + row_src + cols, mask=m, other=0)
        ok = m
    else:
        if GROUP > 1:
            e = cols[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            x = tl.max(tl.load(src_ptr + row_src + e, mask=m[:, None] & (e < N_ENT), other=float("-inf")), 1)
            vis = tl.load(vis_ptr + t).to(tl.int64)
            x = tl.where((vis > 0) & (cols == (vis - 1) // GROUP), float("inf"), x)
        else:
            x = tl.load(src_ptr + row_src + cols, mask=m, other=float("-inf"))
        ok = m & (x > float("-inf"))            # NaN and -inf are not selectable
        x = tl.where(x == 0.0, 0.0, x)          # -0 and +0: one key
        b = x.to(tl.int32, bitcast=True)
        key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)   # float order as signed integer order
    if MASK_G > 0:
        blk = cols // MASK_G
        ok = ok & (tl.load(bm_ptr + row_bm + blk, mask=m & (blk < NB_M), other=0) != 0)
    if IDS_IN:
        ids = tl.load(ids_ptr + row_ids + cols, mask=m, other=-1)
        ok = ok & (ids >= 0)
    else:
        ids = cols
    return key, ids, ok


@triton.jit
def _store_sel(out_ids_ptr, out_keys_ptr, om_ptr, out_at, row_om, at, ids, key, sel, si, cols, hi,
               KEYS_OUT: tl.constexpr, EXPAND: tl.constexpr, MASK_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """The selected entries' ids (and keys) at their output slots ``at``, and the selection map."""
    if EXPAND > 1:
        j = tl.arange(0, EXPAND)[None, :]
        tl.store(out_ids_ptr + out_at + at[:, None] * EXPAND + j, ids.to(tl.int64)[:, None] * EXPAND + j,
                 mask=sel[:, None])
    else:
        tl.store(out_ids_ptr + out_at + at, ids, mask=sel)
    if KEYS_OUT:
        tl.store(out_keys_ptr + out_at + at, key, mask=sel)
    if MASK_OUT == 1:
        tl.store(om_ptr + row_om + cols, si.to(tl.uint8), mask=cols < hi)
    if MASK_OUT == 2:
        tl.store(om_ptr + row_om + cols, tl.zeros([BLOCK], tl.uint8), mask=cols < hi)
    if MASK_OUT == 3:
        tl.store(om_ptr + row_om + ids, tl.full([BLOCK], 1, tl.uint8), mask=sel)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _count_search(u, K, BLOCK: tl.constexpr, STEP_BITS: tl.constexpr):
    """(thr, need) of the final pass over resident keys ``u`` (order-preserving uint32, 0: not selectable) by
    counting: ``thr`` is the largest v with at least K keys >= v (kept: the keys > thr and the first ``need``
    equal to it). STEP_BITS bits
    of v per step, most significant first: the 2^STEP_BITS candidates lo + j·2^shift are counted in one
    reduction over [BLOCK, 2^STEP_BITS] compares (a few instructions an entry, where an 8-bit histogram
    pass costs about a hundred), the largest j whose count reaches K extends ``lo``, and the count at the
    smallest candidate that failed is kept (the count above the threshold at the end). Stops early once
    exactly K keys are >= lo (then no tie is cut), and before the bits below the lowest bit any key has set
    (all 0 in the threshold too, and no key lies between lo and the failed candidate: bf16-rounded scores
    take at most 16 one-bit steps). At most K selectable: all kept, no step runs."""
    NCP: tl.constexpr = 1 << STEP_BITS
    jc = tl.arange(0, NCP)
    nsel = tl.sum((u > 0).to(tl.int32), 0)
    orv = tl.reduce(u, 0, _bit_or)
    low = orv & (~orv + 1)                # the lowest bit any key has set (bf16 scores: bit 16 or above)
    lo = tl.full([], 0, tl.uint32)
    hi_cnt = tl.full([], 0, tl.int32)     # keys >= the smallest candidate that failed (none yet: 2^32)
    done = (nsel <= K).to(tl.int32)      # at most K selectable: keep them all, no search
    at = tl.full([], BLOCK, tl.int32)     # keys >= lo (lo = 0: every lane)
    step = tl.full([], 0, tl.int32)
    shift = tl.full([], 32 - STEP_BITS, tl.uint32)
    while (step < 32 // STEP_BITS) & (done == 0) & ((low >> shift) < NCP):   # bits below ``low``: 0 in every key
        if STEP_BITS == 1:      # one candidate: a plain count (no [BLOCK, 2] tile with the known count at lo)
            c1 = lo + (tl.full([], 1, tl.uint32) << shift)
            n1 = tl.sum(tl.where(u >= c1, 1, 0), 0)
            take = n1 >= K
            hi_cnt = tl.where(take, hi_cnt, n1)
            at = tl.where(take, n1, at)
            lo = tl.where(take, c1, lo)
        else:
            cand = lo + (jc.to(tl.uint32) << shift)
            cnt = tl.sum(tl.where(u[:, None] >= cand[None, :], 1, 0), 0)            # non-increasing in j
            jstar = tl.max(tl.where(cnt >= K, jc, 0), 0)
            hi_cnt = tl.where(jstar + 1 < NCP, tl.sum(tl.where(jc == jstar + 1, cnt, 0), 0), hi_cnt)
            at = tl.sum(tl.where(jc == jstar, cnt, 0), 0)
            lo = lo + (jstar.to(tl.uint32) << shift)
        done = ((at == K) & (lo > 0)).to(tl.int32)
        step += 1
        shift = tl.maximum(32 - STEP_BITS * (step + 1), 0).to(tl.uint32)     # 0 past the last step
    # done: exactly the keys >= lo; else the keys > lo and the first K - (count > lo) equal to lo
    thr_u = tl.where(nsel <= K, 0, tl.where(done != 0, lo - 1, lo))
    need = tl.where((done != 0) | (lo == 0), 0, K - hi_cnt)
    return thr_u, need


@triton.jit
def _radix_select(src_ptr, ids_ptr, vis_ptr, bm_ptr, out_ids_ptr, out_keys_ptr, om_ptr,
                  N, N_ENT, SEG, K, NB_M, stride_src, stride_ids, stride_bm, stride_out, stride_om,
                  KEYS_IN: tl.constexpr, IDS_IN: tl.constexpr, KEYS_OUT: tl.constexpr, GROUP: tl.constexpr,
                  MASK_G: tl.constexpr, EXPAND: tl.constexpr, MASK_OUT: tl.constexpr, BLOCK: tl.constexpr,
                  RESIDENT: tl.constexpr, STEP_BITS: tl.constexpr = 0):
    """Program (t, s): the top ``K`` of columns [s·SEG, min((s+1)·SEG, N)) of row t -> out[t, s·K : s·K+K]
    (ids ascending then -1; with KEYS_OUT their keys too; EXPAND > 1: id c written as the EXPAND ids
    c·EXPAND + j, K·EXPAND slots). MASK_OUT writes a [T, N] uint8 map of the selected columns: 1 the
    selection of a single program per row, 2 zeros over the segment (a first launch), 3 ones at the
    selected ids (the second launch over the first one's lists). RESIDENT: the segment fits one tile, read
    once and kept in registers through the passes (else every pass re-reads its tiles). STEP_BITS > 0 (with
    RESIDENT; 1, 2 or 4): the threshold by counting instead of histograms (see :func:`_count_search`)."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * SEG
    hi = tl.minimum(lo + SEG, N)
    row_src = t * stride_src
    row_ids = t * stride_ids
    row_bm = t * stride_bm
    row_om = t * stride_om
    out_at = t * stride_out + s * K
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)

    prefix = tl.full([], 0, tl.int32)     # the threshold's digits found so far
    pmask = tl.full([], 0, tl.int32)      # which bits of ``prefix`` are known
    krem = tl.full([], 0, tl.int32) + K   # entries still wanted among those matching the prefix
    keep_all = tl.full([], 0, tl.int32)
    whole = tl.full([], 0, tl.int32)
    stop = hi
    if RESIDENT:
        key_r, ids_r, ok_r = _keys(src_ptr, ids_ptr, vis_ptr, bm_ptr, t, row_src, row_ids, row_bm, lo + offs,
                                   lo + offs < hi, N_ENT, NB_M, KEYS_IN, IDS_IN, GROUP, MASK_G)
    if STEP_BITS > 0:   # resident: the keys as u (0: not selectable), one tile, one scan at the end
        u = tl.where(ok_r, key_r ^ (-2147483647 - 1), 0).to(tl.uint32, bitcast=True)
        thr_u, need = _count_search(u, K, BLOCK, STEP_BITS)
        gt = (u > thr_u).to(tl.int32)
        eq = ((u == thr_u) & (u > 0)).to(tl.int32)
        ge = gt + (eq << 16)                    # (gt, eq) in 16-bit halves: one scan (BLOCK < 2^16)
        cs = tl.cumsum(ge, 0) - ge              # exclusive
        tie_at = cs >> 16                       # ties before the entry; the first ``need`` are kept
        sel = (gt != 0) | ((eq != 0) & (tie_at < need))
        at = (cs & 0xFFFF) + tl.minimum(tie_at, need)
        cols = lo + offs
        ids = ids_r if IDS_IN else cols
        key = (u ^ 0x80000000).to(tl.int32, bitcast=True)
        _store_sel(out_ids_ptr, out_keys_ptr, om_ptr, out_at, row_om, at, ids, key, sel, sel.to(tl.int32), cols,
                   hi, KEYS_OUT, EXPAND, MASK_OUT, BLOCK)
        taken = tl.sum(sel.to(tl.int32), 0)
    else:
        for d in tl.static_range(4):
            shift = 24 - 8 * d                  # a constexpr (d is one); never annotated: not reassignable
            hist = tl.zeros([256], dtype=tl.int32)
            for c0 in range(lo, stop, BLOCK):
                if RESIDENT:
                    key, ok = key_r, ok_r
                else:
                    cols = c0 + offs
                    key, ids, ok = _keys(src_ptr, ids_ptr, vis_ptr, bm_ptr, t, row_src, row_ids, row_bm, cols,
                                         cols < hi, N_ENT, NB_M, KEYS_IN, IDS_IN, GROUP, MASK_G)
                m = ok & ((key & pmask) == prefix)
                dig = (key >> shift) & 0xFF
                if d == 0:
                    dig = dig ^ 0x80                # the sign bit: negative keys below positive ones
                dig = tl.where(m, dig, 0)
                hist += tl.histogram(dig, 256)
                hist -= tl.where(bins == 0, BLOCK - tl.sum(m.to(tl.int32), 0), 0)   # masked lanes went to bin 0
            total = tl.sum(hist, 0)
            ge = total - tl.cumsum(hist, 0) + hist                      # matching keys with digit >= bin
            b = tl.max(tl.where(ge >= krem, bins, -1), 0)
            if d == 0:
                keep_all = (b < 0).to(tl.int32)                         # at most K selectable: keep them all
            b = tl.maximum(b, 0)
            krem -= tl.sum(tl.where(bins > b, hist, 0), 0)
            if d < 3:   # every key of the threshold's bin is wanted: the lower digits do not matter
                whole = whole | ((keep_all == 0) & (tl.sum(tl.where(bins == b, hist, 0), 0) == krem)).to(tl.int32)
            stop = tl.where((keep_all != 0) | (whole != 0), lo, hi)     # later passes: nothing to read
            if d == 0:
                prefix = (b ^ 0x80) << 24
            else:
                prefix = prefix | (b << shift)                          # unchanged once ``whole`` (b = 0)
            pmask = tl.full([], -(1 << shift), tl.int32)   # the top 32 - shift bits are known
        # keep_all: below every selectable key; whole: keys >= the bin's lowest key, no ties to count
        thr = tl.where(keep_all != 0, -2147483647 - 1, tl.where(whole != 0, prefix - 1, prefix))
        need = tl.where((keep_all != 0) | (whole != 0), 0, krem)

        taken = tl.full([], 0, tl.int32)
        ties = tl.full([], 0, tl.int32)
        for c0 in range(lo, hi, BLOCK):
            cols = c0 + offs
            if RESIDENT:
                key, ids, ok = key_r, ids_r, ok_r
            else:
                key, ids, ok = _keys(src_ptr, ids_ptr, vis_ptr, bm_ptr, t, row_src, row_ids, row_bm, cols, cols < hi,
                                     N_ENT, NB_M, KEYS_IN, IDS_IN, GROUP, MASK_G)
            eq = (ok & (key == thr)).to(tl.int32)
            sel = (ok & (key > thr)) | ((eq != 0) & (ties + tl.cumsum(eq, 0) - eq < need))
            si = sel.to(tl.int32)
            at = taken + tl.cumsum(si, 0) - si
            _store_sel(out_ids_ptr, out_keys_ptr, om_ptr, out_at, row_om, at, ids, key, sel, si, cols, hi,
                       KEYS_OUT, EXPAND, MASK_OUT, BLOCK)
            taken += tl.sum(si, 0)
            ties += tl.sum(eq, 0)
    for f0 in range(0, K * EXPAND, BLOCK):
        p = f0 + offs
        tl.store(out_ids_ptr + out_at + p, tl.full([BLOCK], -1, tl.int32), mask=(p < K * EXPAND) & (p >= taken * EXPAND))


@dataclass(frozen=True)
class RadixSelectConfig:
    resident_max: int = 8192   # a segment of up to this many entries is read once and kept in registers
    block: int = 4096          # the tile of a longer segment (re-read by every pass)
    per_thread: int = 16       # entries a thread holds (sets the warp count, 4 to 16)
    step_bits: int = 0         # 0: 8-bit histogram passes; 1, 2 or 4: a resident segment's threshold by counting


DEFAULT_CONFIG = RadixSelectConfig()
# The tuner's candidates (the default first: what runs untimed under the interpreter or a graph capture). The
# counting forms cut the instructions a resident segment costs (an 8-bit histogram pass is about a hundred a key,
# a 1-bit counting step a few; the end's two scans become one): for few rows, where one program per row runs at
# latency. Not measured on a GPU yet; the tuner keeps whichever is fastest per class.
CANDIDATES = (DEFAULT_CONFIG, RadixSelectConfig(step_bits=1), RadixSelectConfig(step_bits=2),
              RadixSelectConfig(resident_max=16384, step_bits=1))
TUNER = ConfigTuner("radix_select", CANDIDATES)


def _pick(kind: str, t: int, n: int, k: int, group: int, masked: bool, listed: bool, seg, run, device):
    """The configuration for one selection class (rows and width as powers of two) by measurement."""
    key = (kind, next_pow2(t), next_pow2(n), k, group, masked, listed, seg)
    return TUNER.pick(key, run, device)


def segment_size(n: int, k: int, cap: int) -> int:
    """Columns a first-launch program takes: the whole row up to ``cap`` (one launch), else about
    sqrt(n·k) up to ``cap`` (a segment's work and the second launch's list of (n/seg)·k candidates
    balance), at least 4k (so the second launch has far fewer candidates than the row has columns)."""
    if n <= cap:
        return max(n, 1)
    return max(4 * k, min(cap, next_pow2(int((n * max(k, 1)) ** 0.5))))


def launch_shape(cols: int, group: int, cfg: RadixSelectConfig):
    """(tile, warps, resident) of a program over ``cols`` columns of ``group`` entries each. The tile is at
    least the thread count: ``tl.histogram`` counts a replicated element once per copy."""
    cap = max(cfg.resident_max // group, 256)
    resident = cols <= cap
    block = max(next_pow2(cols) if resident else next_pow2(cfg.block) // group, 256)   # >= the 256 bins
    warps = max(4, min(16, next_pow2(block * group) // (32 * cfg.per_thread)))
    return max(block, 32 * warps), warps, resident


def radix_topk(scores: torch.Tensor, topk: int, ids: Optional[torch.Tensor] = None,
               block_mask: Optional[torch.Tensor] = None, mask_block: int = 1, seg: Optional[int] = None,
               config: Optional[RadixSelectConfig] = None) -> torch.Tensor:
    """[T, n] fp32 scores (-inf: not selectable) -> int64 [T, topk]: the ``topk`` best entry ids ascending,
    then -1; exact ties to the lower entry id (what :func:`step_indexer_mx.select_topk` returns).
    ``ids`` [T, n] (-1: none): column j stands for entry ``ids[t, j]`` (an entry list, ascending where
    selectable): the result is ``ids`` at the selected columns, i.e. ``ids.gather(1, select_topk(...))``
    with -1 kept. ``block_mask`` [T, nb] (uint8/bool): only entries j whose block ``j // mask_block`` is
    set (and < nb) are selectable (the candidate blocks). ``seg``: entries per first-launch program
    (None: :func:`segment_size`); rows wider split in two launches. ``config``: the launch configuration
    (None: the tuner's measured choice among :data:`CANDIDATES` for this class on a GPU, else the default)."""
    if scores.dim() != 2:
        raise ValueError(f"radix_topk: scores must be [T, n], got shape {tuple(scores.shape)}")
    if topk < 0:
        raise ValueError(f"radix_topk: topk must be >= 0, got {topk}")
    t, n = scores.shape
    out = torch.empty(t, topk, dtype=torch.long, device=scores.device)
    if t == 0 or topk == 0:
        return out
    if n == 0:
        return out.fill_(-1)
    if ids is not None:
        if ids.shape != scores.shape:
            raise ValueError(f"radix_topk: ids must have the scores' shape {tuple(scores.shape)}, "
                             f"got {tuple(ids.shape)}")
        ids = _rowmajor(ids)
    if block_mask is not None:
        if block_mask.dim() != 2 or block_mask.shape[0] != t or mask_block < 1:
            raise ValueError(f"radix_topk: block_mask must be [T={t}, blocks] with mask_block >= 1, got shape "
                             f"{tuple(block_mask.shape)}, mask_block={mask_block}")
        block_mask = _rowmajor(block_mask.view(torch.uint8) if block_mask.dtype == torch.bool else block_mask)
    x = _rowmajor(scores.float())
    mb = mask_block if block_mask is not None else 0

    def run(cfg):
        _select(x, topk, out, ids=ids, block_mask=block_mask, mask_block=mb, seg=seg, config=cfg)

    if config is None:
        config = _pick("topk", t, n, topk, 1, block_mask is not None, ids is not None, seg, run, scores.device)
    run(config)
    return out


def radix_candidates(scores: torch.Tensor, visible: torch.Tensor, num_blocks: int, block: int,
                     seg: Optional[int] = None, config: Optional[RadixSelectConfig] = None):
    """The candidate source's blocks (§3.5(d)) from [T, n] scores in one or two launches: block score = max
    of its ``block`` entries, the newest visible entry's block pinned, the best ``num_blocks`` blocks with a
    finite score (ties to the lower block) -> (int64 [T, num_blocks·block] their entry ids ascending, -1 for
    none; uint8 [T, ceil(n / block)] 1 on the selected blocks). ``block`` a power of two."""
    t, n = scores.shape
    if block < 1 or block & (block - 1):
        raise ValueError(f"radix_candidates: block must be a power of two, got {block}")
    nblk = cdiv(n, block)
    out = torch.empty(t, num_blocks * block, dtype=torch.long, device=scores.device)
    bmask = torch.zeros(t, nblk, dtype=torch.uint8, device=scores.device)
    if t == 0 or num_blocks == 0 or n == 0:
        return out.fill_(-1), bmask
    x, vis = _rowmajor(scores.float()), visible.contiguous()

    def run(cfg):
        _select(x, num_blocks, out, n_cols=nblk, group=block, visible=vis, mask_out=bmask, seg=seg, config=cfg)

    if config is None:
        config = _pick("candidates", t, n, num_blocks, block, False, False, seg, run, scores.device)
    run(config)
    return out, bmask


def _rowmajor(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _select(x: torch.Tensor, k: int, out: torch.Tensor, n_cols: Optional[int] = None, ids=None, block_mask=None,
            mask_block: int = 0, group: int = 1, visible=None, mask_out=None, seg=None, config=None) -> None:
    """Launch one or two radix selections of ``k`` of the ``n_cols`` columns of ``x`` into ``out``."""
    cfg = config or DEFAULT_CONFIG
    t, n_ent = x.shape
    n = n_ent if n_cols is None else n_cols
    cap = max(cfg.resident_max // group, 256)
    seg = segment_size(n, k, cap) if seg is None else max(int(seg), 1)
    nseg = cdiv(n, seg)
    idl = x if ids is None else ids
    vis = x if visible is None else visible
    bm = x if block_mask is None else block_mask
    om = x if mask_out is None else mask_out
    strides = (idl.stride(0) if ids is not None else 0, bm.stride(0) if block_mask is not None else 0)
    om_stride = om.stride(0) if mask_out is not None else 0
    block, warps, resident = launch_shape(min(seg, n), group, cfg)
    shape = dict(BLOCK=block, RESIDENT=resident, STEP_BITS=_step_bits(cfg, block, resident), num_warps=warps)
    if nseg == 1:
        _radix_select[(t, 1)](x, idl, vis, bm, out, out, om, n, n_ent, n, k, bm.shape[-1], x.stride(0), *strides,
                              out.stride(0), om_stride, KEYS_IN=False, IDS_IN=ids is not None, KEYS_OUT=False,
                              GROUP=group, MASK_G=mask_block, EXPAND=group,
                              MASK_OUT=1 if mask_out is not None else 0, **shape)
        return
    cand = torch.empty(t, nseg * k, dtype=torch.int32, device=x.device)   # entry ids < 2^31
    keys = torch.empty(t, nseg * k, dtype=torch.int32, device=x.device)
    _radix_select[(t, nseg)](x, idl, vis, bm, cand, keys, om, n, n_ent, seg, k, bm.shape[-1], x.stride(0),
                             *strides, cand.stride(0), om_stride, KEYS_IN=False, IDS_IN=ids is not None,
                             KEYS_OUT=True, GROUP=group, MASK_G=mask_block, EXPAND=1,
                             MASK_OUT=2 if mask_out is not None else 0, **shape)
    m = nseg * k
    block, warps, resident = launch_shape(m, 1, cfg)
    _radix_select[(t, 1)](keys, cand, vis, bm, out, out, om, m, m, m, k, 0, keys.stride(0), cand.stride(0), 0,
                          out.stride(0), om_stride, KEYS_IN=True, IDS_IN=True, KEYS_OUT=False, GROUP=1, MASK_G=0,
                          EXPAND=group, MASK_OUT=3 if mask_out is not None else 0, BLOCK=block, RESIDENT=resident,
                          STEP_BITS=_step_bits(cfg, block, resident), num_warps=warps)


def _step_bits(cfg: RadixSelectConfig, block: int, resident: bool) -> int:
    """The counting form's bits per step where it applies (a resident tile whose counts fit 16 bits), else 0."""
    if cfg.step_bits not in (0, 1, 2, 4):
        raise ValueError(f"radix select: step_bits must be 0, 1, 2 or 4, got {cfg.step_bits}")
    return cfg.step_bits if resident and block < (1 << 15) else 0
