"""The fused FP8 MoE decode stream with each 32-wide K group in "halves" order (``StreamPlan(decode="fp8h")``).

``moe_stream_fp8`` decodes a group's 16 packed bytes into e4m3 in natural K order: element 2i is byte i's low
nibble, 2i+1 its high nibble. The FP8 MMA's register operand gives a thread K elements 4c..4c+3 of a row, which
come from two bytes: the compiled kernel reads the weight bytes two at a time from shared memory and spends
about as many byte permutes (PRMT) as decode instructions interleaving low and high nibbles (sm_90a SASS of
the 64x128 W2 kernel: 72 PRMT, 72 LOP3 and ~140 integer address instructions per 4-group loop step).

A group's dot product does not depend on the order of its 32 products' K positions as long as both operands
use the same order. Here both use the "halves" order: position p < 16 holds K element 2p (the low nibble of
byte p), position 16 + p holds K element 2p + 1 (the high nibble). Then the MMA operand's K elements 4c..4c+3
are the four low nibbles of bytes 4c..4c+3, one 32-bit word decoded by the word arithmetic of
``moe_stream_fp8`` (no permutes), and 16 + 4c.. its four high nibbles. The activation rows are written in that
order by their producers (``halves_order``: the routing kernel for the token rows, the W1 | W3 epilogue for the
W2 input), so the kernel loads them as they are. Each group's MMA still covers exactly its own 32 K elements,
and the groups' scaled fp32 results are added in K order per row as in ``moe_stream_fp8``.

Also per loop step (4 groups): the weight bytes of the 4 groups in one [BN, 64] load, and the E8M0 scales of
the 4 groups of a weight row in one 32-bit load instead of a byte load per group (loaded a step ahead; each
decoded to ``2^(s-127)`` by a shift and a mask). The activation rows' scales arrive as fp32 powers of two
(``scales_f32``; written so by the same producers), 16 bytes per row and step, used without decoding. Above
64 weight columns a program runs two 64-column blocks (own loads, scales and accumulators) against the same
activation groups. sm_90a SASS per 4-group loop step and warp (64 weight columns): W1 | W3 434 instructions
against 803 for ``fp8``, W2 269 against 512; ptxas: 128 / 96 registers, no spills.

``decode="fp8hd"`` (``_stream_fp8hd_mm``): at decode sizes an expert's 16-row tile holds one or two real rows,
yet every group's MMA result is scaled and added for all 16 columns (8 multiply-adds per thread and group, more
than the decode). Here a tile is 8 rows and one MMA per loop step covers the 4 groups: its B operand [128, 32]
is block-diagonal (column 8j + r holds row r's group j, zeros elsewhere; loaded by 16-byte copies that fill
the zeros), so result column 8j + r is group j's dot product for row r, and a thread holds all 4 groups of its
rows: each row's sum stays the K-order sum of the groups' scaled results, with 2 multiply-adds per thread and
group and one MMA wait per step. SASS per step: W1 | W3 332, W2 209; 161 / 96 registers. ``fp8hd4``: 4-row
tiles, 16 MMA columns (4 groups x 4 rows), 1 multiply-add per thread and group: W1 | W3 293, W2 189; 96 / 72
registers (an expert with more than 4 rows takes more tiles, which read its weights again, from L2 when the
adjacent programs run together). At 128 columns (two m64 MMAs per step) per 64 columns' worth: W1 | W3 244 /
W2 143 (``fp8hd4``), 282 / 163 (``fp8hd``); 164 / 115 and 226 / 146 registers. A column's MMA result depends
only on that column's operand (the other groups' zero columns add exact zeros), so a row's result does not
depend on the other rows (batch invariance).

``StreamPlan.block_k`` 256 / 512 (``fp8hd`` / ``fp8hd4``): U = 2 / up to 4 four-group steps per loop iteration
(``diag_unroll``), the body unrolled in K order (the bits of block_k 128), so a pipeline stage reads U x 64
contiguous bytes of each weight row instead of 64 (sm_90a at V4.1, W1 | W3: 258 / 248 SASS per 4-group step
against 293; not measured on a GPU when added).

Row tiles of 16 (``fp8h``; 8 / 4 for ``fp8hd`` / ``fp8hd4``) and the K slicing depend on the weight shape only
(batch invariance). The speed of these plans was not measured on the H200 when they were added.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.dequant_mx import as_bytes
from redknot.kernels.triton.moe_stream import stream_tile
from redknot.kernels.triton.moe_stream_fp8 import _HI_PTX, _LO_PTX, launch_stream
from redknot.kernels.triton.quant_mx import e8m0_exponent, pow2

DIAG_ROWS = {"fp8hd": 8, "fp8hd4": 4}  # rows per tile of the block-diagonal streams (MMA columns: 4 x rows)


def words_ok(ws: torch.Tensor) -> bool:
    """Whether the E8M0 weight scales ``ws`` [G, N, K/32] can be read as 32-bit words of 4 groups (aligned rows)."""
    return ws.data_ptr() % 4 == 0 and ws.stride(0) % 4 == 0 and ws.stride(1) % 4 == 0 and ws.stride(2) == 1


def scales_f32(s: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(s-127) (byte 0 -> 0.0, as ``quant_mx.pow2`` builds it): the row scales' form here."""
    return (s.to(torch.int32) << 23).view(torch.float32)


def halves_order(q: torch.Tensor) -> torch.Tensor:
    """e4m3 rows [R, K] (K % 32 == 0) in natural K order -> the same values in halves order: in each 32-wide
    group, the 16 even K elements, then the 16 odd ones (a copy)."""
    R, K = q.shape
    return q.view(R, K // 32, 16, 2).transpose(-1, -2).reshape(R, K)


@triton.jit
def halves(q, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] values (COLS % 32 == 0) in natural K order -> halves order (``halves_order``)."""
    return tl.reshape(tl.permute(tl.reshape(q, (ROWS, COLS // 32, 16, 2)), (0, 1, 3, 2)), (ROWS, COLS))


@triton.jit
def fp4_e4m3_halves(b, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed MXFP4 bytes [BN, 16] of one 32-wide K group -> e4m3 [BN, 32] in halves order (the 16 low nibbles,
    then the 16 high nibbles), each value the e2m1 value times 2^-6 (``moe_stream_fp8``)."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_LO_PTX, "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_HI_PTX, "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        lo = ((b & 0x08) << 4) | ((b & 0x07) << 2)
        hi = (b & 0x80) | ((b >> 2) & 0x1C)
    w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32))
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quarters(b, BLOCK_N: tl.constexpr):
    """[BN, 64] bytes (4 groups' packed weights of a row) -> the 4 groups' [BN, 16] tiles."""
    x = tl.permute(tl.reshape(b, (BLOCK_N, 2, 2, 16)), (0, 3, 1, 2))  # [BN, 16, i, j]: group 2i + j
    x0, x1 = tl.split(x)
    g0, g2 = tl.split(x0)
    g1, g3 = tl.split(x1)
    return g0, g1, g2, g3


@triton.jit
def _columns4(x, R: tl.constexpr):
    """[R, 4] -> its 4 columns [R] (the rows' scales of 4 groups)."""
    x0, x1 = tl.split(tl.reshape(x, (R, 2, 2)))  # x0: columns 0, 2; x1: columns 1, 3
    c0, c2 = tl.split(x0)
    c1, c3 = tl.split(x1)
    return c0, c1, c2, c3


@triton.jit
def _byte_pow2(words, g: tl.constexpr):
    """fp32 2^(byte g of ``words`` - 127) (the E8M0 scale bytes of 4 groups packed in int32 words; byte 0 gives
    0.0 for 2^-127)."""
    if g == 3:
        bits = (words >> 1) & 0x7F800000
    else:
        bits = (words << (23 - 8 * g)) & 0x7F800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _group(acc, b, at, fsa, sw, g: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """acc + (group g's e4m3 weight columns · at) · 2^(sw_g-127) · fsa (2^6 short: applied once at the end)."""
    d = tl.dot(fp4_e4m3_halves(b, BLOCK_N, USE_ASM), at)
    return acc + d * (_byte_pow2(sw, g)[:, None] * fsa[None, :])


@triton.jit
def _words(ptr, k, mask, EVEN: tl.constexpr):
    """The int32 scale words at ``ptr + k`` (4 groups' E8M0 bytes each), 127s where masked."""
    if EVEN:
        return tl.load(ptr + k)
    return tl.load(ptr + k, mask=mask, other=0x7F7F7F7F)


@triton.jit
def _bytes(ptr, k, mask, EVEN: tl.constexpr):
    """The [SUB_N, 64] weight bytes (4 groups) at ``ptr + k``, zeros where masked."""
    if EVEN:
        return tl.load(ptr + k)
    return tl.load(ptr + k, mask=mask[:, None], other=0)


@triton.jit
def _sub_cols(b_ptr, sb_ptr, grp, col0, N, stride_bg, stride_bn, stride_sbg, stride_sbn, SUB_N: tl.constexpr):
    """Columns, their mask, the weight-row pointers ([SUB_N, 64] bytes at K offset 0) and the int32 pointers of
    their scale rows for the weight columns col0 .. col0 + SUB_N of expert ``grp``."""
    cols = col0 + tl.arange(0, SUB_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    g64 = grp.to(tl.int64)
    wrow = b_ptr + g64 * stride_bg + c64[:, None] * stride_bn + tl.arange(0, 64)[None, :]
    # E8M0 bytes of 4 groups as one int32 (scale row strides and K slices are multiples of 4 groups)
    srow = (sb_ptr + g64 * stride_sbg + c64 * stride_sbn).to(tl.pointer_type(tl.int32))
    return cols, cmask, wrow, srow


@triton.jit
def _epilogue(acc, acc3, rows, rmask, cols, cmask, pid_s, N, limit, p_ptr, p3_ptr, ps_ptr, wt_ptr, stride_ps,
              stride_pm, stride_psm, DUAL: tl.constexpr, EPI: tl.constexpr, BLOCK_M: tl.constexpr,
              SUB_N: tl.constexpr):
    """EPI 0: fp32 partials at slice ``pid_s``; 1: SwiGLU + routing weight + bf16, then e4m3 (halves order) +
    its fp32 scale 2^e per 32; 2: bf16. ``acc`` / ``acc3``: [SUB_N, BLOCK_M] sums lacking the weights' 2^6."""
    acc = acc * 64.0  # the weights' e4m3 values are the e2m1 values times 2^-6 (exact: a power of two)
    r64 = rows.to(tl.int64)
    omask = rmask[:, None] & cmask[None, :]
    if EPI == 0:
        out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
        tl.store(p_ptr + out, tl.trans(acc), mask=omask)
        if DUAL:
            tl.store(p3_ptr + out, tl.trans(acc3 * 64.0), mask=omask)
    elif EPI == 1:
        g = tl.minimum(tl.trans(acc).to(tl.bfloat16).to(tl.float32), limit)
        u = tl.trans(acc3 * 64.0).to(tl.bfloat16).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        wt = tl.load(wt_ptr + rows, mask=rmask, other=0.0)
        act = (g / (1.0 + tl.exp(-g)) * u * wt[:, None]).to(tl.bfloat16).to(tl.float32)
        ag = tl.reshape(act, (BLOCK_M, SUB_N // 32, 32))
        e = e8m0_exponent(tl.max(tl.abs(ag), 2), 448.0, 1e-4)
        q = tl.reshape(ag * pow2(-e)[:, :, None], (BLOCK_M, SUB_N))
        q = halves(tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv), BLOCK_M, SUB_N)
        tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], q, mask=omask)
        gs = tl.min(cols, 0) // 32 + tl.arange(0, SUB_N // 32)
        tl.store(ps_ptr + r64[:, None] * stride_psm + gs[None, :], pow2(e),
                 mask=rmask[:, None] & (gs[None, :] * 32 < N))
    else:
        tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], tl.trans(acc).to(tl.bfloat16), mask=omask)


@triton.jit
def _stream_fp8h_mm(a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, ps_ptr, wt_ptr,
                    tile_group_ptr, tile_row_ptr, tile_end_ptr, offs_ptr, G, N, K, KSPLIT, limit,
                    stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ps, stride_pm,
                    stride_psm, GATHER: tl.constexpr, DUAL: tl.constexpr, EPI: tl.constexpr,
                    USE_ASM: tl.constexpr, TILE_INLINE: tl.constexpr, G_POW2: tl.constexpr,
                    EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, SUB_N: tl.constexpr, SUBS: tl.constexpr):
    """One program: an expert's row tile x SUBS x SUB_N weight columns (SUBS 1 or 2 column blocks, each with its
    own loads, scales and accumulators) x one K slice, 4 groups per loop step (activations in halves order,
    loaded once for the column blocks). The loads of the loop carry no row masks (a padding row reads a valid
    row; its results are never stored) and no column masks when the column blocks divide N (EVEN_N); the scale
    words of the next step are loaded one step ahead."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    grp, row0, row_end = stream_tile(offs_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, G, pid_m, TILE_INLINE,
                                     BLOCK_M, G_POW2)
    if grp >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        if GATHER:
            arow = tl.load(rowid_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            arow = tl.minimum(rows, row_end - 1).to(tl.int64)
        sarow = sa_ptr + arow[:, None] * stride_sam + tl.arange(0, 4)[None, :]  # fp32 scales of 4 groups
        arow_ptr = a_ptr + arow[:, None] * stride_am + tl.arange(0, 32)[None, :]
        col0 = pid_n * (SUB_N * SUBS)
        cols, cmask, wrow, srow = _sub_cols(b_ptr, sb_ptr, grp, col0, N, stride_bg, stride_bn, stride_sbg,
                                            stride_sbn, SUB_N)
        _, _, w3row, s3row = _sub_cols(b3_ptr, sb3_ptr, grp, col0, N, stride_bg, stride_bn, stride_sbg, stride_sbn,
                                       SUB_N)
        if SUBS == 2:
            cols_b, cmask_b, wrow_b, srow_b = _sub_cols(b_ptr, sb_ptr, grp, col0 + SUB_N, N, stride_bg, stride_bn,
                                                        stride_sbg, stride_sbn, SUB_N)
            _, _, w3row_b, s3row_b = _sub_cols(b3_ptr, sb3_ptr, grp, col0 + SUB_N, N, stride_bg, stride_bn,
                                               stride_sbg, stride_sbn, SUB_N)
        k_lo = pid_s * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        acc = tl.zeros([SUB_N, BLOCK_M], tl.float32)
        acc3 = tl.zeros([SUB_N, BLOCK_M], tl.float32)
        acc_b = tl.zeros([SUB_N, BLOCK_M], tl.float32)
        acc3_b = tl.zeros([SUB_N, BLOCK_M], tl.float32)
        sa_next = tl.load(sarow + k_lo // 32)
        sw_next = _words(srow, k_lo // 128, cmask, EVEN_N)
        sw3_next = sw_next
        sw_b_next = sw_next
        sw3_b_next = sw_next
        if DUAL:
            sw3_next = _words(s3row, k_lo // 128, cmask, EVEN_N)
        if SUBS == 2:
            sw_b_next = _words(srow_b, k_lo // 128, cmask_b, EVEN_N)
            if DUAL:
                sw3_b_next = _words(s3row_b, k_lo // 128, cmask_b, EVEN_N)
        for k_step in range(k_lo, k_hi, 128):
            kq = tl.multiple_of(k_step, 128)
            k_ahead = tl.minimum(kq + 128, k_hi - 128) // 128  # the last step reloads its own words
            sa = sa_next
            sa_next = tl.load(sarow + k_ahead * 4)
            fsa4 = _columns4(sa, BLOCK_M)
            sw = sw_next
            sw_next = _words(srow, k_ahead, cmask, EVEN_N)
            q = _quarters(_bytes(wrow, kq // 2, cmask, EVEN_N), SUB_N)
            if DUAL:
                sw3 = sw3_next
                sw3_next = _words(s3row, k_ahead, cmask, EVEN_N)
                q3 = _quarters(_bytes(w3row, kq // 2, cmask, EVEN_N), SUB_N)
            if SUBS == 2:
                sw_b = sw_b_next
                sw_b_next = _words(srow_b, k_ahead, cmask_b, EVEN_N)
                q_b = _quarters(_bytes(wrow_b, kq // 2, cmask_b, EVEN_N), SUB_N)
                if DUAL:
                    sw3_b = sw3_b_next
                    sw3_b_next = _words(s3row_b, k_ahead, cmask_b, EVEN_N)
                    q3_b = _quarters(_bytes(w3row_b, kq // 2, cmask_b, EVEN_N), SUB_N)
            for g in tl.static_range(4):
                at = tl.trans(tl.load(arow_ptr + (kq + 32 * g)))  # the rows' group, shared by every block
                acc = _group(acc, q[g], at, fsa4[g], sw, g, SUB_N, USE_ASM)
                if DUAL:
                    acc3 = _group(acc3, q3[g], at, fsa4[g], sw3, g, SUB_N, USE_ASM)
                if SUBS == 2:
                    acc_b = _group(acc_b, q_b[g], at, fsa4[g], sw_b, g, SUB_N, USE_ASM)
                    if DUAL:
                        acc3_b = _group(acc3_b, q3_b[g], at, fsa4[g], sw3_b, g, SUB_N, USE_ASM)
        _epilogue(acc, acc3, rows, rmask, cols, cmask, pid_s, N, limit, p_ptr, p3_ptr, ps_ptr, wt_ptr, stride_ps,
                  stride_pm, stride_psm, DUAL, EPI, BLOCK_M, SUB_N)
        if SUBS == 2:
            _epilogue(acc_b, acc3_b, rows, rmask, cols_b, cmask_b, pid_s, N, limit, p_ptr, p3_ptr, ps_ptr, wt_ptr,
                      stride_ps, stride_pm, stride_psm, DUAL, EPI, BLOCK_M, SUB_N)


@triton.jit
def fp4_e4m3_halves4(b, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed MXFP4 bytes [BN, 64] of 4 consecutive 32-wide K groups -> e4m3 [BN, 128], each group in halves
    order (``fp4_e4m3_halves`` of each group, concatenated in K)."""
    x = tl.reshape(b, (BLOCK_N, 4, 16))
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_LO_PTX, "=r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_HI_PTX, "=r,r", [x], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        lo = ((x & 0x08) << 4) | ((x & 0x07) << 2)
        hi = (x & 0x80) | ((x >> 2) & 0x1C)
    w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BLOCK_N, 128))
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _diag_rows(n, R: tl.constexpr):
    """(group j, row r) of column n of the block-diagonal operand: 8j + r for 8 rows; for 4 rows
    8(j // 2) + 2r + j % 2. Either way the wgmma accumulator gives a thread (columns 2c, 2c + 1 of each 8)
    all 4 groups of its rows, so each row's groups are added in K order inside the thread."""
    if R == 8:
        return n // 8, n % 8
    return 2 * (n // 8) + n % 2, (n % 8) // 2


@triton.jit
def _diag_step(acc, b, at, sw, fsa4, BLOCK_N: tl.constexpr, R: tl.constexpr, USE_ASM: tl.constexpr):
    """acc [BN, R] + the 4 groups of one loop step, in K order: one MMA of the 4 groups' e4m3 weight columns
    [BN, 128] with the block-diagonal activations ``at`` [128, 4R] (column ``_diag_col(j, r)`` holds row r's
    group j, zeros elsewhere), so that result column is group j's dot product for row r; each group's scaled by
    2^(sw_j-127) · fsa_j (the weights' 2^6 applied at the end)."""
    d = tl.dot(fp4_e4m3_halves4(b, BLOCK_N, USE_ASM), at)  # [BN, 4R], column ``_diag_col(j, r)``
    if R == 8:
        d = tl.permute(tl.reshape(d, (BLOCK_N, 4, R)), (0, 2, 1))  # [BN, r, j]
    else:
        d = tl.permute(tl.reshape(d, (BLOCK_N, 2, R, 2)), (0, 2, 1, 3))  # [BN, r, j // 2, j % 2]
    d0, d1, d2, d3 = _columns4(tl.reshape(d, (BLOCK_N * R, 4)), BLOCK_N * R)
    acc = acc + tl.reshape(d0, (BLOCK_N, R)) * (_byte_pow2(sw, 0)[:, None] * fsa4[0][None, :])
    acc = acc + tl.reshape(d1, (BLOCK_N, R)) * (_byte_pow2(sw, 1)[:, None] * fsa4[1][None, :])
    acc = acc + tl.reshape(d2, (BLOCK_N, R)) * (_byte_pow2(sw, 2)[:, None] * fsa4[2][None, :])
    return acc + tl.reshape(d3, (BLOCK_N, R)) * (_byte_pow2(sw, 3)[:, None] * fsa4[3][None, :])


@triton.jit
def _stream_fp8hd_mm(a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, ps_ptr, wt_ptr,
                     tile_group_ptr, tile_row_ptr, tile_end_ptr, offs_ptr, G, N, K, KSPLIT, limit,
                     stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ps, stride_pm,
                     stride_psm, GATHER: tl.constexpr, DUAL: tl.constexpr, EPI: tl.constexpr,
                     USE_ASM: tl.constexpr, TILE_INLINE: tl.constexpr, G_POW2: tl.constexpr,
                     EVEN_N: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr, U: tl.constexpr = 1):
    """``_stream_fp8h_mm`` with R-row tiles and one MMA per 4 groups against block-diagonal activations
    (``_diag_step``): the MMA's 4R columns carry 4 groups x R rows instead of 16 rows of one group, so 4 groups
    cost one MMA wait and R/2 scale multiply-adds per thread and group instead of 8. U: 4-group steps per loop
    iteration (the loop body unrolled U times, in K order: the same operations on the accumulators as U = 1), so
    one pipeline stage holds U x 64 contiguous bytes of each weight row."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    grp, row0, row_end = stream_tile(offs_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, G, pid_m, TILE_INLINE,
                                     R, G_POW2)
    if grp >= 0:
        rows = row0 + tl.arange(0, R)
        rmask = rows < row_end
        # the block-diagonal activation tile [4R, 128]: its row n holds row r's group j (``_diag_rows``)
        nb = tl.arange(0, 4 * R)
        jb, rb = _diag_rows(nb, R)
        rows_b = row0 + rb
        if GATHER:
            arow = tl.load(rowid_ptr + rows, mask=rmask, other=0).to(tl.int64)
            arow_b = tl.load(rowid_ptr + rows_b, mask=rows_b < row_end, other=0).to(tl.int64)
        else:
            arow = tl.minimum(rows, row_end - 1).to(tl.int64)
            arow_b = tl.minimum(rows_b, row_end - 1).to(tl.int64)
        kk = tl.arange(0, 128)
        bptr = a_ptr + arow_b[:, None] * stride_am + kk[None, :]
        bmask = (kk[None, :] // 32) == jb[:, None]
        sarow = sa_ptr + arow[:, None] * stride_sam + tl.arange(0, 4)[None, :]  # fp32 scales of 4 groups
        cols, cmask, wrow, srow = _sub_cols(b_ptr, sb_ptr, grp, pid_n * BLOCK_N, N, stride_bg, stride_bn,
                                            stride_sbg, stride_sbn, BLOCK_N)
        _, _, w3row, s3row = _sub_cols(b3_ptr, sb3_ptr, grp, pid_n * BLOCK_N, N, stride_bg, stride_bn, stride_sbg,
                                       stride_sbn, BLOCK_N)
        k_lo = pid_s * KSPLIT
        k_hi = tl.minimum(K, k_lo + KSPLIT)
        acc = tl.zeros([BLOCK_N, R], tl.float32)
        acc3 = tl.zeros([BLOCK_N, R], tl.float32)
        sa_next = tl.load(sarow + k_lo // 32)
        sw_next = _words(srow, k_lo // 128, cmask, EVEN_N)
        sw3_next = sw_next
        if DUAL:
            sw3_next = _words(s3row, k_lo // 128, cmask, EVEN_N)
        for k_iter in range(k_lo, k_hi, 128 * U):  # (k_hi - k_lo) % (128 U) == 0 (``diag_unroll``)
            for u in tl.static_range(U):
                kq = tl.multiple_of(k_iter + 128 * u, 128)
                k_ahead = tl.minimum(kq + 128, k_hi - 128) // 128  # the last step reloads its own words
                sa = sa_next
                sa_next = tl.load(sarow + k_ahead * 4)
                fsa4 = _columns4(sa, R)
                sw = sw_next
                sw_next = _words(srow, k_ahead, cmask, EVEN_N)
                at = tl.trans(tl.load(bptr + kq, mask=bmask, other=0.0))  # [128, 4R], shared by W1 and W3
                acc = _diag_step(acc, _bytes(wrow, kq // 2, cmask, EVEN_N), at, sw, fsa4, BLOCK_N, R, USE_ASM)
                if DUAL:
                    sw3 = sw3_next
                    sw3_next = _words(s3row, k_ahead, cmask, EVEN_N)
                    acc3 = _diag_step(acc3, _bytes(w3row, kq // 2, cmask, EVEN_N), at, sw3, fsa4, BLOCK_N, R,
                                      USE_ASM)
        _epilogue(acc, acc3, rows, rmask, cols, cmask, pid_s, N, limit, p_ptr, p3_ptr, ps_ptr, wt_ptr, stride_ps,
                  stride_pm, stride_psm, DUAL, EPI, R, BLOCK_N)


def diag_unroll(K: int, ksplit: int, block_k: int) -> int:
    """4-group steps per loop iteration of ``_stream_fp8hd_mm`` for ``StreamPlan.block_k``: the largest
    u <= block_k / 128 that divides the step count of every K slice (``ksplit`` each, the last one the rest of
    K), so a slice's loop never runs past its end (V4.1: W1 | W3 K = 5120, 40 steps: block_k 512 -> 4; W2
    K = 2304, 18 steps: 512 -> 3, 256 -> 2). A function of the weight shape and the plan only."""
    steps = ksplit // 128
    last = (K - (cdiv(K, ksplit) - 1) * ksplit) // 128
    return max(u for u in range(1, max(1, block_k // 128) + 1) if steps % u == 0 and last % u == 0)


def stream_gemm_fp8h(aq, sa, w, ws, rows: int, plan, *, offs, tiles, rowid=None, w3=None, ws3=None, wt=None,
                     limit: float = 0.0, epi: int = 0):
    """``moe_stream_fp8.stream_gemm_fp8`` with ``aq`` (e4m3 [R, K]) in halves order (``halves_order``) and its
    scales as fp32 powers of two ``sa`` [R, K/32] (``scales_f32``); epi 1 writes the W2 input in that form
    (e4m3 [rows, N] in halves order, fp32 [rows, N/32]). 4 groups per loop step; ``plan.block_k`` above 128
    (``fp8hd`` / ``fp8hd4`` only): up to block_k / 128 such steps per loop iteration (``diag_unroll``). K, the scale rows' strides and the K slices must be multiples of 128 / 4 / 128."""
    from redknot.kernels.triton.moe_stream import ROW_TILE, slices
    w, ws = as_bytes(w), as_bytes(ws)
    N, K = w.shape[1], w.shape[2] * 2
    if K % 128 or not words_ok(ws) or (w3 is not None and not words_ok(as_bytes(ws3))) or sa.dtype != torch.float32:
        raise ValueError(f"stream_gemm_fp8h: K={K} and the weight scale rows' strides must be multiples of "
                         f"128 / 4 (strides {tuple(ws.stride())}), the row scales fp32 (got {sa.dtype})")
    diag = plan.decode in DIAG_ROWS
    bn, bm = plan.block_n, DIAG_ROWS.get(plan.decode, ROW_TILE)
    if diag and bn > 128:
        raise ValueError(f"StreamPlan.block_n={bn}: the block-diagonal fp8hd streams run up to 128 columns")
    sub = bn if bn <= 64 else bn // 2  # column blocks of at most 64 (two above 64 columns)
    if epi == 1 and bn % 32:
        raise ValueError(f"StreamPlan.block_n={bn}: the fused SwiGLU quantises per 32 columns (a multiple of 32)")
    S = slices(N, K, plan) if epi == 0 else 1
    ksplit = cdiv(cdiv(K, S), 128) * 128
    S = cdiv(K, ksplit)
    kernel = _stream_fp8hd_mm if diag else _stream_fp8h_mm
    shape = {"R": bm, "BLOCK_N": bn} if diag else {"BLOCK_M": bm, "SUB_N": sub, "SUBS": bn // sub}
    if diag and plan.block_k > 128:
        shape["U"] = diag_unroll(K, ksplit, plan.block_k)
    return launch_stream(kernel, aq, sa, w, ws, rows, plan, offs=offs, tiles=tiles, rowid=rowid, w3=w3, ws3=ws3,
                         wt=wt, limit=limit, epi=epi, slices=S, ksplit=ksplit, block_m=bm,
                         scale_dtype=torch.float32, EVEN_N=N % bn == 0, **shape)
