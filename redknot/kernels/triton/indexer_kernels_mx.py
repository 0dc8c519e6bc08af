"""Triton kernels of the V4.1 indexer over FP4 index keys (§3.5(d)); the host side that sizes, tunes and
launches them, and the ops built on them, is ``indexer_mx``.

* ``_index_scores``: scores (or block maxima) of a token chunk into a scratch matrix, the keys decoded in
  registers (``_index_keys`` / ``_decode_keys``), optionally through each token's candidate blocks.
* ``_index_stream``: the streamed top-k: ``BLOCK_T`` tokens share each decoded key block, a thresholded
  buffer of packed (score, id) keys per token cut back to ``K`` by a bitonic top-k when it fills, block
  maxima written on the way when asked (``_split_of`` / ``_block_ents`` / ``_keys_kept`` are its steps,
  shared with the expanded form).
* ``_expand_keys`` + ``_index_stream_x``: the keys decoded once per call to exact bf16, then a
  software-pipelined stream with the entries on the MMA's M axis and the buffer cut (``_cut_rows``)
  between segments of blocks; the stream after the tile's query load is ``_stream_x_rows``, which the V4
  indexer's pipelined form (``indexer._indexer_select_x``, bf16 keys gathered out of the paged cache) shares.
"""
from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.indexer import _EMPTY, _append, _order_bits, _pack, _store_best
from redknot.kernels.triton.quant_mx import e2m1_half, e8m0_decode


@triton.jit
def _index_keys(key_ptr, ent, ok, stride_k, DI: tl.constexpr, BLOCK_N: tl.constexpr):
    kq, ks = _key_bytes(key_ptr, ent, ok, stride_k, DI)
    return _decode_keys(kq, ks, DI, BLOCK_N)


@triton.jit
def _key_bytes(key_ptr, ent, ok, stride_k, DI: tl.constexpr):
    """The packed e2m1 bytes [BN, DI/2] and E8M0 bytes [BN, DI/32] of index-key rows ``ent`` (masked rows:
    code 0 and scale byte 127)."""
    base = key_ptr + ent.to(tl.int64)[:, None] * stride_k
    kq = tl.load(base + tl.arange(0, DI // 2)[None, :], mask=ok[:, None], other=0)
    ks = tl.load(base + DI // 2 + tl.arange(0, DI // 32)[None, :], mask=ok[:, None], other=127)
    return kq, ks


@triton.jit
def _decode_keys(kq, sb, DI: tl.constexpr, BLOCK_N: tl.constexpr):
    p = kq.to(tl.int32)
    v = e2m1_half(tl.reshape(tl.join(p, p >> 4), (BLOCK_N, DI))).to(tl.float32)   # value * 2^-14, exact
    sc = e8m0_decode(sb) * 16384.0    # exact below 2^114 (scale bytes up to 240; keys never come near)
    v = tl.reshape(tl.reshape(v, (BLOCK_N, DI // 32, 32)) * sc[:, :, None], (BLOCK_N, DI))
    return v.to(tl.bfloat16)


@triton.jit
def _index_scores(q_ptr, w_ptr, key_ptr, vis_ptr, cand_ptr, out_ptr, T, N, NCOLS,
                  stride_qt, stride_qh, stride_wt, stride_k, stride_ct, stride_ot,
                  HI: tl.constexpr, DI: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAND: tl.constexpr, BS: tl.constexpr, BLOCKMAX: tl.constexpr, BF16: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    t64 = toks.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if CAND:  # BLOCK_T == 1: this token's candidate entry ids, loaded (no alignment can be inferred)
        ent = tl.load(cand_ptr + t64 * stride_ct + cols, mask=cols < NCOLS, other=-1)  # [BN]
        ok = (ent >= 0) & (ent < N)
    else:
        ent = cols
        ok = cols < N
    keys = _index_keys(key_ptr, tl.where(ok, ent, 0), ok, stride_k, DI, BLOCK_N)  # [BN, DI]
    hs = tl.arange(0, HI)
    q = tl.load(q_ptr + t64[:, None, None] * stride_qt + hs[None, :, None] * stride_qh +
                tl.arange(0, DI)[None, None, :], mask=tmask[:, None, None], other=0.0).to(tl.bfloat16)
    d = tl.dot(tl.reshape(q, (BLOCK_T * HI, DI)), tl.trans(keys))  # [BT*HI, BN] fp32
    w = tl.load(w_ptr + t64[:, None] * stride_wt + hs[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
    d = tl.reshape(d, (BLOCK_T, HI, BLOCK_N))
    if BF16:
        d = d.to(tl.bfloat16).to(tl.float32)
        w = w.to(tl.bfloat16).to(tl.float32)
        s = tl.sum((tl.maximum(d, 0.0) * w[:, :, None]).to(tl.bfloat16).to(tl.float32), 1)
        s = s.to(tl.bfloat16).to(tl.float32)
    else:
        s = tl.sum(tl.maximum(d, 0.0) * w[:, :, None], 1)  # [BT, BN]
    vis = tl.load(vis_ptr + toks, mask=tmask, other=0)
    s = tl.where(ok[None, :] & (ent[None, :] < vis[:, None]), s, float("-inf"))
    if BLOCKMAX:
        bm = tl.max(tl.reshape(s, (BLOCK_T, BLOCK_N // BS, BS)), 2)
        bcols = tl.program_id(1) * (BLOCK_N // BS) + tl.arange(0, BLOCK_N // BS)
        tl.store(out_ptr + t64[:, None] * stride_ot + bcols[None, :], bm,
                 mask=tmask[:, None] & (bcols[None, :] < NCOLS))
    else:
        tl.store(out_ptr + t64[:, None] * stride_ot + cols[None, :], s,
                 mask=tmask[:, None] & (cols[None, :] < NCOLS))


@triton.jit
def _split_of(vis_ptr, T, nsplit, NB, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
              CAND: tl.constexpr):
    """A stream program's tokens and its split of the entries: (split, rows_ok, token ids as int64, the tokens'
    visible counts, first entry, end entry, blocks of BLOCK_N), splits aligned to BLOCK_N."""
    pid_s = tl.program_id(1)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows_ok = toks < T
    t64 = toks.to(tl.int64)
    vis = tl.load(vis_ptr + toks, mask=rows_ok, other=0)
    if CAND:   # positions in the candidate list (its length), not entry ids
        n_max = NB * BS
    else:
        n_max = tl.max(vis, 0)
    chunk = tl.cdiv(tl.cdiv(n_max, nsplit), BLOCK_N) * BLOCK_N
    e_lo = pid_s * chunk
    e_hi = tl.minimum(e_lo + chunk, n_max)
    n_blocks = tl.cdiv(tl.maximum(e_hi - e_lo, 0), BLOCK_N)
    return pid_s, rows_ok, t64, vis, e_lo, e_hi, n_blocks


@triton.jit
def _block_ents(cb_ptr, stride_cb, e_lo, e_hi, n_blocks, j, NKEYS, BLOCK_N: tl.constexpr, BS: tl.constexpr,
                CAND: tl.constexpr):
    """(entry ids, valid) of block j of a split, newest block first; with CAND the block's positions in the
    token's candidate list, turned into entry ids (-1 pads and ids past NKEYS invalid)."""
    ents = e_lo + (n_blocks - 1 - j) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = ents < e_hi
    if CAND:
        tok = tl.program_id(0).to(tl.int64)
        blk = tl.load(cb_ptr + tok * stride_cb + ents // BS, mask=ok, other=-1)   # one token: tok < T
        ents = blk * BS + ents % BS
        ok = ok & (blk >= 0) & (ents < NKEYS)
    return ents, ok


@triton.jit
def _keys_kept(s, ents, ok, vis, rows_ok, theta, t64, bm_ptr, stride_bm, e_lo, n_blocks, j, NB,
               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr, BLOCKMAX: tl.constexpr):
    """Block j's scores s [BT, BN] of entries ``ents``: the packed keys and which of them beat the rows' bars;
    with BLOCKMAX the block's max score per BS entries (-inf where none is visible) stored at ``bm_ptr``."""
    s = tl.where(s == 0.0, 0.0, s)   # -0.0 (relu 0 times a negative weight) ties with 0.0, as in torch
    seen = ok[None, :] & (ents[None, :] < vis[:, None]) & rows_ok[:, None]
    if BLOCKMAX:
        bm = tl.max(tl.reshape(tl.where(seen, s, float("-inf")), (BLOCK_T, BLOCK_N // BS, BS)), 2)
        bcols = (e_lo + (n_blocks - 1 - j) * BLOCK_N) // BS + tl.arange(0, BLOCK_N // BS)
        tl.store(bm_ptr + t64[:, None] * stride_bm + bcols[None, :], bm,
                 mask=rows_ok[:, None] & (bcols[None, :] < NB))
    key = _pack(s, ents[None, :])
    keep = seen & (key > theta[:, None])
    return key, keep


@triton.jit
def _index_stream(q_ptr, w_ptr, key_ptr, vis_ptr, buf_ptr, cand_ptr, bm_ptr, cb_ptr, T, nsplit, NB, NKEYS,
                  stride_qt, stride_qh, stride_wt, stride_k, stride_bm, stride_cb,
                  HI: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr, BLOCKMAX: tl.constexpr,
                  BS: tl.constexpr, CAND: tl.constexpr, SCALED: tl.constexpr, PREFETCH: tl.constexpr):
    """Streaming top-K of one tile of tokens over its split of the entries (newest block first): the
    scores of ``_index_scores``, packed with their ids, kept in the token's buffer when above its bar.
    Blocks of ``BLOCK_N`` entries are aligned to multiples of ``BLOCK_N`` (every split starts on one),
    so with ``BLOCKMAX`` each step also writes the max score of each of its ``BS``-entry candidate
    blocks (-inf where no entry of the block is visible) to ``bm_ptr`` [T, NB]: the candidate source's
    block scores come from the same pass as its top-k. With ``CAND`` (one token per program) the stream
    walks the token's candidate list instead: ``NB`` block ids at ``cb_ptr`` [T, NB] (-1 pads; distinct),
    entries ``b·BS .. b·BS+BS-1`` of each, below ``NKEYS`` and the token's visibility. ``SCALED``: the key
    bytes go to ``tl.dot_scaled`` as MXFP4 (packed e2m1, E8M0 per 32: exactly the index-key row), which on
    SM90 converts them to bf16 in a few byte permutes per 8 values instead of the register decode's ~17
    integer operations per value; both give the exact key values and the same bf16 MMA. ``PREFETCH`` (not
    with ``CAND``): each step issues the key loads of the next block before it computes its own, so the
    load latency overlaps the step's MMA and selection (the loop is not software-pipelined otherwise);
    the bytes loaded for every block are the same, so are the selections."""
    pid_s, rows_ok, t64, vis, e_lo, e_hi, n_blocks = _split_of(vis_ptr, T, nsplit, NB, BLOCK_T, BLOCK_N, BS, CAND)
    hs = tl.arange(0, HP)   # heads padded to a tensor-core shape: padded rows have q = 0 and weight 0
    hmask = rows_ok[:, None] & (hs < HI)[None, :]
    q = tl.load(q_ptr + t64[:, None, None] * stride_qt + hs[None, :, None] * stride_qh +
                tl.arange(0, DI)[None, None, :], mask=hmask[:, :, None], other=0.0).to(tl.bfloat16)
    q = tl.reshape(q, (BLOCK_T * HP, DI))
    if SCALED:
        q_t = tl.trans(q)   # [DI, BT*HP]: the MMA's second operand, keys first
    w = tl.load(w_ptr + t64[:, None] * stride_wt + hs[None, :], mask=hmask, other=0.0).to(tl.float32)
    if BF16:
        w = w.to(tl.bfloat16).to(tl.float32)
    rows = t64 * nsplit + pid_s
    buf = buf_ptr + rows[:, None] * CAP
    count = tl.zeros([BLOCK_T], tl.int32)
    theta = tl.full([BLOCK_T], _EMPTY, tl.int64)
    if PREFETCH:   # the newest block's bytes, as the loop's first step would load them
        ents0 = e_lo + (n_blocks - 1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok0 = (ents0 < e_hi) & (ents0 >= e_lo)
        nq, ns = _key_bytes(key_ptr, tl.where(ok0, ents0, 0), ok0, stride_k, DI)
    for j in range(n_blocks):
        ents, ok = _block_ents(cb_ptr, stride_cb, e_lo, e_hi, n_blocks, j, NKEYS, BLOCK_N, BS, CAND)
        if PREFETCH:
            kq, ks = nq, ns
            nents = ents - BLOCK_N
            nok = (nents >= e_lo) & (nents < e_hi)
            nq, ns = _key_bytes(key_ptr, tl.where(nok, nents, 0), nok, stride_k, DI)
        else:
            kq, ks = _key_bytes(key_ptr, tl.where(ok, ents, 0), ok, stride_k, DI)
        if SCALED:
            d = tl.trans(tl.dot_scaled(kq, ks, "e2m1", q_t, None, "bf16", fast_math=True))
        else:
            keys = _decode_keys(kq, ks, DI, BLOCK_N)   # [BN, DI]
            d = tl.dot(q, tl.trans(keys))
        d = tl.reshape(d, (BLOCK_T, HP, BLOCK_N))
        if BF16:
            d = d.to(tl.bfloat16).to(tl.float32)
            s = tl.sum((tl.maximum(d, 0.0) * w[:, :, None]).to(tl.bfloat16).to(tl.float32), 1)
            s = s.to(tl.bfloat16).to(tl.float32)
        else:
            s = tl.sum(tl.maximum(d, 0.0) * w[:, :, None], 1)                          # [BT, BN]
        key, keep = _keys_kept(s, ents, ok, vis, rows_ok, theta, t64, bm_ptr, stride_bm, e_lo, n_blocks, j, NB,
                               BLOCK_T, BLOCK_N, BS, BLOCKMAX)
        count, theta = _append(buf, count, theta, key, keep, rows_ok, BLOCK_T, BLOCK_N, CAP, K)
    _store_best(buf, count, rows_ok, rows, cand_ptr, BLOCK_T, CAP, K)


@triton.jit
def _expand_keys(key_ptr, out_ptr, N, stride_k, DI: tl.constexpr, BLOCK: tl.constexpr):
    """Index-key rows -> their exact bf16 values [N, DI] (the register decode's ``_decode_keys``, once per
    entry): the ``expanded`` stream reads these instead of decoding the FP4 bytes again for every tile of
    tokens."""
    ents = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = ents < N
    kq, ks = _key_bytes(key_ptr, tl.where(ok, ents, 0), ok, stride_k, DI)
    v = _decode_keys(kq, ks, DI, BLOCK)
    tl.store(out_ptr + ents.to(tl.int64)[:, None] * DI + tl.arange(0, DI)[None, :], v, mask=ok[:, None])


_SIGN64 = tl.constexpr(-9223372036854775808)   # the int64 sign bit: xor maps signed order to unsigned order
_HSUM_N = tl.constexpr(16)   # columns of the head-sum MMA (its smallest N); the tile's tokens first


@triton.jit
def _kth_largest(vals, K: tl.constexpr):
    """The K-th largest of the packed keys ``vals`` [1, CAP] (int64; distinct, as each carries its entry id, the
    empty key below all of them; at least K real keys), as a scalar: its bits are found from the top, one
    counting pass over the row per bit, on the keys in unsigned order (sign bit flipped), so a buffer cut
    costs 64 row sums instead of a bitonic sort of CAP keys. Exactly K keys are at or above it."""
    u = (vals ^ _SIGN64).to(tl.uint64, bitcast=True)
    prefix = tl.zeros([1], tl.uint64)
    bit = tl.full([1], 1, tl.uint64) << 63
    for _ in range(64):
        trial = prefix | bit
        n_above = tl.sum((u >= trial[:, None]).to(tl.int32), 1)
        prefix = tl.where(n_above >= K, trial, prefix)
        bit = bit >> 1
    return tl.max(prefix.to(tl.int64, bitcast=True) ^ _SIGN64, 0)


@triton.jit
def _cut_rows(buf_ptr, rows, count, theta, rows_ok, limit, BLOCK_T: tl.constexpr, CAP: tl.constexpr,
              K: tl.constexpr, SELECT: tl.constexpr):
    """``_compact`` for the rows of a tile holding more than ``limit`` keys, one row at a time: a [1, CAP]
    top-k in registers instead of [BLOCK_T, CAP] (``SELECT``: the K-th key by ``_kth_largest`` and the keys at or
    above it compacted in buffer order, unsorted); returns (new counts, new thetas)."""
    tl.debug_barrier()   # appends by other threads of this program are visible after the barrier
    offs = tl.arange(0, CAP)
    offs_k = tl.arange(0, K)
    which = tl.arange(0, BLOCK_T)
    for t in range(BLOCK_T):
        sel = which == t
        c = tl.max(tl.where(sel, count, 0), 0)
        live = tl.max(tl.where(sel & rows_ok, 1, 0), 0)
        if (live > 0) & (c > limit):
            base = buf_ptr + tl.max(tl.where(sel, rows, 0), 0) * CAP
            vals = tl.load(base + offs[None, :], mask=offs[None, :] < c, other=_EMPTY)
            if SELECT:   # the K-th key by counting, then the keys at or above it, in buffer order
                kth = _kth_largest(vals, K)
                keep = vals >= kth
                slot = tl.cumsum(keep.to(tl.int32), 1) - 1
                tl.debug_barrier()
                tl.store(base + slot, vals, mask=keep)
                theta = tl.where(sel, kth, theta)
            else:
                best = tl.topk(vals, K)   # [1, K], descending
                tl.debug_barrier()
                tl.store(base + offs_k[None, :], best)
                theta = tl.where(sel, tl.min(tl.min(best, 1), 0), theta)
            count = tl.where(sel, tl.minimum(c, K), count)
    tl.debug_barrier()
    return count, theta


@triton.jit
def _index_stream_x(q_ptr, w_ptr, kx_ptr, vis_ptr, buf_ptr, cand_ptr, bm_ptr, cb_ptr, T, nsplit, NB, NKEYS,
                    stride_qt, stride_qh, stride_wt, stride_bm, stride_cb,
                    HI: tl.constexpr, HP: tl.constexpr, DI: tl.constexpr, K: tl.constexpr, CAP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr, BLOCKMAX: tl.constexpr,
                    BS: tl.constexpr, CAND: tl.constexpr, STAGES: tl.constexpr, BF16_MUL: tl.constexpr,
                    HSUM_MMA: tl.constexpr, CUT_SELECT: tl.constexpr, LATE_KEYS: tl.constexpr = False):
    """``_index_stream`` over keys already expanded to bf16 (``_expand_keys``, ``kx_ptr`` [N, DI]): the same
    products, MMA and score arithmetic, selection and block maxima, but each step's key load is a plain
    tile (``ents · DI + d``) that the compiler software-pipelines over ``STAGES`` steps, nothing is decoded
    in the loop, and the entries sit on the MMA's M axis with the tile's (token, head) rows on N
    (``[BLOCK_N, DI] x [DI, BLOCK_T·HP]``), so the weighted head sum of an entry stays inside its
    accumulator rows instead of crossing warps. The head sum runs in another order than the register
    stream's: with fp32 scores its terms are inexact (last-bit differences, within the op's tolerance); bf16
    terms are the same values and their fp32 sum is exact unless a term lies 2^16 below the sum, which the
    final bf16 rounding then almost always hides. The buffer cut sits outside the pipelined loop: the
    blocks go in segments of ``(CAP - K) / (2·BLOCK_N)`` and a segment starts by cutting the rows whose keys
    could overflow the buffer within it, one row at a time (a cut inside the loop keeps the compiler from
    pipelining the loads, and the tile-wide bitonic top-k raised every step's registers). Raising the bar
    less often keeps more keys in the buffer, never other ones: the final cut selects the same K.
    ``BF16_MUL`` (compiled kernels): with bf16 scores each weighted term is one bf16 multiply (packed, two
    terms an instruction) of relu(bf16(d)) and the bf16 weight, rounded to nearest: the exact product
    rounded once, as the fp32 product (exact for two bf16 values) rounded to bf16 is; the interpreter's
    bf16 arithmetic is not IEEE, so it runs that fp32 form. ``HSUM_MMA`` (bf16 scores): the head sum of the
    bf16 terms is a second MMA, terms [BLOCK_N, BLOCK_T·HP] from registers times a block-diagonal ones
    matrix [BLOCK_T·HP, 16] (exact products, fp32 accumulation in the tensor core: the same sum wherever
    it is exact, as for the reordered adds), instead of an unpack and an add per term."""
    pid_s, rows_ok, t64, vis, e_lo, e_hi, n_blocks = _split_of(vis_ptr, T, nsplit, NB, BLOCK_T, BLOCK_N, BS, CAND)
    hs = tl.arange(0, HP)
    hmask = rows_ok[:, None] & (hs < HI)[None, :]
    q = tl.load(q_ptr + t64[:, None, None] * stride_qt + hs[None, :, None] * stride_qh +
                tl.arange(0, DI)[None, None, :], mask=hmask[:, :, None], other=0.0).to(tl.bfloat16)
    q_t = tl.trans(tl.reshape(q, (BLOCK_T * HP, DI)))   # [DI, BT*HP]
    w = tl.load(w_ptr + t64[:, None] * stride_wt + hs[None, :], mask=hmask, other=0.0).to(tl.float32)
    if BF16:
        w = w.to(tl.bfloat16)
        if not BF16_MUL:
            w = w.to(tl.float32)
    w = tl.reshape(w, (BLOCK_T * HP,))
    _stream_x_rows(kx_ptr, q_t, w, rows_ok, t64, vis, t64 * nsplit + pid_s, e_lo, e_hi, n_blocks, buf_ptr, cand_ptr,
                   bm_ptr, cb_ptr, NB, NKEYS, stride_bm, stride_cb, 1.0, HP, DI, K, CAP, BLOCK_T, BLOCK_N, BF16,
                   BLOCKMAX, BS, CAND, STAGES, BF16_MUL, HSUM_MMA, None, False, CUT_SELECT, LATE_KEYS)


@triton.jit
def _append_kept(buf, count, key, keep):
    """Each row's kept keys (``keep`` [BT, BN]) appended to its buffer row (``buf`` [BT, 1] bases) in block order;
    returns the new counts."""
    slot = count[:, None] + tl.cumsum(keep.to(tl.int32), 1) - 1
    tl.store(buf + slot, key, mask=keep)
    return count + tl.sum(keep.to(tl.int32), 1)


@triton.jit
def _stream_x_rows(kx_ptr, q_t, w, rows_ok, t64, vis, rows, e_lo, e_hi, n_blocks, buf_ptr, cand_ptr, bm_ptr, cb_ptr,
                   NB, NKEYS, stride_bm, stride_cb, scale, HP: tl.constexpr, DI: tl.constexpr, K: tl.constexpr,
                   CAP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BF16: tl.constexpr,
                   BLOCKMAX: tl.constexpr, BS: tl.constexpr, CAND: tl.constexpr, STAGES: tl.constexpr,
                   BF16_MUL: tl.constexpr, HSUM_MMA: tl.constexpr, PREC: tl.constexpr, SCALE: tl.constexpr,
                   CUT_SELECT: tl.constexpr, LATE_KEYS: tl.constexpr = False):
    """The expanded stream of one tile of tokens once its queries are in registers: ``q_t`` [DI, BT·HP] (the
    MMA's second operand), ``w`` [BT·HP] the head weights, keys ``kx_ptr + ents · DI`` (one sequence's plain
    rows), scratch / candidate rows ``rows``; blocks ``e_lo .. e_hi`` newest first in segments between buffer
    cuts, the best K of every row to ``cand_ptr``. Shared by ``_index_stream_x`` (V4.1) and the V4 indexer's
    ``indexer._indexer_select_x``; ``PREC`` is the dot's input precision, ``SCALE`` multiplies each fp32 head
    sum by ``scale`` (V4's score; V4.1 passes False); ``CUT_SELECT``: buffer cuts by ``_kth_largest`` (counting)
    instead of a bitonic top-k, leaving each row's best keys in buffer order, not sorted (V4.1 sorts its ids by
    id; V4's merge pass sorts by score). ``LATE_KEYS`` (not with ``BLOCKMAX``): a block first only tests whether
    any visible score's order bits reach a row's bar's high word (a key above the bar needs that), and builds the
    packed keys, the keep mask and their store layouts only in blocks that pass; the same keys are kept."""
    tl.static_assert(not (LATE_KEYS and BLOCKMAX), "LATE_KEYS skips blocks: their block maxima would be missing")
    offs_d = tl.arange(0, DI)
    if HSUM_MMA:   # ones[k, c] = 1 where head row k belongs to token c (columns past BLOCK_T stay 0)
        ones = tl.where(tl.arange(0, BLOCK_T * HP)[:, None] // HP == tl.arange(0, _HSUM_N)[None, :], 1.0, 0.0)
        ones = ones.to(tl.bfloat16)
    buf = buf_ptr + rows[:, None] * CAP
    count = tl.zeros([BLOCK_T], tl.int32)
    theta = tl.full([BLOCK_T], _EMPTY, tl.int64)
    SEG = (CAP - K) // (2 * BLOCK_N)   # blocks per segment: half of what a buffer cut back to K takes
    LIMIT = CAP - SEG * BLOCK_N        # a row holding more keys than this is cut before a segment
    for g in range(tl.cdiv(n_blocks, SEG)):
        if tl.max(count, 0) > LIMIT:
            count, theta = _cut_rows(buf_ptr, rows, count, theta, rows_ok, LIMIT, BLOCK_T, CAP, K, CUT_SELECT)
        seg = tl.minimum(SEG, n_blocks - g * SEG)
        for i in tl.range(0, seg, num_stages=STAGES):
            j = g * SEG + i
            ents, ok = _block_ents(cb_ptr, stride_cb, e_lo, e_hi, n_blocks, j, NKEYS, BLOCK_N, BS, CAND)
            if CAND:
                keys = tl.load(kx_ptr + tl.where(ok, ents, 0).to(tl.int64)[:, None] * DI + offs_d[None, :],
                               mask=ok[:, None], other=0.0)
            else:
                keys = tl.load(kx_ptr + ents.to(tl.int64)[:, None] * DI + offs_d[None, :], mask=ok[:, None], other=0.0)
            d = tl.dot(keys, q_t, input_precision=PREC)                                       # [BN, BT*HP] fp32
            if BF16 and BF16_MUL:   # relu before the rounding: the same value (rounding keeps signs and zero)
                tb = tl.maximum(d, 0.0).to(tl.bfloat16) * w[None, :]
            elif BF16:
                tb = (tl.maximum(d, 0.0).to(tl.bfloat16).to(tl.float32) * w[None, :]).to(tl.bfloat16)
            else:
                tb = tl.maximum(d, 0.0) * w[None, :]
            if HSUM_MMA:   # [BN, 16] -> [BN, BT]: the columns past BLOCK_T are 0 and add nothing
                s = tl.sum(tl.reshape(tl.dot(tb, ones), (BLOCK_N, _HSUM_N // BLOCK_T, BLOCK_T)), 1)
                s = tl.trans(s)                                                                 # [BT, BN]
            else:
                s = tl.trans(tl.sum(tl.reshape(tb.to(tl.float32), (BLOCK_N, BLOCK_T, HP)), 2))  # [BT, BN]
            if SCALE:   # after the head sum, as V4's paged kernel applies it
                s = s * scale
            if BF16:
                s = s.to(tl.bfloat16).to(tl.float32)
            if LATE_KEYS:   # the order bits of _pack against the bars' high words: no key beats a bar without
                high = _order_bits(tl.where(s == 0.0, 0.0, s))
                seen = ok[None, :] & (ents[None, :] < vis[:, None]) & rows_ok[:, None]
                near = seen & (high >= (theta >> 32).to(tl.int32)[:, None])
                if tl.max(tl.max(near.to(tl.int32), 1), 0) > 0:   # keys, masks and their layouts only here
                    key, keep = _keys_kept(s, ents, ok, vis, rows_ok, theta, t64, bm_ptr, stride_bm, e_lo, n_blocks,
                                           j, NB, BLOCK_T, BLOCK_N, BS, BLOCKMAX)
                    count = _append_kept(buf, count, key, keep)
            else:
                key, keep = _keys_kept(s, ents, ok, vis, rows_ok, theta, t64, bm_ptr, stride_bm, e_lo, n_blocks, j,
                                       NB, BLOCK_T, BLOCK_N, BS, BLOCKMAX)
                if tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0:   # most blocks of a long stream keep nothing
                    count = _append_kept(buf, count, key, keep)
    count, theta = _cut_rows(buf_ptr, rows, count, theta, rows_ok, K, BLOCK_T, CAP, K, CUT_SELECT)
    offs_k = tl.arange(0, K)
    best = tl.load(buf + offs_k[None, :], mask=(offs_k[None, :] < count[:, None]) & rows_ok[:, None],
                   other=_EMPTY)
    tl.store(cand_ptr + rows[:, None] * K + offs_k[None, :], best, mask=rows_ok[:, None])
