"""MoE prefill on FP8 tensor cores (``MoePlan("fp8", ...)``, a ``moe_mx.PREFILL_TUNER`` candidate).

The prefill form of the FP8 decode stream (``moe_stream_fp8``): the (token, slot) pairs sorted by expert
(``moe_mx._sorted_pairs``: the routing kernel or the stable sort), the token rows quantised once to e4m3 +
E8M0 per 32 (``quant_mx.act_quant_mx``, the reference's activation format), then two grouped GEMMs whose
programs own one expert's ``block_m``-row tile (``splitk_mx.tile_map``, one map for both GEMMs) and
``block_n`` weight columns over all of K:

* K steps over 32-wide groups: the weight's packed FP4 bytes of the group are turned into e4m3 bytes in
  registers (``fp4_e4m3``: e2m1 · 2^-6, a few integer operations per 4 bytes), one FP8 MMA per group with
  the decoded weight tile as the first operand (it never goes to shared memory) and the rows' e4m3 group
  transposed as the second, and the group's fp32 result scaled by ``2^(s_w - 127 + 6) · 2^(s_a - 127)``
  (exact: powers of two) and added in K order: the reference's block-wise sum (§3.0), as the decode
  stream computes it;
* W1 | W3 in one program (the rows' group loaded once for both); its epilogue is the decode stream's
  ``EPI 1``: bf16 rounding, clamped SwiGLU, routing weight, bf16, then e4m3 + E8M0 per 32 columns (the W2
  input, one byte per element);
* W2 (rows in sorted order, no gather) with the bf16 slot epilogue; ``reduce_combine`` adds a token's k
  slots in slot order.

Launch shapes and forms are ``moe_mx.MoePlan`` fields (``decode``: ``fp8`` natural K order with E8M0 row
scales, ``fp8h`` halves order with fp32 row scales, ``fp8ht`` those scales transposed per sorted row,
``_prefetch`` suffixes load a group's scales one step ahead; ``bf16``: the same programs on bf16 tensor
cores, operands decoded exactly to bf16 with the scales folded in, one in-place MMA per 64-deep step; ``fp8f``:
``moe_prefill_fold``, the weight's scale folded into the decoded e4m3 values, one FFMA per accumulator element
and group, dispatched from ``prefill_inputs`` / ``prefill_gemm``).

Programs are numbered column block fastest, so the programs of one row tile (one expert's weights, one
set of token rows) run side by side and share the rows through L2; each touched expert's weights are read
once per row tile. Untouched experts are never read and nothing is decoded to memory (the ``grouped`` plan
writes every expert as bf16). No host sync; after the routing (and the activation quantisation): tile map, W1 | W3, W2,
combine.

Speed: not measured on the H200 yet (``benchmarks/kernels_v41.py --only prefill`` times every plan beside
``grouped`` and by part); the tuner keeps one only where it measures faster. Registers (ptxas, sm_90a): the
tuner's shapes compile without spills; each thread holds its accumulators, the rows' activation scales of
the group (BM / 8 per thread with 8 warps) and the MMA result being scaled. Instructions (sm_90a SASS, one
loop step = one group of the 128 x 64 W1 | W3 kernel with 8 warps, per thread): 369 in natural order with
E8M0 row scales (36 byte permutes, ~100 address instructions for the 16 per-row scale loads), 261 with
``fp8ht`` (halves order, transposed fp32 row scales), of which 128 are the fp32 scaling (64 FMUL, 64 FFMA)
that the two 64 x 128 x 32 MMAs need (two fp32 operations per accumulator element per 32-deep MMA: the
price of the reference's block order on tensor cores that accumulate without scales); the step's issue time
then exceeds its MMA time about fourfold.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional, Set

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.dequant_mx import as_bytes, fp8_qdq_groups
from redknot.kernels.triton.moe_stream import fp4_tile_bf16, swiglu_rows
from redknot.kernels.triton.moe_stream_fp8 import fp4_e4m3, swiglu_e4m3, use_asm
from redknot.kernels.triton.moe_stream_fp8h import fp4_e4m3_halves, halves
from redknot.kernels.triton.quant_mx import pow2
from redknot.kernels.triton.splitk_mx import tile_map


# Columns past the last sorted row in the transposed row scales (``fp8ht``): a last row tile reads them unclamped.
SAT_PAD = 256


@triton.jit
def _decode(b, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr, HALVES: tl.constexpr):
    """A group's packed bytes [BN, 16] -> e4m3 [BN, 32], in natural K order or in halves order."""
    if HALVES:
        return fp4_e4m3_halves(b, BLOCK_N, USE_ASM)
    return fp4_e4m3(b, BLOCK_N, USE_ASM)


@triton.jit
def _row_scale(v, HALVES: tl.constexpr):
    """The rows' activation scales as fp32: stored as fp32 powers of two (halves order) or E8M0 bytes."""
    if HALVES:
        return v
    return pow2(v.to(tl.int32) - 127)


@triton.jit
def _group_mma(acc, bg, sbg, at, sa, c_off, cs_off, k0, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
               HALVES: tl.constexpr):
    """acc + (the group's e4m3 weight columns [BN, 32] · at [32, BM]) · 2^(sb-127+6) · sa (columns clamped
    into the weight: no masks)."""
    kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, 16), 16), 16)
    b = tl.load(bg + (c_off[:, None] + kh[None, :]))
    sb = tl.load(sbg + (cs_off + k0 // 32)).to(tl.int32)
    d = tl.dot(_decode(b, BLOCK_N, USE_ASM, HALVES), at)
    return acc + d * (pow2(sb - 121)[:, None] * sa[None, :])


@triton.jit
def _group_mma_s(acc, bg, sb, at, sa, c_off, k0, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                 HALVES: tl.constexpr):
    """``_group_mma`` with the weight columns' E8M0 bytes of the group given (int32)."""
    kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, 16), 16), 16)
    b = tl.load(bg + (c_off[:, None] + kh[None, :]))
    d = tl.dot(_decode(b, BLOCK_N, USE_ASM, HALVES), at)
    return acc + d * (pow2(sb - 121)[:, None] * sa[None, :])


@triton.jit
def _tile_of_pid(tile_group_ptr, N, BLOCK_N: tl.constexpr):
    """(row tile, column block, expert) of this program: row tile ``pid // column blocks`` of the tile map,
    column block ``pid % column blocks``; expert -1 past the last tile."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    grp = tl.load(tile_group_ptr + pid_m)
    return pid_m, pid_n, grp


@triton.jit
def _tile_rows(tile_row_ptr, tile_end_ptr, rowid_ptr, pid_m, GATHER: tl.constexpr, BLOCK_M: tl.constexpr):
    """(first row, sorted rows, their mask, the token row each reads) of row tile ``pid_m``: rows past the
    tile's end read the tile's first row."""
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(tile_end_ptr + pid_m)
    rows = row0 + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    if GATHER:
        arow = tl.load(rowid_ptr + rows, mask=rmask, other=0)
        arow = tl.where(rmask, arow, tl.load(rowid_ptr + row0))
    else:
        arow = tl.where(rmask, rows, row0)
    return row0, rows, rmask, arow


@triton.jit
def _prefill_fp8_mm(a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, ps_ptr, wt_ptr,
                    tile_group_ptr, tile_row_ptr, tile_end_ptr, N, K, limit, stride_am, stride_sam, stride_bg,
                    stride_bn, stride_sbg, stride_sbn, stride_pm, stride_psm, stride_psg, GATHER: tl.constexpr,
                    DUAL: tl.constexpr, EPI: tl.constexpr, USE_ASM: tl.constexpr, WIDE: tl.constexpr,
                    WORDS: tl.constexpr, PREFETCH: tl.constexpr, HALVES: tl.constexpr, SAT: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """One program: row tile ``pid // column blocks`` of its expert x column block ``pid % column blocks``,
    all of K in steps of GROUPS 32-wide groups. WORDS (GROUPS 4): the E8M0 bytes of a step's four groups
    read as one 32-bit word per row / column, the next step's words loaded while this step runs; PREFETCH
    (GROUPS 1): the next group's scale bytes loaded while this group runs. SAT: the rows' scales transposed,
    [K/32, rows + SAT_PAD] in sorted row order (``stride_sam``: the group stride), so a tile's scales of a
    group are contiguous and unclamped (one base and immediate offsets instead of an address per row). EPI 1
    (needs DUAL): the W2 input, e4m3 [rows, N] + scales per 32 (element (row, group) at row · stride_psm +
    group · stride_psg); EPI 2: bf16 [rows, N]."""
    pid_m, pid_n, grp = _tile_of_pid(tile_group_ptr, N, BLOCK_N)
    if grp >= 0:
        # rows past the tile's end read the tile's first row and columns past N the last column (results
        # never stored): the K loop's loads need no masks; 32-bit offsets from 64-bit bases
        row0, rows, rmask, arow = _tile_rows(tile_row_ptr, tile_end_ptr, rowid_ptr, pid_m, GATHER, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        ccol = tl.minimum(cols, N - 1)
        c_off = ccol * stride_bn
        cs_off = ccol * stride_sbn
        bg = b_ptr + grp.to(tl.int64) * stride_bg
        sbg = sb_ptr + grp.to(tl.int64) * stride_sbg
        b3g = b3_ptr + grp.to(tl.int64) * stride_bg
        sb3g = sb3_ptr + grp.to(tl.int64) * stride_sbg
        if WIDE:  # row offsets past 2^31 bytes
            a_off = arow.to(tl.int64) * stride_am
        else:
            a_off = arow * stride_am
        if SAT:  # scale of (sorted row r, group j) at j · stride_sam + r; rows past the tile's end read padding
            sa_base = sa_ptr + row0  # a scalar base: the rows' offsets are constants per thread
            sa_off = tl.arange(0, BLOCK_M)
            sa_g = stride_sam
        else:
            sa_base = sa_ptr
            sa_off = arow.to(tl.int64) * stride_sam if WIDE else arow * stride_sam
            sa_g = 1
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        if WORDS:  # scale words: 4 groups per load, prefetched one step ahead (byte g of a word: group g)
            saw_ptr = sa_ptr.to(tl.pointer_type(tl.int32))
            sbw_g = sbg.to(tl.pointer_type(tl.int32))
            sb3w_g = sb3g.to(tl.pointer_type(tl.int32))
            sa_w = sa_off // 4
            cs_w = cs_off // 4
            saw = tl.load(saw_ptr + sa_w)
            sbw = tl.load(sbw_g + cs_w)
            sb3w = sbw
            if DUAL:
                sb3w = tl.load(sb3w_g + cs_w)
            for k_step in range(0, K, 128):
                nxt = tl.minimum(k_step + 128, K - 128) // 128
                saw_n = tl.load(saw_ptr + (sa_w + nxt))
                sbw_n = tl.load(sbw_g + (cs_w + nxt))
                sb3w_n = sbw_n
                if DUAL:
                    sb3w_n = tl.load(sb3w_g + (cs_w + nxt))
                for g in tl.static_range(4):
                    k0 = tl.multiple_of(k_step + 32 * g, 32)
                    kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
                    a = tl.load(a_ptr + (a_off[:, None] + kk[None, :]))
                    sa = pow2(((saw >> (8 * g)) & 0xFF) - 127)
                    at = tl.trans(a)
                    acc = _group_mma_s(acc, bg, (sbw >> (8 * g)) & 0xFF, at, sa, c_off, k0, BLOCK_N, USE_ASM,
                                       False)
                    if DUAL:
                        acc3 = _group_mma_s(acc3, b3g, (sb3w >> (8 * g)) & 0xFF, at, sa, c_off, k0, BLOCK_N,
                                            USE_ASM, False)
                saw = saw_n
                sbw = sbw_n
                sb3w = sb3w_n
        elif PREFETCH:  # one group per step, the next group's scale bytes loaded while this group runs
            sa_n = tl.load(sa_base + sa_off)
            sb_n = tl.load(sbg + cs_off).to(tl.int32)
            sb3_n = sb_n
            if DUAL:
                sb3_n = tl.load(sb3g + cs_off).to(tl.int32)
            for k_step in range(0, K, 32):
                k0 = tl.multiple_of(k_step, 32)
                sa_c = sa_n
                sb_c = sb_n
                sb3_c = sb3_n
                nxt = tl.minimum(k_step + 32, K - 32) // 32
                sa_n = tl.load(sa_base + nxt * sa_g + sa_off)
                sb_n = tl.load(sbg + (cs_off + nxt)).to(tl.int32)
                if DUAL:
                    sb3_n = tl.load(sb3g + (cs_off + nxt)).to(tl.int32)
                kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
                at = tl.trans(tl.load(a_ptr + (a_off[:, None] + kk[None, :])))
                sa = _row_scale(sa_c, HALVES)
                acc = _group_mma_s(acc, bg, sb_c, at, sa, c_off, k0, BLOCK_N, USE_ASM, HALVES)
                if DUAL:
                    acc3 = _group_mma_s(acc3, b3g, sb3_c, at, sa, c_off, k0, BLOCK_N, USE_ASM, HALVES)
        else:
            for k_step in range(0, K, 32 * GROUPS):
                for g in tl.static_range(GROUPS):
                    k0 = tl.multiple_of(k_step + 32 * g, 32)
                    kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
                    a = tl.load(a_ptr + (a_off[:, None] + kk[None, :]))
                    sa = _row_scale(tl.load(sa_base + (k0 // 32) * sa_g + sa_off), HALVES)
                    at = tl.trans(a)  # the rows' group, shared by W1 and W3
                    acc = _group_mma(acc, bg, sbg, at, sa, c_off, cs_off, k0, BLOCK_N, USE_ASM, HALVES)
                    if DUAL:
                        acc3 = _group_mma(acc3, b3g, sb3g, at, sa, c_off, cs_off, k0, BLOCK_N, USE_ASM, HALVES)
        r64 = rows.to(tl.int64)
        omask = rmask[:, None] & cmask[None, :]
        if EPI == 1:  # moe_stream_fp8 EPI 1: e4m3 + E8M0 per 32 of bf16(w · silu(min(g, L)) · clamp(u, ±L))
            q, e = swiglu_e4m3(acc, acc3, wt_ptr, rows, rmask, limit, BLOCK_M, BLOCK_N)
            gs = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            smask = rmask[:, None] & (gs[None, :] * 32 < N)
            if HALVES:  # the W2 input in halves order with fp32 scales (its K groups are these column groups)
                tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], halves(q, BLOCK_M, BLOCK_N), mask=omask)
                tl.store(ps_ptr + r64[:, None] * stride_psm + gs[None, :] * stride_psg, pow2(e), mask=smask)
            else:
                tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], q, mask=omask)
                tl.store(ps_ptr + r64[:, None] * stride_psm + gs[None, :] * stride_psg, (e + 127).to(tl.uint8),
                         mask=smask)
        else:
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], tl.trans(acc).to(tl.bfloat16), mask=omask)


def prefill_gemm_fp8(aq, sa, w, ws, rows: int, plan, *, offs, rowid=None, w3=None, ws3=None, wt=None,
                     limit: float = 0.0, tiles=None):
    """One grouped GEMM over MXFP4 experts ``w`` [G, N, K/2] (E8M0 ``ws`` [G, N, K/32]) for ``rows`` rows
    grouped by ``offs`` (per-expert ends); ``aq`` e4m3 [R, K] with E8M0 ``sa`` [R, K/32] (sorted row r reads
    ``rowid[r]``; ``tiles``: ``splitk_mx.tile_map(offs, plan.block_m, rows)`` when shared between launches).
    ``plan.decode``: ``fp8``, ``fp8_prefetch`` (with block_k 32: each group's scale bytes loaded one group
    ahead), ``fp8h`` / ``fp8h_prefetch`` (each K group in ``moe_stream_fp8h`` halves order: ``aq`` and the
    W2 input written so, row scales as fp32 powers of two; the weight decode needs no byte permutes),
    ``fp8ht`` / ``fp8ht_prefetch`` (``fp8h`` with the row scales ``sa`` [K/32, rows + ``SAT_PAD``] per sorted
    row, as the W2 input's scales are written; the padding is read for rows past a tile's end, never used). With
    ``w3``: W1 | W3 and the SwiGLU epilogue, returns (e4m3 [rows, N], its scales [rows, N/32]); without: bf16
    [rows, N]. ``plan``: ``moe_mx.MoePlan`` (block_m, block_n, block_k = 32 · groups per
    loop step, num_warps, num_stages)."""
    w, ws = as_bytes(w), as_bytes(ws)
    N, K = w.shape[1], w.shape[2] * 2
    if K % 32:
        raise ValueError(f"prefill_gemm_fp8: K={K} must be a multiple of 32")
    dual = w3 is not None
    bm, bn = plan.block_m, plan.block_n
    if dual and bn % 32:
        raise ValueError(f"MoePlan.block_n={bn}: the fused SwiGLU quantises per 32 columns (a multiple of 32)")
    groups = max(1, plan.block_k // 32)
    while K % (32 * groups):
        groups //= 2
    s3 = as_bytes(ws3) if dual else ws
    halves_k = plan.decode.startswith("fp8h")
    sat = plan.decode.startswith("fp8ht")
    if halves_k != (sa.dtype == torch.float32):
        raise ValueError(f"prefill_gemm_fp8: decode {plan.decode!r} takes {'fp32' if halves_k else 'E8M0'} "
                         "row scales")
    if sat and (sa.shape[0] != K // 32 or sa.shape[1] < rows + SAT_PAD or sa.stride(1) != 1):
        raise ValueError(f"prefill_gemm_fp8: decode {plan.decode!r} takes row scales [K/32, rows + {SAT_PAD}] "
                         f"(sorted rows, padded), got {tuple(sa.shape)}")
    # 32-bit scale words (block_k 128): each row's / column's scale bytes start on a 4-byte boundary
    words = not halves_k and groups == 4 and all(
        t.stride(-2) % 4 == 0 and t.stride(0) % 4 == 0 and t.data_ptr() % 4 == 0 for t in (sa, ws, s3))
    dev = aq.device
    if dual:
        p = torch.empty(rows, N, dtype=torch.float8_e4m3fn, device=dev)
        ps = torch.empty((cdiv(N, 32), rows + SAT_PAD) if sat else (rows, cdiv(N, 32)),
                         dtype=torch.float32 if halves_k else torch.uint8, device=dev)
        if sat:
            ps[:, rows:].zero_()  # the padding a last row tile reads: finite scales for its unused rows
    else:
        p, ps = torch.empty(rows, N, dtype=torch.bfloat16, device=dev), None
    result = (p, ps) if dual else p
    if rows == 0:
        return result
    tg, tr, te, n_tiles = tiles if tiles is not None else tile_map(offs, bm, rows)  # programs past the tiles exit
    w3g = as_bytes(w3) if dual else w
    s3g = as_bytes(ws3) if dual else ws
    _prefill_fp8_mm[(n_tiles * cdiv(N, bn),)](
        aq, sa, rowid if rowid is not None else offs, w, ws, w3g, s3g, p, ps if ps is not None else p,
        wt if wt is not None else p, tg, tr, te, N, K, float(limit), aq.stride(0), sa.stride(0), w.stride(0),
        w.stride(1), ws.stride(0), ws.stride(1), p.stride(0), (ps.stride(1 if sat else 0)) if ps is not None else 0,
        (ps.stride(0 if sat else 1)) if ps is not None else 0,
        GATHER=rowid is not None, DUAL=dual, EPI=1 if dual else 2, USE_ASM=use_asm(dev),
        WIDE=aq.numel() >= 2**31, WORDS=words, PREFETCH=groups == 1 and plan.decode.endswith("_prefetch"),
        HALVES=halves_k, SAT=sat, BLOCK_M=bm, BLOCK_N=bn, GROUPS=groups,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return result


@triton.jit
def _prefill_bf16_mm(a_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, wt_ptr, tile_group_ptr, tile_row_ptr,
                     tile_end_ptr, N, K, limit, stride_am, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_pm,
                     GATHER: tl.constexpr, DUAL: tl.constexpr, EPI: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_prefill_fp8_mm`` on bf16 tensor cores (``decode="bf16"``): the token rows as their exact per-32 FP8 QDQ
    values in bf16, the weight tile decoded to bf16 with its scales folded in (``moe_stream.fp4_tile_bf16``:
    e2m1 · 2^s is exact in bf16), one MMA per BLOCK_K accumulating in place (no scaling between MMAs; the
    same exact products, summed in another order). EPI 1: the W2 input as bf16 QDQ values; EPI 2: bf16."""
    pid_m, pid_n, grp = _tile_of_pid(tile_group_ptr, N, BLOCK_N)
    if grp >= 0:
        _, rows, rmask, arow = _tile_rows(tile_row_ptr, tile_end_ptr, rowid_ptr, pid_m, GATHER, BLOCK_M)
        a_off = arow.to(tl.int64) * stride_am if WIDE else arow * stride_am
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        c64 = tl.minimum(cols, N - 1).to(tl.int64)
        ones = cmask | True  # the clamped columns need no mask
        bg = b_ptr + grp.to(tl.int64) * stride_bg
        sbg = sb_ptr + grp.to(tl.int64) * stride_sbg
        b3g = b3_ptr + grp.to(tl.int64) * stride_bg
        sb3g = sb3_ptr + grp.to(tl.int64) * stride_sbg
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2), BLOCK_K // 2)
            gs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            at = tl.trans(tl.load(a_ptr + (a_off[:, None] + kk[None, :])))
            w = fp4_tile_bf16(bg, sbg, c64, ones, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
            acc = tl.dot(w, at, acc)
            if DUAL:
                w3 = fp4_tile_bf16(b3g, sb3g, c64, ones, kh, gs, stride_bn, stride_sbn, BLOCK_N, BLOCK_K)
                acc3 = tl.dot(w3, at, acc3)
        r64 = rows.to(tl.int64)
        omask = rmask[:, None] & cmask[None, :]
        if EPI == 1:  # QDQ_fp8(bf16(w · silu(min(g, L)) · clamp(u, ±L))) per 32 columns, as bf16
            act = swiglu_rows(acc, acc3, wt_ptr, rows, rmask, limit)
            v = fp8_qdq_groups(act, BLOCK_M, BLOCK_N).to(tl.bfloat16)
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], v, mask=omask)
        else:
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], tl.trans(acc).to(tl.bfloat16), mask=omask)


def prefill_gemm_bf16(a, w, ws, rows: int, plan, *, offs, rowid=None, w3=None, ws3=None, wt=None,
                      limit: float = 0.0, tiles=None):
    """``prefill_gemm_fp8`` for ``decode="bf16"``: ``a`` the rows' bf16 QDQ values [R, K]; returns the W2 input
    as bf16 QDQ values [rows, N] (with ``w3``) or bf16 [rows, N]."""
    w, ws = as_bytes(w), as_bytes(ws)
    N, K = w.shape[1], w.shape[2] * 2
    dual = w3 is not None
    bm, bn = plan.block_m, plan.block_n
    if dual and bn % 32:
        raise ValueError(f"MoePlan.block_n={bn}: the fused SwiGLU quantises per 32 columns (a multiple of 32)")
    bk = plan.block_k
    while K % bk:
        bk //= 2
    if bk < 32:
        raise ValueError(f"prefill_gemm_bf16: K={K} must be a multiple of 32")
    p = torch.empty(rows, N, dtype=torch.bfloat16, device=a.device)
    if rows == 0:
        return p
    tg, tr, te, n_tiles = tiles if tiles is not None else tile_map(offs, bm, rows)
    _prefill_bf16_mm[(n_tiles * cdiv(N, bn),)](
        a, rowid if rowid is not None else offs, w, ws, as_bytes(w3) if dual else w, as_bytes(ws3) if dual else ws,
        p, wt if wt is not None else p, tg, tr, te, N, K, float(limit), a.stride(0), w.stride(0), w.stride(1),
        ws.stride(0), ws.stride(1), p.stride(0), GATHER=rowid is not None, DUAL=dual, EPI=1 if dual else 2,
        WIDE=a.numel() >= 2**31, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    return p


def prefill_gemm(aq, sa, w, ws, rows: int, plan, **kw):
    """``prefill_gemm_fp8``, or for ``decode="bf16"`` ``prefill_gemm_bf16`` (``sa`` None; with ``w3`` it returns
    (the W2 input, None))."""
    if plan.decode == "fp8f":  # the weight scales folded into the decode (``moe_prefill_fold``)
        from redknot.kernels.triton.moe_prefill_fold import prefill_gemm_fold
        return prefill_gemm_fold(aq, sa, w, ws, rows, plan, **kw)
    if plan.decode != "bf16":
        return prefill_gemm_fp8(aq, sa, w, ws, rows, plan, **kw)
    out = prefill_gemm_bf16(aq, w, ws, rows, plan, **kw)
    return (out, None) if kw.get("w3") is not None else out


def prefill_inputs(x, topk_idx, topk_weight, experts: int, plan):
    """(token row per sorted pair, sorted position per pair, per-expert ends, routing weight per sorted pair,
    e4m3 token rows, their scales) in the form ``plan.decode`` reads: natural K order with E8M0 bytes, halves
    order with fp32 scales (``fp8h``), or those scales per sorted pair transposed and padded (``fp8ht``);
    ``bf16``: the rows' bf16 QDQ values and None."""
    from redknot.kernels.triton.moe_mx import _sorted_pairs
    if plan.decode == "fp8f":  # quads order, fp32 row scales transposed (``moe_prefill_fold``)
        from redknot.kernels.triton.moe_prefill_fold import fold_inputs
        return fold_inputs(x, topk_idx, topk_weight, experts)
    if plan.decode == "bf16":  # the rows' bf16 QDQ values, no scales
        return _sorted_pairs(topk_idx, topk_weight, experts, x) + (None,)
    rows, inv, offs, wt, xq, xs = _sorted_pairs(topk_idx, topk_weight, experts, x, fp8=True,
                                                halves=plan.decode.startswith("fp8h"))
    if plan.decode.startswith("fp8ht"):  # the row scales per sorted pair, transposed: [D/32, T·k + pad]
        M = rows.numel()
        xs_t = torch.empty(xs.shape[1], M + SAT_PAD, dtype=xs.dtype, device=xs.device)
        xs_t[:, :M] = xs.index_select(0, rows).t()
        xs_t[:, M:].zero_()
        xs = xs_t
    return rows, inv, offs, wt, xq, xs


def moe_prefill_fp8(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
                    plan) -> torch.Tensor:
    """``moe_mx`` through the FP8 grouped GEMMs (module docstring): sorted pairs and the token rows' e4m3 +
    E8M0 (one routing kernel up to ``moe_mx.ROUTE_KERNEL_MAX_PAIRS`` pairs, else the sort and
    ``act_quant_mx``), W1 | W3 + SwiGLU, W2, slot combine. No host sync."""
    from redknot.kernels.triton.splitk_mx import reduce_combine
    T, k = topk_idx.shape
    E, D = w1.shape[0], w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    M = T * k
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, inv, offs, wt, xq, xs = prefill_inputs(x, topk_idx, topk_weight, E, plan)
    tiles = tile_map(offs, plan.block_m, M)  # one map for both GEMMs
    aq, sa = prefill_gemm(xq, xs, w1, w1_scale, M, plan, offs=offs, rowid=rows, w3=w3, ws3=w3_scale, wt=wt,
                          limit=swiglu_limit, tiles=tiles)
    y = prefill_gemm(aq, sa, w2, w2_scale, M, plan, offs=offs, tiles=tiles)
    return reduce_combine(y[None], inv, k, out)


# First use per plan on a CUDA device: the plan against the ``grouped`` plan (bf16 experts, library GEMM: an
# independent implementation) on fresh random experts; bf16 roundings of differently ordered fp32 sums
# differ by an ulp here and there, a wrong decode or epilogue is off by O(1).
CHECK_TOL = 2e-2
_CHECKED: Set = set()


def self_check(plan, device: torch.device, seed: int = 4321) -> Optional[str]:
    """None when ``plan`` computes what ``moe_mx.moe_grouped`` computes (within ``CHECK_TOL``) on fresh
    random MXFP4 experts with uneven rows per expert and an empty expert, else what differs."""
    from redknot.kernels.triton.moe_mx import moe_grouped
    from redknot.kernels.triton.stream_guard import random_moe
    g = torch.Generator(device=device).manual_seed(seed)
    # (``fp8f``: an intermediate size that is a multiple of 128, as at V4.1 sizes: its W2 launch then takes the
    # 4-group step with scale words)
    E, D, inter, T, k = 5, 256, 256 if plan.decode == "fp8f" else 192, 40, 2
    packed, x = random_moe(g, device, E, D, inter, T)
    # skewed counts; the last expert empty
    pick = torch.rand(T, E - 1, generator=g, device=device) * torch.arange(1, E, device=device)
    idx = pick.topk(k, -1).indices
    wt = torch.rand(T, k, generator=g, device=device) + 0.1
    got = moe_prefill_fp8(x, idx, wt, *packed, 10.0, plan)
    want = moe_grouped(x, idx, wt, *packed, 10.0)
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    return None if err <= CHECK_TOL else f"differs from the grouped plan by {err:.3g} (tolerance {CHECK_TOL:g})"


def guarded(plan, device: torch.device, fast, fallback):
    """``fast()`` unless ``plan`` failed its build or ``self_check`` on this CUDA device (recorded in
    ``stream_guard.DECODE_ERRORS``, which the benchmarks print; then ``fallback()``)."""
    from redknot.kernels.triton import stream_guard
    if device.type != "cuda":
        return fast()
    errors: Dict = stream_guard.DECODE_ERRORS

    def fail(key, err):
        errors[key] = err
        warnings.warn(f"moe_prefill_fp8: plan {key} is not used on this device ({err}); running 'grouped'")
    return stream_guard.first_use(plan, _CHECKED, errors, lambda: self_check(plan, device), fast, fallback, fail)
