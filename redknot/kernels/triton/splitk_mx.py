"""Split-K GEMMs for small row counts (decode): weights streamed in their stored formats, many programs.

With 1-128 rows a V4.1 GEMM is a weight stream: the floor is the bytes of the FP8 / MXFP4 weight over
HBM bandwidth. One program per (row tile, column tile, K slice) reads its weight slice once, with wide
K steps (128 bytes of every weight row per step), decodes it in registers to bf16 with its scales folded
in, and runs a bf16 MMA against activations that already hold their exact per-32 FP8 QDQ values
(``dequant_mx.qdq_bf16``): every product is the reference's product, no rescale sits between MMAs.
Each slice writes an fp32 partial; a second kernel adds the partials in slice order 0..S-1 (a fixed
order: the result is deterministic), and applies the epilogue:

* ``reduce_rows``: bf16 output rows (a dense linear);
* ``reduce_swiglu``: MoE W1 | W3 partials -> clamped SwiGLU, routing weight, bf16 rounding, FP8 QDQ per
  32, the W2 GEMM's input (de-interleaved into even / odd K columns for the ``registers`` decode);
* ``reduce_combine``: MoE W2 partials -> each slot rounded to bf16, the token's k slots added in fp32 in
  slot order (§3.7).

The slice count depends only on the weight shape (N, K) up to ``SPLIT_MAX_ROWS`` rows, and MoE row tiles
are fixed at 16 rows, so there a row's result does not depend on how many other rows share the call
(batch invariance within this path; a dense stream's row tile grows with the rows, which changes the
MMA's width, not any row's products or their order).
Three ways to decode the weight tile (``decode``; ``stream_guard`` checks the fast ones on first use, and
the callers' tuners time them per weight shape on the first call):

* ``scaled`` (preferred for MXFP4): ``tl.dot_scaled`` with the packed weight as its first operand (E2M1 or E4M3
  with the E8M0 scales of its 32-wide K groups) and the QDQ'd bf16 activation rows as the second. On
  SM90 Triton lowers it to a packed FP4 / FP8 -> bf16 conversion (a few byte-permute instructions per 8
  values), one bf16 multiply by the power-of-two scale (exact) and a bf16 MMA with the decoded weight
  in registers. A decode step is a weight stream, so the integer work per weight element is what the
  stream costs: the ``registers`` decode spends ~17 integer operations per FP4 value, about a tenth of
  HBM speed at the H200's integer rate; this one ~2-3.
* ``fp8`` (preferred for FP8 weights; MXFP4 ones run ``scaled``): no weight conversion at all, FP8 MMA per 32-wide
  K group with both scales applied to its result (``stream_fp8``); the activations quantised first.
* ``registers``: the earlier hand decode (nibble masks, exponent bits, fp32 scale multiply). Packed
  FP4 weights hold element 2i in the low nibble and 2i+1 in the high one; instead of interleaving the
  nibbles in registers, the activation is stored de-interleaved and each K step runs two MMAs (even
  columns x low nibbles, odd columns x high nibbles): the same products, summed in another order.

All multiply exactly the reference's numbers (every operand is exact in bf16 / e4m3); only the fp32
summation order differs.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.dequant_mx import as_bytes, chunk_bounds, e2m1_scaled, fp8_qdq_groups, store_split
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2
from redknot.kernels.triton.slice_sum import _slice_sum_tail, counters
from redknot.kernels.triton.stream_scaled import _scaled_mm, tile_of  # noqa: F401 (tile_of: public helper)

# Programs a split-K launch aims for (an H200 has 132 SMs; a few waves hide the load latency).
TARGET_PROGRAMS = 4 * 132
ROW_TILE = 16  # rows per program: the smallest MMA tile, fixed so that results are batch-invariant
# Up to this many activation rows the split-K kernel quantises its activation slices itself (one launch
# fewer; every program repeats a few hundred values of work), above it a separate ``qdq_bf16`` pass.
RAW_MAX_ROWS = 128
# Above this many output rows one K slice runs (row tiles alone fill the device, and the partials would
# cost more traffic than they save). Up to it the slice count depends on the weight shape only: decode
# batches (MoE up to 341 tokens at top-6, every dense linear on the split-K path) are batch-invariant.
SPLIT_MAX_ROWS = 2048
# With ``decode="scaled"`` the activations are quantised by a separate pass above this many rows (0: always):
# a program's dot needs 16+ rows, so in-kernel quantisation repeats the amax work for padded rows per
# weight tile, which costs more integer work than the weight decode itself.
SCALED_RAW_MAX_ROWS = 0
DECODES = ("scaled", "registers", "fp8")
DENSE_ROW_TILE_MAX = 128
# ``fp8`` streams of up to this many rows quantise the activations inside the stream (no separate launch;
# every program repeats the work for its 16+ padded rows); 0: always a separate ``act_quant_mx`` pass.
FP8_INKERNEL_QUANT_MAX_ROWS = 0
# Launch shape of a ``scaled`` stream when the caller gives none: weight columns per program, K step.
SCALED_BLOCK_N = 64
SCALED_BLOCK_K = 128
# K steps per slice at least (``scaled`` / ``fp8``): with the cheap decodes a program is a load pipeline,
# which fills and drains once per slice; at decode batches of 32+ the live expert tiles alone fill the
# device, and longer slices also halve the fp32 partials (``registers`` keeps 4).
SCALED_MIN_STEPS = 8
# The preferred decode of MXFP4 streams (``moe_mx.DECODE_TUNER``'s first candidate; dense FP8 streams:
# ``gemm_mx.LINEAR_DECODE_TUNER``); see the module docstring.
DECODE = "scaled"


@triton.jit
def _fp4_tile(b_ptr, sb_ptr, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """Low- and high-nibble halves [BN, BK/2] of a packed MXFP4 tile as bf16, scales folded in."""
    p = tl.load(b_ptr + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0).to(tl.int32)
    s = e8m0_decode(tl.load(sb_ptr + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None],
                            other=127))[:, :, None]
    lo = tl.reshape(p & 0xF, (BLOCK_N, BLOCK_K // 32, 16))
    hi = tl.reshape((p >> 4) & 0xF, (BLOCK_N, BLOCK_K // 32, 16))
    wlo = tl.reshape(e2m1_scaled(lo, s), (BLOCK_N, BLOCK_K // 2)).to(tl.bfloat16)
    whi = tl.reshape(e2m1_scaled(hi, s), (BLOCK_N, BLOCK_K // 2)).to(tl.bfloat16)
    return wlo, whi


@triton.jit
def _qdq_pair(xe, xo, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-32 FP8 QDQ of a row slice held as its even and odd columns [BM, BK/2] each (a group of 32
    columns is 16 even + 16 odd ones) -> the two halves as bf16 (exact values)."""
    ge = tl.reshape(xe, (BLOCK_M, BLOCK_K // 32, 16))
    go = tl.reshape(xo, (BLOCK_M, BLOCK_K // 32, 16))
    e = e8m0_exponent(tl.maximum(tl.max(tl.abs(ge), 2), tl.max(tl.abs(go), 2)), 448.0, 1e-4)[:, :, None]
    qe = tl.minimum(tl.maximum(ge * pow2(-e), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * pow2(e)
    qo = tl.minimum(tl.maximum(go * pow2(-e), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32) * pow2(e)
    return (tl.reshape(qe, (BLOCK_M, BLOCK_K // 2)).to(tl.bfloat16),
            tl.reshape(qo, (BLOCK_M, BLOCK_K // 2)).to(tl.bfloat16))


@triton.jit
def _mma(a, w, acc, SWAP: tl.constexpr):
    """acc + a · wᵀ ([BM, BK] x [BN, BK]); SWAP: the transposed product w · aᵀ into acc [BN, BM]."""
    if SWAP:
        out = tl.dot(w, tl.trans(a), acc)
    else:
        out = tl.dot(a, tl.trans(w), acc)
    return out


@triton.jit
def _splitk_mm(a_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr,
               tile_group_ptr, tile_row_ptr, tile_end_ptr, M, N, K, KSPLIT,
               stride_am, stride_ah, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ps, stride_pm,
               out_ptr, cnt_ptr, stride_om,
               W_FP4: tl.constexpr, WB: tl.constexpr, GATHER: tl.constexpr, GROUPED: tl.constexpr,
               DUAL: tl.constexpr, SWAP: tl.constexpr, A_RAW: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSE: tl.constexpr = 0, GROUP_N: tl.constexpr = 0):
    """K and KSPLIT are multiples of BLOCK_K (the host picks BLOCK_K so): no K masks in the loop, so the
    weight rows load as full 16-byte vectors. FUSE (a dense stream, no W3): the slice sum into ``out`` in this
    launch (``slice_sum``; 0: partials only). GROUP_N (an FP8 weight of G groups of GROUP_N rows, BLOCK_N dividing
    GROUP_N): output column n reads the activation columns [g·K, (g+1)·K) of group g = n // GROUP_N."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if GROUPED:
        grp = tl.load(tile_group_ptr + pid_m)
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
    else:
        grp = 0
        row0 = pid_m * BLOCK_M
        row_end = M
    if grp >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        if GATHER:
            arow = tl.load(rowid_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            arow = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        c64 = cols.to(tl.int64)
        if GROUP_N > 0:   # the column tile's group: its own K columns of the rows
            a_ptr = a_ptr + ((pid_n * BLOCK_N) // GROUP_N).to(tl.int64) * K
        bg = b_ptr + grp.to(tl.int64) * stride_bg
        sbg = sb_ptr + grp.to(tl.int64) * stride_sbg
        b3g = b3_ptr + grp.to(tl.int64) * stride_bg
        sb3g = sb3_ptr + grp.to(tl.int64) * stride_sbg
        k_lo = pid_s * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        if SWAP:  # weights as the MMA's first operand (decoded in registers), rows as its second
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k_step in range(k_lo, k_hi, BLOCK_K):
            k0 = tl.multiple_of(k_step, BLOCK_K)
            gs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            if W_FP4:  # activations de-interleaved: half 0 = even K columns, half 1 = odd
                kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2),
                                       BLOCK_K // 2)
                if A_RAW:  # raw bf16 rows: even / odd columns, quantised here (group g = halves' 16g..16g+15)
                    xe = tl.load(a_ptr + arow[:, None] * stride_am + 2 * kh[None, :], mask=rmask[:, None],
                                 other=0.0).to(tl.float32)
                    xo = tl.load(a_ptr + arow[:, None] * stride_am + 2 * kh[None, :] + 1, mask=rmask[:, None],
                                 other=0.0).to(tl.float32)
                    ae, ao = _qdq_pair(xe, xo, BLOCK_M, BLOCK_K)
                else:
                    ae = tl.load(a_ptr + arow[:, None] * stride_am + kh[None, :], mask=rmask[:, None], other=0.0)
                    ao = tl.load(a_ptr + stride_ah + arow[:, None] * stride_am + kh[None, :], mask=rmask[:, None],
                                 other=0.0)
                wlo, whi = _fp4_tile(bg, sbg, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                acc = _mma(ae, wlo, acc, SWAP)
                acc = _mma(ao, whi, acc, SWAP)
                if DUAL:
                    w3lo, w3hi = _fp4_tile(b3g, sb3g, c64, cmask, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                    acc3 = _mma(ae, w3lo, acc3, SWAP)
                    acc3 = _mma(ao, w3hi, acc3, SWAP)
            else:  # FP8 weight, E8M0 per WB x WB tile
                kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
                a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
                if A_RAW:
                    a = fp8_qdq_groups(a.to(tl.float32), BLOCK_M, BLOCK_K).to(tl.bfloat16)
                w = tl.load(bg + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
                s = tl.load(sbg + (cols // WB).to(tl.int64)[:, None] * stride_sbn + (gs * 32 // WB)[None, :],
                            mask=cmask[:, None], other=127)
                w = tl.reshape(tl.reshape(w.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * e8m0_decode(s)[:, :, None],
                               (BLOCK_N, BLOCK_K)).to(tl.bfloat16)
                acc = _mma(a, w, acc, SWAP)
        if SWAP:
            acc = tl.trans(acc)
            acc3 = tl.trans(acc3)
        out = pid_s.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
        omask = rmask[:, None] & cmask[None, :]
        if FUSE != 2:
            tl.store(p_ptr + out, acc, mask=omask)
        if DUAL:
            tl.store(p3_ptr + out, acc3, mask=omask)
        if FUSE != 0:
            _slice_sum_tail(acc, p_ptr, out_ptr, cnt_ptr, pid_m * tl.num_programs(1) + pid_n, rows, cols, omask,
                            stride_ps, stride_pm, stride_om, FUSE)


def dense_row_tile(rows: int) -> int:
    """Row tile of a dense ``scaled`` stream: the rows' power of two, 16 to ``DENSE_ROW_TILE_MAX``. Every
    row tile decodes the whole weight, so up to 128 rows one tile does it once. (A row's products and
    their K order do not depend on the tile's width: each output of the MMA is its own dot product.)"""
    return min(DENSE_ROW_TILE_MAX, max(ROW_TILE, next_pow2(rows)))


def block_k_for(K: int, w_fp4: bool, block_k: int = 0) -> int:
    """The K step: the largest power of two up to ``block_k`` (default 128 FP4 / 128 FP8) that divides K
    (K is a multiple of 32), so that no step needs a K mask."""
    bk = block_k or 128
    while K % bk:
        bk //= 2
    return bk


def split_count(N: int, K: int, block_n: int, block_k: int, min_steps: int = 4) -> int:
    """K slices for an [N, K] weight: enough programs for the device from the column tiles alone, each
    slice at least ``min_steps`` K steps (a program's load pipeline fills and drains once per slice). A
    function of the weight shape only (batch invariance)."""
    n_tiles = cdiv(N, block_n)
    return max(1, min(cdiv(TARGET_PROGRAMS, n_tiles), K // (min_steps * block_k)))


@triton.jit
def _tile_map_kernel(offs_ptr, group_ptr, row0_ptr, end_ptr, G, bound, BLOCK_M: tl.constexpr,
                     G_POW2: tl.constexpr, BLOCK_J: tl.constexpr):
    g = tl.arange(0, G_POW2)
    gmask = g < G
    ends = tl.load(offs_ptr + g, mask=gmask, other=0)
    starts = tl.load(offs_ptr + g - 1, mask=gmask & (g > 0), other=0)
    tiles = tl.where(gmask, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, 0)  # tiles of groups 0..g
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    # group of tile j = number of groups whose cumulative tile count is <= j (searchsorted, right)
    grp = tl.sum((cum[None, :] <= j[:, None]).to(tl.int32) * gmask[None, :].to(tl.int32), 1)
    valid = grp < G
    sel = (g[None, :] == grp[:, None]).to(tl.int32)  # one-hot of the tile's group
    g_start = tl.sum(sel * starts[None, :], 1)
    g_end = tl.sum(sel * ends[None, :], 1)
    g_first = tl.sum(sel * (cum - tiles)[None, :], 1)
    jm = j < bound
    tl.store(group_ptr + j, tl.where(valid, grp, -1), mask=jm)
    tl.store(row0_ptr + j, g_start + (j - g_first) * BLOCK_M, mask=jm)
    tl.store(end_ptr + j, g_end, mask=jm)


def tile_map(offs: torch.Tensor, block_m: int, rows: int):
    """Per row tile (group, first row, group end) for rows grouped by ``offs`` (per-group ends, int32 on
    the device), from one kernel; tiles past the last are group -1. At most ``cdiv(rows, bm) +
    min(groups, rows)`` tiles (every non-empty group adds at most one partial tile), so a decode step
    launches few idle programs."""
    G = offs.numel()
    bound = cdiv(rows, block_m) + min(G, rows)
    out = torch.empty(3, bound, dtype=torch.int32, device=offs.device)
    bj = 32
    _tile_map_kernel[(cdiv(bound, bj),)](offs, out[0], out[1], out[2], G, bound, BLOCK_M=block_m,
                                         G_POW2=max(16, next_pow2(G)), BLOCK_J=bj, num_warps=4)
    return out[0], out[1], out[2], bound


def splitk_mm(a: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, rows: int, *, w_fp4: bool, wb: int = 32,
              rowid: Optional[torch.Tensor] = None, offs: Optional[torch.Tensor] = None,
              w3: Optional[torch.Tensor] = None, ws3: Optional[torch.Tensor] = None, block_m: int = ROW_TILE,
              block_n: int = 0, block_k: int = 0, splits: Optional[int] = None, num_warps: int = 4,
              tiles=None, swap: bool = False, raw: bool = False, decode: Optional[str] = None,
              num_stages: int = 3, out: torch.Tensor | None = None, group_n: int = 0):
    """fp32 partials [S, rows, N] (and the W3 ones when ``w3`` is given) of ``a · Wᵀ``.

    a: bf16 QDQ'd activations [R, K] (with ``decode="registers"`` and an MXFP4 weight: de-interleaved
    [2, R, K/2]), or with ``raw`` the bf16 rows [R, K] themselves, quantised per 32 inside the kernel
    (decode sizes); the output row r reads activation row ``rowid[r]`` (or r). w: e4m3 [N, K] with tiles
    of ``wb``, or packed [G, N, K/2] MXFP4 with [G, N, K/32] scales, rows grouped by ``offs`` (per-group
    ends; ``tiles``: its ``tile_map`` for ``block_m``, when the caller shares one between launches).
    ``decode``: ``scaled`` / ``registers`` / ``fp8`` (module docstring; None: ``DECODE``; ``fp8`` takes
    bf16 rows and quantises them to e4m3 first, and runs ``scaled`` for MXFP4 weights); ``swap``
    applies to ``registers`` (``scaled`` always holds the weight as the first operand). ``out`` [rows, N] (a
    dense weight, ``registers`` or ``fp8``): the slice sum too, in the stream launch (``slice_sum``: the bits of
    ``reduce_rows(partials, out)``), and ``out`` is returned instead of the partials. ``group_n`` (a dense FP8
    weight [G·group_n, K], ``registers``): a grouped product, output column n against activation columns
    ``[g·K, (g+1)·K)`` of ``a`` [R, G·K] for g = n // group_n (``torch.einsum("ngk,grk->ngr")``'s shape)."""
    decode = decode or DECODE
    if decode not in DECODES:
        raise ValueError(f"splitk_mm: decode={decode!r}: must be one of {DECODES}")
    if decode == "fp8" and (w_fp4 or offs is not None or rowid is not None):
        decode = "scaled"
    grouped = offs is not None
    w, ws = as_bytes(w), as_bytes(ws)
    w3d = w if grouped else w.unsqueeze(0)
    s3d = ws if grouped else ws.unsqueeze(0)
    N = w3d.shape[1]
    K = w3d.shape[2] * (2 if w_fp4 else 1)
    if K % 32:
        raise ValueError(f"splitk_mm: K={K} must be a multiple of 32")
    scaled = decode != "registers"
    block_n = block_n or (SCALED_BLOCK_N if scaled else 64)
    bk = block_k_for(K, w_fp4, block_k or (SCALED_BLOCK_K if scaled else 0))
    steps = SCALED_MIN_STEPS if scaled else 4
    S = splits or (split_count(N, K, block_n, bk, steps) if rows <= SPLIT_MAX_ROWS else 1)
    ksplit = cdiv(cdiv(K, S), bk) * bk
    S = cdiv(K, ksplit)
    dual = w3 is not None
    if out is not None and (grouped or dual or w_fp4 or decode == "scaled" or out.shape != (rows, N)
                            or out.stride(-1) != 1):
        raise ValueError("splitk_mm: out (the slice sum in the stream launch) is for a dense FP8 weight with the "
                         f"registers / fp8 decodes and an [rows, N] output; got decode={decode!r}")
    if group_n and (w_fp4 or grouped or dual or decode != "registers" or N % group_n or group_n % block_n
                    or a.shape[-1] != K * (N // group_n) or a.stride(-1) != 1):
        raise ValueError(f"splitk_mm: group_n={group_n} takes a dense FP8 weight with the registers decode, N a "
                         f"multiple of group_n and group_n of block_n={block_n}, and rows of G·K columns")
    p = torch.empty(S, rows, N, dtype=torch.float32, device=a.device)
    p3 = torch.empty_like(p) if dual else p
    if rows == 0:
        return (p, p3) if dual else (p if out is None else out)
    bm = block_m
    if decode == "fp8":  # FP8 MMA per 32-wide K group (``stream_fp8``)
        from redknot.kernels.triton.quant_mx import act_quant_mx
        from redknot.kernels.triton.stream_fp8 import fp8_stream
        inside = rows <= FP8_INKERNEL_QUANT_MAX_ROWS
        aq, sa = (a, None) if inside else act_quant_mx(a)
        return fp8_stream(aq, sa, w, ws, p, ksplit, wb, bm, block_n, num_warps=num_warps, out=out)
    inline = grouped and tiles is None and decode == "scaled"
    if inline:  # each program finds its tile (``tile_of``)
        n_tiles = cdiv(rows, bm) + min(offs.numel(), rows)
        tg = tr = te = p  # unused
    elif grouped:
        tg, tr, te, n_tiles = tiles if tiles is not None else tile_map(offs, bm, rows)
    else:
        n_tiles = cdiv(rows, bm)
        tg = tr = te = p  # unused
    a_m = a.stride(-2)
    w3g = as_bytes(w3) if dual else w3d
    s3g = as_bytes(ws3) if dual else s3d
    grid = (n_tiles, cdiv(N, block_n), S)
    if decode == "scaled":
        if not w_fp4:
            w3d = w3g = w3d.view(torch.uint8)  # dot_scaled reads e4m3 bytes
        G = offs.numel() if grouped else 1
        _scaled_mm[grid](
            a, rowid if rowid is not None else p, w3d, s3d, w3g, s3g, p, p3, tg, tr, te,
            offs if grouped else p, G, rows, N, K, ksplit,
            a_m, w3d.stride(0), w3d.stride(1), s3d.stride(0), s3d.stride(1), p.stride(0), p.stride(1),
            W_FP4=w_fp4, WB=wb, GATHER=rowid is not None, GROUPED=grouped, DUAL=dual, A_RAW=raw, BLOCK_M=bm,
            BLOCK_N=block_n, BLOCK_K=bk, TILE_INLINE=inline, G_POW2=max(16, next_pow2(G)), num_warps=num_warps,
            num_stages=num_stages)
        return (p, p3) if dual else p
    a_h = a.stride(0) if w_fp4 and not raw else 0
    fuse = 0 if out is None else (2 if S == 1 else 1)
    cnt = counters(p.device, grid[0] * grid[1]) if fuse == 1 else p
    _splitk_mm[grid](
        a, rowid if rowid is not None else p, w3d, s3d, w3g, s3g, p, p3, tg, tr, te, rows, N, K, ksplit,
        a_m, a_h, w3d.stride(0), w3d.stride(1), s3d.stride(0), s3d.stride(1), p.stride(0), p.stride(1),
        out if out is not None else p, cnt, out.stride(0) if out is not None else 0,
        W_FP4=w_fp4, WB=wb, GATHER=rowid is not None, GROUPED=grouped, DUAL=dual, SWAP=swap, A_RAW=raw, BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=bk, FUSE=fuse, GROUP_N=group_n, num_warps=num_warps, num_stages=num_stages)
    return (p, p3) if dual else (p if out is None else out)


@triton.jit
def _reduce_rows(p_ptr, out_ptr, M, N, S, stride_ps, stride_pm, stride_om, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = (rows[:, None] < M) & (cols[None, :] < N)
    off = rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in range(S):  # slice order 0..S-1
        acc += tl.load(p_ptr + s * stride_ps + off, mask=m, other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m)


def reduce_rows(p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = Σ_s p[s] in slice order, cast to out.dtype."""
    S, M, N = p.shape
    if M:
        bm, bn = 16, 256
        _reduce_rows[(cdiv(M, bm), cdiv(N, bn))](p, out, M, N, S, p.stride(0), p.stride(1), out.stride(0),
                                                BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


@triton.jit
def _reduce_swiglu(p_ptr, p3_ptr, wt_ptr, bounds_ptr, out_ptr, M, I, S, e0, e1, stride_ps, stride_pm, stride_om,
                   stride_oh, limit, CHUNK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    if CHUNK:  # rows of an expert chunk: count and routing-weight offset from the device bounds
        start, end = chunk_bounds(bounds_ptr, e0, e1)
        count = end - start
    else:
        start = 0
        count = M
    if tl.program_id(0) * BLOCK_M < count:  # a chunk's buffer is sized for every row: most programs idle
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < count
        m = rmask[:, None] & (cols[None, :] < I)
        off = rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
        g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for s in range(S):
            g += tl.load(p_ptr + s * stride_ps + off, mask=m, other=0.0).to(tl.float32)
            u += tl.load(p3_ptr + s * stride_ps + off, mask=m, other=0.0).to(tl.float32)
        g = tl.minimum(g.to(tl.bfloat16).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(u.to(tl.bfloat16).to(tl.float32), -limit), limit)
        wt = tl.load(wt_ptr + start + rows, mask=rmask, other=0.0)
        act = (g / (1.0 + tl.exp(-g)) * u * wt[:, None]).to(tl.bfloat16).to(tl.float32)
        v = fp8_qdq_groups(act, BLOCK_M, BLOCK_N).to(tl.bfloat16)
        store_split(out_ptr, rows.to(tl.int64), tl.program_id(1) * BLOCK_N, v, rmask, I, stride_om, stride_oh,
                    SPLIT, BLOCK_M, BLOCK_N)


def reduce_swiglu(p: torch.Tensor, p3: torch.Tensor, wt: torch.Tensor, limit: float, out: torch.Tensor, *,
                  split: bool, bounds: Optional[torch.Tensor] = None, e0: int = 0, e1: int = 0) -> torch.Tensor:
    """MoE W1 | W3 results (fp32 partials [S, M, I], or one bf16 [1, M, I] view each) -> the W2 input:
    ``QDQ_fp8(bf16(w · silu(min(g, L)) · clamp(u, ±L)))`` as bf16, [M, I] or de-interleaved [2, M, I/2].
    With ``bounds`` the rows are those of experts e0..e1-1 and their routing weights ``wt[start + r]``."""
    S, M, inter = p.shape
    if inter % 32:
        raise ValueError(f"reduce_swiglu: the expert width {inter} must be a multiple of 32")
    if M:
        bm = 16
        bn = 128 if inter % 128 == 0 else 32
        _reduce_swiglu[(cdiv(M, bm), cdiv(inter, bn))](
            p, p3, wt, bounds if bounds is not None else wt, out, M, inter, S, e0, e1, p.stride(0), p.stride(1),
            out.stride(-2), out.stride(0) if split else 0, float(limit), CHUNK=bounds is not None, SPLIT=split,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


@triton.jit
def _reduce_combine(p_ptr, inv_ptr, out_ptr, D, S, stride_ps, stride_pm, stride_o, K: tl.constexpr,
                    BLOCK_D: tl.constexpr):
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(K):  # slot order j = 0..k-1
        r = tl.load(inv_ptr + tok * K + j).to(tl.int64)
        y = tl.zeros([BLOCK_D], tl.float32)
        for s in range(S):  # slice order
            y += tl.load(p_ptr + s * stride_ps + r * stride_pm + cols, mask=mask, other=0.0).to(tl.float32)
        acc += y.to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_combine(p: torch.Tensor, inv: torch.Tensor, k: int, out: torch.Tensor) -> torch.Tensor:
    """out[t] = Σ_j bf16(Σ_s p[s, inv[t·k + j]]) in fp32, slot order (p: [S, T·k, D] partials or [1, T·k, D]
    bf16 slot results)."""
    T, D = out.shape
    if T:
        bd = min(1024, next_pow2(D))
        _reduce_combine[(T, cdiv(D, bd))](p, inv, out, D, p.shape[0], p.stride(0), p.stride(1), out.stride(0),
                                         K=k, BLOCK_D=bd, num_warps=4)
    return out
