"""The ``scaled`` split-K stream kernel (``splitk_mx``, ``decode="scaled"``): the weight tile decoded by
``tl.dot_scaled``, and ``tile_of``, a grouped launch's row tile computed inside each program.

``tl.dot_scaled`` takes the packed weight tile as its first operand (E2M1, or E4M3 with the E8M0 scales of
its 32-wide K groups gathered from the weight's b×b tiles) and the QDQ'd bf16 activation rows as its
second, both in natural K order. On SM90 Triton lowers it to a packed FP4 / FP8 -> bf16 conversion, one
bf16 multiply by the power-of-two scale (exact) and a bf16 MMA with the decoded weight in registers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from redknot.kernels.triton.dequant_mx import fp8_qdq_groups


@triton.jit
def tile_of(offs_ptr, G, j, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    """(group, first row, group end) of row tile j for rows grouped by ``offs`` (per-group ends), group -1
    past the last tile: one entry of ``tile_map``, computed where it is used."""
    g = tl.arange(0, G_POW2)
    gmask = g < G
    ends = tl.load(offs_ptr + g, mask=gmask, other=0)
    starts = tl.load(offs_ptr + g - 1, mask=gmask & (g > 0), other=0)
    tiles = tl.where(gmask, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    cum = tl.cumsum(tiles, 0)  # tiles of groups 0..g
    grp = tl.sum(((cum <= j) & gmask).to(tl.int32), 0)
    sel = g == grp
    start = tl.sum(tl.where(sel, starts, 0), 0)
    end = tl.sum(tl.where(sel, ends, 0), 0)
    first = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    return tl.where(grp < G, grp, -1), start + (j - first) * BLOCK_M, end


@triton.jit
def _scaled_mm(a_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr,
               tile_group_ptr, tile_row_ptr, tile_end_ptr, offs_ptr, G, M, N, K, KSPLIT,
               stride_am, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ps, stride_pm,
               W_FP4: tl.constexpr, WB: tl.constexpr, GATHER: tl.constexpr, GROUPED: tl.constexpr,
               DUAL: tl.constexpr, A_RAW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, TILE_INLINE: tl.constexpr, G_POW2: tl.constexpr):
    """``_splitk_mm`` with the weight decoded by ``tl.dot_scaled`` (weight tile [BN, BK] as the MMA's
    first operand, activation rows [BM, BK] transposed as its second, both in natural K order).
    TILE_INLINE: each program finds its row tile from the group ends (``tile_of``), no tile-map launch."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if GROUPED:
        if TILE_INLINE:
            grp, row0, row_end = tile_of(offs_ptr, G, pid_m, BLOCK_M, G_POW2)
        else:
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
        bg = b_ptr + grp.to(tl.int64) * stride_bg
        sbg = sb_ptr + grp.to(tl.int64) * stride_sbg
        b3g = b3_ptr + grp.to(tl.int64) * stride_bg
        sb3g = sb3_ptr + grp.to(tl.int64) * stride_sbg
        k_lo = pid_s * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k_step in range(k_lo, k_hi, BLOCK_K):
            k0 = tl.multiple_of(k_step, BLOCK_K)
            kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
            gs = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
            if A_RAW:
                a = fp8_qdq_groups(a.to(tl.float32), BLOCK_M, BLOCK_K)
            at = tl.trans(a.to(tl.bfloat16))
            if W_FP4:
                kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, BLOCK_K // 2), BLOCK_K // 2),
                                       BLOCK_K // 2)
                w = tl.load(bg + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
                s = tl.load(sbg + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None], other=127)
                acc = tl.dot_scaled(w, s, "e2m1", at, None, "bf16", acc=acc, fast_math=True)
                if DUAL:
                    w3 = tl.load(b3g + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
                    s3 = tl.load(sb3g + c64[:, None] * stride_sbn + gs[None, :], mask=cmask[:, None], other=127)
                    acc3 = tl.dot_scaled(w3, s3, "e2m1", at, None, "bf16", acc=acc3, fast_math=True)
            else:  # e4m3 weight, E8M0 per WB x WB tile: the scale of (row n, group g) is tile (n // WB, g*32 // WB)
                w = tl.load(bg + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0)
                s = tl.load(sbg + (cols // WB).to(tl.int64)[:, None] * stride_sbn + (gs * 32 // WB)[None, :],
                            mask=cmask[:, None], other=127)
                acc = tl.dot_scaled(w, s, "e4m3", at, None, "bf16", acc=acc, fast_math=True)
        out = pid_s.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * stride_pm + cols[None, :]
        omask = rmask[:, None] & cmask[None, :]
        tl.store(p_ptr + out, tl.trans(acc), mask=omask)
        if DUAL:
            tl.store(p3_ptr + out, tl.trans(acc3), mask=omask)
