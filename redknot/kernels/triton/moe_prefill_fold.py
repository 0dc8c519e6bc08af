"""MoE prefill on FP8 tensor cores with the weight's E8M0 scale folded into the decoded e4m3 values
(``MoePlan("fp8", ..., decode="fp8f")``, a ``moe_mx.PREFILL_TUNER`` candidate beside ``moe_prefill_fp8``'s).

``moe_prefill_fp8`` turns a group's FP4 bytes into ``e2m1 · 2^-6`` and scales each 32-wide group's fp32 MMA result
by ``2^(s_w - 121) · s_a``: per accumulator element and group one FMUL (the outer product of the column and row
scales) and one FFMA, 128 of the 261 sm_90a instructions per group of the 128 x 64 W1 | W3 ``fp8ht`` kernel.

Here the column's scale goes into the decoded weight: ``e2m1 · 2^d`` is an e4m3 value for every e2m1 code when
d is in [-8, 6] (0.5 · 2^-8 = 2^-9 is the smallest e4m3 subnormal, 6 · 2^6 = 384 <= 448), and for d in [-5, 6]
every nonzero code lands on a normal e4m3 number, so the code -> byte table is linear in d: for code c = 2..7 the
byte is ``4c + 8(d + 6)``, for c = 1 (0.5) ``8(d + 6)``, for 0 zero. Each program takes, per weight column, the
largest scale byte of the column over all of K as its base ``m`` and decodes group g with ``d = s_w(g) - m + 6``;
the group's MMA result is then ``2^(s_w - m + 12)`` times ``moe_prefill_fp8``'s (an exact power-of-two scaling of
exact products), and only the row scale remains per group: ``acc += d · s_a`` (one FFMA per element), with
``2^(m - 133)`` applied once after the K loop. Every step of the sum is the ``moe_prefill_fp8`` step scaled by
the column's power of two, so the rounding is the same: the result is bit for bit ``fp8ht``'s (same products,
same K order of the scaled group sums, one rounding per FFMA), up to fp32 overflow / subnormals that one form
meets and the other does not (|acc| here is ``2^(133 - m)`` times the other's).

Exactness needs every column's scale bytes within 11 of its base (d >= -5) over all of K, and a base of at
least 1 (``2^(m-127)`` is built from exponent bits). Each program checks that for its column block before the K
loop (per column max and min of the scale bytes, all of them in one load of 32-bit words where the rows are
4-byte aligned; W1 and W3 both) and records the answer per program; a second launch runs the programs that
could not fold with the per-group scaling of ``fp8ht`` (the table of ``e2m1 · 2^-6``, the column scale times
the row scale per group; the folded programs exit at once), so the result is exact either way, and each K
loop gets its own register allocation. (A range of 15 with subnormal tables would also cover d in [-8, -6];
the linear table keeps the decode at two IMADs per column and group.) The bases reach the K loop through a
[G, N] byte buffer (stored, barrier, loaded): taken straight from the reduction they would pin the decode to
the reduction's layout and send every decoded tile through shared memory.

Decode: a 32-bit word of packed FP4 (8 codes, K order) -> two words of e4m3 by byte permutes: ``prmt`` with the
codes' magnitude bits as selectors picks the bytes of the column's 8-byte table (``tlo``, ``thi``: two IMADs per
column and group from the scale byte; each byte the magnitude + 0x80), a second ``prmt`` with the signed codes as
selectors gives 0x40 for a positive code and 0x00 for a negative one (sign-replicate mode), one IMAD subtracts
twice that: 9 instructions per 8 values (the interpreter runs the same operations on words, ``_prmt``). Each
word's low 4 codes fill one register and its high 4 codes another, so a group's 32 K positions are in "quads"
order: position 4i + j holds K element 8i + j and position 16 + 4i + j element 8i + 4 + j (i, j < 4); the token
rows (``quads_order``) and the W2 input (the W1 | W3 epilogue) are written in that order, with their scales as
fp32 powers of two transposed per sorted row as ``fp8ht`` reads them. The MMA's register operand then takes
both words as they are.

sm_90a SASS per loop step (one 32-wide group) and thread, W1 | W3 / W2, at V4.1 sizes: 128 x 64, 8 warps 213 / 142
(``fp8ht``: 261 / 162), the W1 | W3 step without FMUL (64 FFMA, 16 PRMT + 16 LOP3 decode); W2 with block_k 128
(4 groups per step, the columns' scale bytes as one 32-bit word per 4 groups) 123. At block_k 128: 128 x 64,
4 warps (one warpgroup, 128 MMA columns per warp) 278 / 147; 128 x 128, 8 warps 319 / 175; 64 x 128, 8 warps
212 / 122. Registers 190 / 130, 255 / 255, 255 / 185, 195 / 101; no spills in the K loops but the 4-warp W2's
(2 LDL per 4-group step); 4 groups per step in W1 | W3 spill: one group there.
Speed: not measured on the H200 (``benchmarks/kernels_v41.py --only prefill``
times it beside the others).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2, sm_count
from redknot.kernels.triton.dequant_mx import as_bytes
from redknot.kernels.triton.moe_prefill_fp8 import SAT_PAD, _tile_rows
from redknot.kernels.triton.moe_stream_fp8 import swiglu_e4m3, use_asm
from redknot.kernels.triton.quant_mx import pow2

# Largest spread (base - scale byte) over K of a weight column that the folded decode takes exactly (d >= -5).
FOLD_SPAN = tl.constexpr(11)

# One word of 8 packed FP4 codes ($2), a column's tables ($3: bytes of codes 0-3, $7: codes 4-7, each byte the
# code's e4m3 magnitude + 0x80) and 0x40404040 ($11) -> the e4m3 bytes of codes 0-3 ($0) and 4-7 ($1). The first
# prmt picks the magnitudes (selector: the codes without their sign bits); the second, with the signed codes as
# selectors, gives 0x40 for a positive code and 0x00 for a negative one (a selector nibble's bit 3 replicates the
# selected byte's bit 7); magnitude + 0x80 - 2 * that is the signed byte (no borrow between bytes).
_QUAD_PTX = tl.constexpr(
    "{ .reg .b32 s, m, g, h; "
    "and.b32 s, $2, 0x7777; prmt.b32 m, $3, $7, s; prmt.b32 g, $11, $11, $2; mad.lo.s32 $0, g, -2, m; "
    "shr.b32 h, $2, 16; and.b32 s, h, 0x7777; prmt.b32 m, $3, $7, s; prmt.b32 g, $11, $11, h; "
    "mad.lo.s32 $1, g, -2, m; }")


def quads_order(q: torch.Tensor) -> torch.Tensor:
    """e4m3 rows [R, K] (K % 32 == 0) in natural K order -> the same values in quads order (module docstring; a
    copy)."""
    R, K = q.shape
    return q.view(R, K // 32, 4, 2, 4).transpose(2, 3).reshape(R, K)


@triton.jit
def quads(q, ROWS: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] values (COLS % 32 == 0) in natural K order -> quads order (``quads_order``)."""
    return tl.reshape(tl.permute(tl.reshape(q, (ROWS, COLS // 32, 4, 2, 4)), (0, 1, 3, 2, 4)), (ROWS, COLS))


@triton.jit
def _prmt(a, b, c):
    """PTX ``prmt.b32`` (default mode) on uint32 words [BN, W] (``a``, ``b`` [BN, 1] or [BN, W]): result byte i is
    byte ``c[4i+2:4i]`` of {b, a}, or that byte's bit 7 replicated when ``c[4i+3]`` is set (the interpreter's form
    of ``_QUAD_PTX``; the 4 result bytes side by side)."""
    i = tl.arange(0, 4)[None, None, :]
    nib = (c[:, :, None] >> (4 * i).to(tl.uint32)) & 0xF
    idx = nib & 7
    src = tl.where(idx < 4, a[:, :, None], b[:, :, None])
    byte = (src >> ((idx & 3) * 8)) & 0xFF
    rep = tl.where((byte & 0x80) != 0, 0xFF, 0).to(tl.uint32)
    return tl.sum(tl.where((nib & 8) != 0, rep, byte) << (8 * i).to(tl.uint32), 2)


@triton.jit
def _quad_words(w, tlo, thi, k):
    """``_QUAD_PTX`` on uint32 words: (e4m3 bytes of codes 0-3, of codes 4-7)."""
    lo = _prmt(tlo, thi, w & 0x7777) - 2 * _prmt(k, k, w)
    h = w >> 16
    hi = _prmt(tlo, thi, h & 0x7777) - 2 * _prmt(k, k, h)
    return lo, hi


@triton.jit
def _bytes_words(b, BLOCK_N: tl.constexpr):
    """uint8 [BN, 16] -> uint32 words [BN, 4] (little endian)."""
    x = tl.reshape(b.to(tl.uint32), (BLOCK_N, 4, 2, 2))  # [n, word, r, q]: byte 2r + q
    e, o = tl.split(x)
    b0, b2 = tl.split(e)
    b1, b3 = tl.split(o)
    return b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)


@triton.jit
def _words_bytes(w, BLOCK_N: tl.constexpr):
    """uint32 words [BN, 4] -> uint8 [BN, 16] (``_bytes_words`` inverted)."""
    e = tl.join(w & 0xFF, (w >> 16) & 0xFF)
    o = tl.join((w >> 8) & 0xFF, w >> 24)
    return tl.reshape(tl.join(e, o), (BLOCK_N, 16)).to(tl.uint8)


@triton.jit
def fp4_e4m3_quads(b, tlo, thi, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed MXFP4 bytes [BN, 16] of one 32-wide K group -> e4m3 [BN, 32] in quads order: code c of column n
    becomes byte c & 7 of (tlo[n], thi[n]) less 0x80, with c's sign (``tlo`` / ``thi`` uint32 [BN],
    ``_QUAD_PTX``; the interpreter runs the same operations on words). The PTX takes each pack of 4 bytes as one
    packed word (bytes 4c..4c+3 of a row, 8 codes in K order): the layout Triton 3.6 gives ``b`` at every
    ``fp8f`` tuner shape (TTGIR: register bases [0, 1], [0, 2] first); the first-use check and the GPU tests
    would catch a layout that grouped other bytes."""
    if USE_ASM:
        t0 = tl.broadcast_to(tlo[:, None], (BLOCK_N, 16))
        t1 = tl.broadcast_to(thi[:, None], (BLOCK_N, 16))
        k = tl.full((BLOCK_N, 16), 0x40404040, tl.uint32)
        lo, hi = tl.inline_asm_elementwise(_QUAD_PTX, "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r", [b, t0, t1, k],
                                           dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:  # lo[4i + j] = code 8i + j, hi[4i + j] = code 8i + 4 + j
        k = tl.full((BLOCK_N, 4), 0x40404040, tl.uint32)
        wl, wh = _quad_words(_bytes_words(b, BLOCK_N), tlo[:, None], thi[:, None], k)
        lo = _words_bytes(wl, BLOCK_N)
        hi = _words_bytes(wh, BLOCK_N)
    w = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_N, 32))
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _tables(sw, lo_add, hi_add):
    """The column tables (uint32 [BN]) for scale bytes ``sw`` (int32): code bytes ``0x80 + 4c + 8(sw + off)``
    (c >= 2), ``0x80 + 8(sw + off)`` (c = 1), 0x80 (c = 0), ``lo_add`` / ``hi_add`` carrying the column's offset."""
    s = sw.to(tl.uint32)
    return s * 0x08080800 + lo_add, s * 0x08080808 + hi_add


@triton.jit
def _col_range(sbg, cs_off, KG, BLOCK_N: tl.constexpr, CH: tl.constexpr):
    """Per weight column (int32 [BN]) the largest and smallest of its KG scale bytes."""
    mx = tl.zeros([BLOCK_N], tl.int32)
    mn = tl.full([BLOCK_N], 255, tl.int32)
    for j0 in range(0, KG, CH):
        j = j0 + tl.arange(0, CH)
        jm = (j < KG)[None, :]
        s = tl.load(sbg + (cs_off[:, None] + j[None, :]), mask=jm, other=0).to(tl.int32)
        mx = tl.maximum(mx, tl.max(s, 1))
        mn = tl.minimum(mn, tl.min(tl.where(jm, s, 255), 1))
    return mx, mn


@triton.jit
def _col_range_words(sbg, cs_off, KW, BLOCK_N: tl.constexpr, KW_POW2: tl.constexpr):
    """``_col_range`` for scale rows of 4-byte aligned KW words: every word of the block's columns loaded at once
    (one memory round trip instead of one per 32 groups)."""
    j = tl.arange(0, KW_POW2)
    jm = (j < KW)[None, :]
    wv = tl.load(sbg.to(tl.pointer_type(tl.int32)) + ((cs_off // 4)[:, None] + j[None, :]), mask=jm, other=0)
    b0 = wv & 0xFF
    b1 = (wv >> 8) & 0xFF
    b2 = (wv >> 16) & 0xFF
    b3 = (wv >> 24) & 0xFF
    mx = tl.max(tl.maximum(tl.maximum(b0, b1), tl.maximum(b2, b3)), 1)
    mn = tl.min(tl.where(jm, tl.minimum(tl.minimum(b0, b1), tl.minimum(b2, b3)), 255), 1)
    return mx, mn


@triton.jit
def _group_fold(acc, at, sa, b, sw, lo, hi, FOLD: tl.constexpr, USE_ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc + one group's MMA result times the rows' scales (FOLD: the tables carry the column's scale relative
    to its base), or times ``2^(s_w - 121) · s_a`` (the tables ``lo`` / ``hi`` of ``e2m1 · 2^-6``)."""
    if FOLD:
        t0, t1 = _tables(sw, lo, hi)
    else:
        t0 = lo
        t1 = hi
    d = tl.dot(fp4_e4m3_quads(b, t0, t1, BLOCK_N, USE_ASM), at)
    if FOLD:
        return acc + d * sa[None, :]
    return acc + (d * pow2(sw - 121)[:, None]) * sa[None, :]


@triton.jit
def _fold_loop(acc, acc3, a_ptr, a_off, sa_base, sa_g, sa_off, bg, sbg, b3g, sb3g, c_off, cs_off, K,
               lo1, hi1, lo3, hi3, DUAL: tl.constexpr, FOLD: tl.constexpr, USE_ASM: tl.constexpr,
               BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """The K loop, GROUPS (1 or 4) 32-wide groups per step, each group's MMA result added in K order
    (``_group_fold``; W1's before W3's MMA: one MMA result live at a time). GROUPS 4: the columns' scale bytes of
    the step's 4 groups come in one 32-bit word per column (``sbg`` 4-byte aligned rows)."""
    for k_step in range(0, K, 32 * GROUPS):
        if GROUPS == 4:
            ws1 = tl.load(sbg.to(tl.pointer_type(tl.int32)) + (cs_off // 4 + k_step // 128))
            ws3 = ws1
            if DUAL:
                ws3 = tl.load(sb3g.to(tl.pointer_type(tl.int32)) + (cs_off // 4 + k_step // 128))
        for g in tl.static_range(GROUPS):
            k0 = tl.multiple_of(k_step + 32 * g, 32)
            kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
            kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, 16), 16), 16)
            at = tl.trans(tl.load(a_ptr + (a_off[:, None] + kk[None, :])))
            sa = tl.load(sa_base + (k0 // 32) * sa_g + sa_off)
            b = tl.load(bg + (c_off[:, None] + kh[None, :]))
            if GROUPS == 4:
                sw = (ws1 >> (8 * g)) & 0xFF
            else:
                sw = tl.load(sbg + (cs_off + k0 // 32)).to(tl.int32)
            acc = _group_fold(acc, at, sa, b, sw, lo1, hi1, FOLD, USE_ASM, BLOCK_N)
            if DUAL:
                b3 = tl.load(b3g + (c_off[:, None] + kh[None, :]))
                if GROUPS == 4:
                    sw3 = (ws3 >> (8 * g)) & 0xFF
                else:
                    sw3 = tl.load(sb3g + (cs_off + k0 // 32)).to(tl.int32)
                acc3 = _group_fold(acc3, at, sa, b3, sw3, lo3, hi3, FOLD, USE_ASM, BLOCK_N)
    return acc, acc3


@triton.jit
def _prefill_fold_mm(a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, ps_ptr, wt_ptr,
                     tile_group_ptr, tile_row_ptr, tile_end_ptr, flag_ptr, count_ptr, list_ptr, base_ptr,
                     stride_base, N, K, limit, stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn,
                     stride_pm, stride_psm, stride_psg, GATHER: tl.constexpr, DUAL: tl.constexpr,
                     USE_ASM: tl.constexpr, WIDE: tl.constexpr, MODE: tl.constexpr, KW_POW2: tl.constexpr,
                     GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid``: row tile ``pid // column blocks`` of its expert x column block ``pid % column blocks``, all
    of K (module docstring). MODE 0: the programs whose column block folds exactly compute (folded decode, row
    scales only) and write ``flag_ptr[pid]`` 1; the others write 0 and append their pid to ``list_ptr`` (count
    at ``count_ptr``); MODE 1: a few programs go through that list with the per-group scaling (nothing to do
    when every block folds); MODE 2: every program with the per-group scaling; MODE 3 (the tests' negative
    control): every program folds, in range or not. (Two launches instead of a branch inside one program: each
    K loop gets its own register allocation.) The rows' scales are fp32 [K/32, rows + SAT_PAD] in sorted row
    order (``stride_sam``: the group stride). DUAL: W1 | W3 with the SwiGLU epilogue writing the W2 input (e4m3
    in quads order, fp32 scales transposed: element (row, group) at row · stride_psm + group · stride_psg); else
    bf16 [rows, N]."""
    if MODE == 1:
        n = tl.load(count_ptr)
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            _fold_program(tl.load(list_ptr + i), a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr,
                          ps_ptr, wt_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, flag_ptr, count_ptr, list_ptr,
                          base_ptr, stride_base, N, K, limit, stride_am, stride_sam, stride_bg, stride_bn,
                          stride_sbg, stride_sbn, stride_pm, stride_psm, stride_psg, GATHER, DUAL, USE_ASM, WIDE,
                          MODE, KW_POW2, GROUPS, BLOCK_M, BLOCK_N)
    else:
        _fold_program(tl.program_id(0), a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, ps_ptr,
                      wt_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, flag_ptr, count_ptr, list_ptr, base_ptr,
                      stride_base, N, K, limit, stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn,
                      stride_pm, stride_psm, stride_psg, GATHER, DUAL, USE_ASM, WIDE, MODE, KW_POW2, GROUPS,
                      BLOCK_M, BLOCK_N)


@triton.jit
def _fold_program(pid, a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, ps_ptr, wt_ptr,
                  tile_group_ptr, tile_row_ptr, tile_end_ptr, flag_ptr, count_ptr, list_ptr, base_ptr, stride_base,
                  N, K, limit, stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_pm,
                  stride_psm, stride_psg, GATHER: tl.constexpr, DUAL: tl.constexpr, USE_ASM: tl.constexpr,
                  WIDE: tl.constexpr, MODE: tl.constexpr, KW_POW2: tl.constexpr, GROUPS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``_prefill_fold_mm``'s program ``pid``."""
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    grp = tl.load(tile_group_ptr + pid_m)
    if grp >= 0:
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
        a_off = arow.to(tl.int64) * stride_am if WIDE else arow * stride_am
        sa_base = sa_ptr + row0  # scale of (sorted row r, group j) at j · stride_sam + r
        sa_off = tl.arange(0, BLOCK_M)
        if MODE == 0 or MODE == 3:
            # per column: the base (largest scale byte over K), every byte within FOLD_SPAN of it, base >= 1
            if KW_POW2 > 0:  # 4-byte aligned scale rows: one load of all the block's scale words
                m1, n1 = _col_range_words(sbg, cs_off, K // 128, BLOCK_N, KW_POW2)
            else:
                m1, n1 = _col_range(sbg, cs_off, K // 32, BLOCK_N, 32)
            m3 = m1
            n3 = n1
            if DUAL:
                if KW_POW2 > 0:
                    m3, n3 = _col_range_words(sb3g, cs_off, K // 128, BLOCK_N, KW_POW2)
                else:
                    m3, n3 = _col_range(sb3g, cs_off, K // 32, BLOCK_N, 32)
            span = tl.max(tl.maximum(m1 - n1, m3 - n3), 0)
            low = tl.min(tl.minimum(m1, m3), 0)
            fits = (span <= FOLD_SPAN) & (low >= 1)
            tl.store(flag_ptr + pid, fits.to(tl.int32))
            if MODE == 0:
                run = fits
                if not fits:  # the per-group launch takes this program
                    tl.store(list_ptr + tl.atomic_add(count_ptr, 1), pid)
            else:
                run = True
        else:
            run = True
        if run:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc3 = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            if MODE == 0 or MODE == 3:
                # the bases go through memory ([G, N] bytes per matrix; row tiles of one expert write the same
                # bytes) and come back as plain loads: the K loop's per-column values then take the decode's
                # layout instead of the reduction's (which sends every decoded tile through shared memory)
                bb = base_ptr + grp.to(tl.int64) * N + ccol
                tl.store(bb, m1.to(tl.uint8))
                if DUAL:
                    tl.store(bb + stride_base, m3.to(tl.uint8))
                tl.debug_barrier()
                m1 = tl.load(bb).to(tl.int32)
                m3 = m1
                if DUAL:
                    m3 = tl.load(bb + stride_base).to(tl.int32)
                # code bytes 0x80 + 4c + 8(s - m + 12) (c >= 2), 0x80 + 8(s - m + 12) (c = 1), 0x80 (c = 0)
                o1 = ((12 - m1) * 8).to(tl.uint32)
                o3 = ((12 - m3) * 8).to(tl.uint32)
                acc, acc3 = _fold_loop(acc, acc3, a_ptr, a_off, sa_base, stride_sam, sa_off, bg, sbg, b3g, sb3g,
                                       c_off, cs_off, K, o1 * 0x01010100 + 0x8C888080, o1 * 0x01010101 + 0x9C989490,
                                       o3 * 0x01010100 + 0x8C888080, o3 * 0x01010101 + 0x9C989490, DUAL, True,
                                       USE_ASM, BLOCK_N, GROUPS)
                # 2^(m - 133) per column, in two exact steps (pow2 takes exponents >= -126)
                acc = acc * (pow2(m1 - 127) * 0.015625)[:, None]
                acc3 = acc3 * (pow2(m3 - 127) * 0.015625)[:, None]
            else:  # e2m1 · 2^-6 for every column: code bytes 0x80 + 4c (0.5 -> the subnormal 2^-7)
                c1 = tl.full([BLOCK_N], 0x8C888480, tl.uint32)
                c2 = tl.full([BLOCK_N], 0x9C989490, tl.uint32)
                acc, acc3 = _fold_loop(acc, acc3, a_ptr, a_off, sa_base, stride_sam, sa_off, bg, sbg, b3g, sb3g,
                                       c_off, cs_off, K, c1, c2, c1, c2, DUAL, False, USE_ASM, BLOCK_N, GROUPS)
            r64 = rows.to(tl.int64)
            omask = rmask[:, None] & cmask[None, :]
            if DUAL:  # moe_stream_fp8 EPI 1, the W2 input in quads order with fp32 scales (its K groups)
                q, e = swiglu_e4m3(acc, acc3, wt_ptr, rows, rmask, limit, BLOCK_M, BLOCK_N)
                gs = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
                smask = rmask[:, None] & (gs[None, :] * 32 < N)
                tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], quads(q, BLOCK_M, BLOCK_N), mask=omask)
                tl.store(ps_ptr + r64[:, None] * stride_psm + gs[None, :] * stride_psg, pow2(e), mask=smask)
            else:
                tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], tl.trans(acc).to(tl.bfloat16),
                         mask=omask)


def prefill_gemm_fold(aq, sa, w, ws, rows: int, plan, *, offs, rowid=None, w3=None, ws3=None, wt=None,
                      limit: float = 0.0, tiles=None, fold: bool = True, flags=None):
    """``moe_prefill_fp8.prefill_gemm_fp8`` for ``decode="fp8f"``: ``aq`` e4m3 [R, K] in quads order, ``sa`` fp32
    [K/32, rows + SAT_PAD] per sorted row. With ``w3``: (e4m3 W2 input [rows, N] in quads order, its fp32 scales
    [N/32, rows + SAT_PAD]); without: bf16 [rows, N]. Two launches: the folded programs, then the per-group
    scaling for the column blocks the fold cannot take exactly (their programs only; the others exit at once).
    ``plan.block_k`` 128 (and 4-byte aligned scale rows, K % 128 == 0): without ``w3`` four groups per loop step
    with the scale bytes read as words (with ``w3`` one group: four spill). ``fold`` False: one launch, every
    program with the per-group scaling; ``"force"``: one launch, every program
    folded even where that is not exact (tests: the negative control). ``flags``: an int32 tensor of
    at least one element per program (tiles x column blocks), given 1 where the program folded (tests)."""
    from redknot.kernels.triton.splitk_mx import tile_map
    w, ws = as_bytes(w), as_bytes(ws)
    N, K = w.shape[1], w.shape[2] * 2
    if K % 32:
        raise ValueError(f"prefill_gemm_fold: K={K} must be a multiple of 32")
    dual = w3 is not None
    bm, bn = plan.block_m, plan.block_n
    if dual and bn % 32:
        raise ValueError(f"MoePlan.block_n={bn}: the fused SwiGLU quantises per 32 columns (a multiple of 32)")
    if sa.dtype != torch.float32 or sa.shape[0] != K // 32 or sa.shape[1] < rows + SAT_PAD or sa.stride(1) != 1:
        raise ValueError(f"prefill_gemm_fold: takes fp32 row scales [K/32, rows + {SAT_PAD}] (sorted rows, padded), "
                         f"got {sa.dtype} {tuple(sa.shape)}")
    dev = aq.device
    if dual:
        p = torch.empty(rows, N, dtype=torch.float8_e4m3fn, device=dev)
        ps = torch.empty(cdiv(N, 32), rows + SAT_PAD, dtype=torch.float32, device=dev)
        ps[:, rows:].zero_()  # the padding a last row tile reads: finite scales for its unused rows
    else:
        p, ps = torch.empty(rows, N, dtype=torch.bfloat16, device=dev), None
    result = (p, ps) if dual else p
    if rows == 0:
        return result
    tg, tr, te, n_tiles = tiles if tiles is not None else tile_map(offs, bm, rows)
    grid = n_tiles * cdiv(N, bn)
    flags = flags if flags is not None else torch.empty(max(1, grid), dtype=torch.int32, device=dev)
    bases = torch.empty(2 if dual else 1, w.shape[0], N, dtype=torch.uint8, device=dev)
    count = torch.zeros(1, dtype=torch.int32, device=dev)  # programs the fold cannot take, listed in ``todo``
    todo = torch.empty(max(1, grid), dtype=torch.int32, device=dev)
    w3g = as_bytes(w3) if dual else w
    s3g = as_bytes(ws3) if dual else ws
    # the prologue reads each column's scale bytes as 32-bit words where every scale row is 4-byte aligned
    words = K % 128 == 0 and all(t.stride(0) % 4 == 0 and t.stride(1) % 4 == 0 and t.stride(2) == 1 and
                                 t.data_ptr() % 4 == 0 for t in (ws, s3g))
    for mode in ((3,) if fold == "force" else (0, 1) if fold else (2,)):
        # MODE 1: a few programs per SM walk the list the folded launch left (usually empty)
        _prefill_fold_mm[(min(grid, 4 * sm_count(aq)) if mode == 1 else grid,)](
            aq, sa, rowid if rowid is not None else offs, w, ws, w3g, s3g, p, ps if ps is not None else p,
            wt if wt is not None else p, tg, tr, te, flags, count, todo, bases, bases.stride(0), N, K, float(limit),
            aq.stride(0), sa.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1), p.stride(0),
            ps.stride(1) if ps is not None else 0, ps.stride(0) if ps is not None else 0, GATHER=rowid is not None,
            DUAL=dual, USE_ASM=use_asm(dev), WIDE=aq.numel() >= 2**31, MODE=mode,
            KW_POW2=next_pow2(K // 128) if words else 0, GROUPS=4 if words and plan.block_k >= 128 and not dual else 1,
            BLOCK_M=bm, BLOCK_N=bn, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return result


def fold_inputs(x, topk_idx, topk_weight, experts: int):
    """``moe_prefill_fp8.prefill_inputs`` for ``decode="fp8f"``: the token rows' e4m3 in quads order and their
    scales as fp32 powers of two per sorted pair, transposed and padded ([D/32, T·k + SAT_PAD])."""
    from redknot.kernels.triton.moe_mx import _sorted_pairs
    from redknot.kernels.triton.moe_stream_fp8h import scales_f32
    rows, inv, offs, wt, xq, xs = _sorted_pairs(topk_idx, topk_weight, experts, x, fp8=True)
    M = rows.numel()
    xs_t = torch.empty(xs.shape[1], M + SAT_PAD, dtype=torch.float32, device=xs.device)
    xs_t[:, :M] = scales_f32(xs.index_select(0, rows)).t()
    xs_t[:, M:].zero_()
    return rows, inv, offs, wt, quads_order(xq), xs_t
