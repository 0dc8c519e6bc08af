"""MXFP4 expert GEMV streams for 1-4 tokens (``moe_gemv``; ``gemv_mx``'s docstring describes the family and
re-exports every name here): one program per (token, slot) pair, column block and K slice, the pair's expert
weights against its token's row; per 16 bytes (one 32-wide group) the 32 exact products are added and multiplied
by the group's E8M0 scale. Launch shapes, K step and K slice rules from ``gemv_plan``.

Not measured on the H200: ``moe_mx.SMALL_TUNER`` times these streams against the tensor-core streams on first use.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import DeviceCounters, cdiv
from redknot.kernels.triton.dequant_mx import as_bytes, fp8_qdq_groups, qdq_bf16
from redknot.kernels.triton.gemv_plan import (
    DEFAULT_PLAN,
    GemvPlan,
    _block_k,
    _e4m3x4,
    _use_asm,
    slices,
)
from redknot.kernels.triton.moe_stream_fp8 import _HI_PTX, _LO_PTX


@triton.jit
def _fp4x8(wd, USE_ASM: tl.constexpr):
    """int32 words of 8 e2m1 codes (K positions 8i..8i+7; byte b: 2b in its low nibble, 2b+1 in its high one)
    -> 8 fp32 tensors, each the e2m1 value times 2^-6: the codes become e4m3 bytes by word arithmetic
    (``moe_stream_fp8``'s PTX: low nibbles, then high ones), then ``_e4m3x4``. Order: K 8i+0, 2, 4, 6, then
    8i+1, 3, 5, 7."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_LO_PTX, "=r,r", [wd], dtype=tl.int32, is_pure=True, pack=1)
        hi = tl.inline_asm_elementwise(_HI_PTX, "=r,r", [wd], dtype=tl.int32, is_pure=True, pack=1)
    else:  # the same bits (0x80808080 as int32: -2139062144)
        lo = ((wd & 0x08080808) << 4) | ((wd & 0x07070707) << 2)
        hi = (wd & -2139062144) | ((wd >> 2) & 0x1C1C1C1C)
    a0, a1, a2, a3 = _e4m3x4(lo, USE_ASM)
    b0, b1, b2, b3 = _e4m3x4(hi, USE_ASM)
    return a0, a1, a2, a3, b0, b1, b2, b3


@triton.jit
def _scale64(sb):
    """E8M0 bytes -> 2^(s - 127) · 2^6 from the exponent bits alone (byte 0 gives 2^-121, a normal fp32;
    ``e8m0_decode(s) · 64`` for every byte up to 248, both infinite above)."""
    return ((sb.to(tl.int32) + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_acc(acc, wd, sc, x0, x1, x2, x3, USE_ASM: tl.constexpr):
    """acc [BN, W] + (Σ of a word's 8 exact products) · sc: x_p [W] int32 holds the bf16 pair of K 8i+2p
    (low half) and 8i+2p+1 (high half)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _fp4x8(wd, USE_ASM)
    part = a0 * (x0 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b0 * (x0 & -65536).to(tl.float32, bitcast=True)[None, :]
    part += a1 * (x1 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b1 * (x1 & -65536).to(tl.float32, bitcast=True)[None, :]
    part += a2 * (x2 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b2 * (x2 & -65536).to(tl.float32, bitcast=True)[None, :]
    part += a3 * (x3 << 16).to(tl.float32, bitcast=True)[None, :]
    part += b3 * (x3 & -65536).to(tl.float32, bitcast=True)[None, :]
    return acc + part * sc


@triton.jit
def _gemv_fp4(x_ptr, ids_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, N, KW, KSPLIT, stride_x, stride_be,
              stride_bn, stride_sbe, stride_sbn, stride_ps, stride_pm, TOPK: tl.constexpr, DUAL: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """One program: expert pair ``program_id(0)`` (its expert ``ids[pair]``, activation row ``pair // TOPK``,
    bf16 pairs read as int32), BLOCK_N weight rows over one K slice of KSPLIT packed bytes read as int32
    words [N, KW] (8 values a word, 16 bytes per thread and row a step; 4 words = one 32-wide group, its
    E8M0 scale times 2^6 applied to each word's 8-product sum); fp32 partials per slice. ``DUAL``: W1 and
    W3 over the same activations. One step of register prefetch."""
    W: tl.constexpr = BLOCK_K // 4
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    xrow = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    i = tl.max_contiguous(tl.arange(0, W), W)
    wrow = b_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    w3row = b3_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    srow = sb_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    s3row = sb3_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    xoff = tl.reshape(4 * i[:, None] + tl.arange(0, 4)[None, :], (W, 2, 2))
    k_lo = tl.program_id(2) * (KSPLIT // 4)
    k_hi = tl.minimum(KW, k_lo + KSPLIT // 4)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    acc3 = tl.zeros([BLOCK_N, W], tl.float32)
    k0 = tl.multiple_of(k_lo, W)
    w = tl.load(wrow + k0, mask=cmask[:, None], other=0)
    sb = tl.load(srow + k0 // 4, mask=cmask[:, None], other=127)
    w3 = w
    sb3 = sb
    if DUAL:
        w3 = tl.load(w3row + k0, mask=cmask[:, None], other=0)
        sb3 = tl.load(s3row + k0 // 4, mask=cmask[:, None], other=127)
    for k_step in range(k_lo, k_hi, W):
        k1 = tl.multiple_of(tl.minimum(k_step + W, k_hi - W), W)
        w_n = tl.load(wrow + k1, mask=cmask[:, None], other=0)
        sb_n = tl.load(srow + k1 // 4, mask=cmask[:, None], other=127)
        w3_n = w_n
        sb3_n = sb_n
        if DUAL:
            w3_n = tl.load(w3row + k1, mask=cmask[:, None], other=0)
            sb3_n = tl.load(s3row + k1 // 4, mask=cmask[:, None], other=127)
        xv = tl.load(xrow + 4 * k_step + xoff)  # [W, 2, 2]: pairs 4i + 2a + b
        xe, xo = tl.split(xv)  # b = 0: pairs 4i, 4i+2; b = 1: 4i+1, 4i+3
        x0, x2 = tl.split(xe)
        x1, x3 = tl.split(xo)
        acc = _fp4_acc(acc, w, _scale64(sb), x0, x1, x2, x3, USE_ASM)
        if DUAL:
            acc3 = _fp4_acc(acc3, w3, _scale64(sb3), x0, x1, x2, x3, USE_ASM)
        w, sb, w3, sb3 = w_n, sb_n, w3_n, sb3_n
    out = p_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols
    tl.store(out, tl.sum(acc, 1), mask=cmask)
    if DUAL:
        tl.store(p3_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols,
                 tl.sum(acc3, 1), mask=cmask)


# One byte (an E8M0 scale) and one 16-byte vector (four int32 words of bf16 pairs) as elementwise PTX loads: their
# results take the layout of the address tensor (the weight words'), where ``tl.load`` would get a layout of its
# own from the address pattern and a conversion through shared memory before the weight arithmetic.
_LD_U8_PTX = tl.constexpr("ld.global.nc.u8 $0, [$1];")
_LD_V4_PTX = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _ld_scale64(ptr, USE_ASM: tl.constexpr):
    """E8M0 bytes at ``ptr`` -> ``_scale64`` of them, in the layout of ``ptr``."""
    if USE_ASM:
        b = tl.inline_asm_elementwise(_LD_U8_PTX, "=r,l", [ptr.to(tl.int64)], dtype=tl.int32, is_pure=True, pack=1)
    else:
        b = tl.load(ptr).to(tl.int32)
    return ((b + 6) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _ld_x4(ptr, USE_ASM: tl.constexpr):
    """The int32 words ptr[0..3] (16-byte aligned) in the layout of ``ptr``: one vector load per element."""
    if USE_ASM:
        x0, x1, x2, x3 = tl.inline_asm_elementwise(_LD_V4_PTX, "=r,=r,=r,=r,l", [ptr.to(tl.int64)],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
    else:
        x0 = tl.load(ptr)
        x1 = tl.load(ptr + 1)
        x2 = tl.load(ptr + 2)
        x3 = tl.load(ptr + 3)
    return x0, x1, x2, x3


@triton.jit
def _fp4_acc2(acc, wd, sc, x0, x1, x2, x3, USE_ASM: tl.constexpr):
    """``_fp4_acc`` with the activation words x_p already [BN, W] (the weight words' layout)."""
    a0, a1, a2, a3, b0, b1, b2, b3 = _fp4x8(wd, USE_ASM)
    part = a0 * (x0 << 16).to(tl.float32, bitcast=True)
    part += b0 * (x0 & -65536).to(tl.float32, bitcast=True)
    part += a1 * (x1 << 16).to(tl.float32, bitcast=True)
    part += b1 * (x1 & -65536).to(tl.float32, bitcast=True)
    part += a2 * (x2 << 16).to(tl.float32, bitcast=True)
    part += b2 * (x2 & -65536).to(tl.float32, bitcast=True)
    part += a3 * (x3 << 16).to(tl.float32, bitcast=True)
    part += b3 * (x3 & -65536).to(tl.float32, bitcast=True)
    return acc + part * sc


@triton.jit
def _ld_step(wrow, srow, w3row, s3row, k, DUAL: tl.constexpr, USE_ASM: tl.constexpr):
    """``_gemv_fp4d``'s loads of step ``k``: the weight words and scales (W3's with ``DUAL``, else W1's again)."""
    w = tl.load(wrow + k)
    sc = _ld_scale64(srow + k // 4, USE_ASM)
    w3 = w
    sc3 = sc
    if DUAL:
        w3 = tl.load(w3row + k)
        sc3 = _ld_scale64(s3row + k // 4, USE_ASM)
    return w, sc, w3, sc3


@triton.jit
def _gemv_fp4d(x_ptr, ids_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, N, KW, KSPLIT, stride_x, stride_be,
               stride_bn, stride_sbe, stride_sbn, stride_ps, stride_pm, TOPK: tl.constexpr, DUAL: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, wt_ptr=None, act_ptr=None,
               stride_a=0, limit=0.0, cnt_ptr=None, out_ptr=None, stride_o=0, EPI: tl.constexpr = 0,
               SLOTS: tl.constexpr = 1, DEPTH: tl.constexpr = 1):
    """``_gemv_fp4``'s program (the same products and 8-product word sums) with every load in the weight words' [BN, W]
    register layout: the scales one byte per (row, word) from an elementwise PTX load (one load per thread, row
    and group after CSE) and the activations one 16-byte PTX load per word (the pairs 4i..4i+3; one per thread
    and word, shared by its rows and by W1 | W3). ``tl.load`` gives both a layout of their own (the scales'
    addresses repeat along K, the activations' are 4 words apart), and ``_gemv_fp4`` converts the activations
    and every step's 8-product sums through shared memory (sm_90a, W1 | W3 at 16 x 128: 12 LDS, 8 STS, 6 BAR
    of 365 SASS a step; here none, 294; at 32 x 128 527 for 8 KB against 623). The final sum over a row's
    words follows this layout's tree (another fp32 order than ``_gemv_fp4``'s). Rows past N read row N-1 (stored
    nowhere): no masks. Activation rows 16-byte aligned. Not measured on the H200.

    One K slice only (the grid's third dimension 1), ``EPI`` runs the next launch's code for the program's columns:
    1 (W1 | W3, BLOCK_N a multiple of 32): ``splitk_mx._reduce_swiglu``'s math on the two sums (bf16 roundings,
    clamps, SiLU, the pair's routing weight ``wt``) and the W2 input's per-32 FP8 QDQ, stored as bf16 rows
    ``act`` [P, N], instead of the partials; 2 (W2): the pair's sums stored, a barrier, one acquire-release
    increment of the (token, column block) counter; the program that takes it to ``SLOTS`` (every slot of the
    token stored) zeroes it and runs ``splitk_mx._reduce_combine`` for the block (each slot rounded to bf16, added
    in slot order, the slots' sums from L2) into ``out`` [T, N]. The bits of the separate launches."""
    W: tl.constexpr = BLOCK_K // 4
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    xrow = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = tl.minimum(cols, N - 1).to(tl.int64)
    i = tl.max_contiguous(tl.arange(0, W), W)
    wrow = b_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    w3row = b3_ptr + e * stride_be + c64[:, None] * stride_bn + i[None, :]
    srow = sb_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    s3row = sb3_ptr + e * stride_sbe + c64[:, None] * stride_sbn + i[None, :] // 4
    xw = xrow + 4 * i[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
    k_lo = tl.program_id(2) * (KSPLIT // 4)
    k_hi = tl.minimum(KW, k_lo + KSPLIT // 4)
    acc = tl.zeros([BLOCK_N, W], tl.float32)
    acc3 = tl.zeros([BLOCK_N, W], tl.float32)
    k0 = tl.multiple_of(k_lo, W)
    w, sc, w3, sc3 = _ld_step(wrow, srow, w3row, s3row, k0, DUAL, USE_ASM)
    # DEPTH 2: the step after the next one also in flight (its words and scales in registers one step early)
    kb = tl.multiple_of(tl.minimum(k0 + W, k_hi - W), W)
    wb = w
    scb = sc
    w3b = w
    sc3b = sc
    if DEPTH == 2:
        wb, scb, w3b, sc3b = _ld_step(wrow, srow, w3row, s3row, kb, DUAL, USE_ASM)
    for k_step in range(k_lo, k_hi, W):
        # the next step (DEPTH 1) or the one after it (2); past the slice's end its last step again (an L2 hit)
        k1 = tl.multiple_of(tl.minimum(k_step + DEPTH * W, k_hi - W), W)
        w_n, sc_n, w3_n, sc3_n = _ld_step(wrow, srow, w3row, s3row, k1, DUAL, USE_ASM)
        x0, x1, x2, x3 = _ld_x4(xw + 4 * k_step, USE_ASM)
        acc = _fp4_acc2(acc, w, sc, x0, x1, x2, x3, USE_ASM)
        if DUAL:
            acc3 = _fp4_acc2(acc3, w3, sc3, x0, x1, x2, x3, USE_ASM)
        if DEPTH == 2:
            w, sc, w3, sc3 = wb, scb, w3b, sc3b
            wb, scb, w3b, sc3b = w_n, sc_n, w3_n, sc3_n
        else:
            w, sc, w3, sc3 = w_n, sc_n, w3_n, sc3_n
    if EPI == 1:
        g = tl.minimum(tl.sum(acc, 1).to(tl.bfloat16).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(tl.sum(acc3, 1).to(tl.bfloat16).to(tl.float32), -limit), limit)
        a = (g / (1.0 + tl.exp(-g)) * u * tl.load(wt_ptr + pair)).to(tl.bfloat16).to(tl.float32)
        v = fp8_qdq_groups(tl.reshape(a, (1, BLOCK_N)), 1, BLOCK_N).to(tl.bfloat16)
        tl.store(act_ptr + pair.to(tl.int64) * stride_a + cols[None, :], v, mask=cmask[None, :])
    else:
        out = p_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols
        tl.store(out, tl.sum(acc, 1), mask=cmask)
        if DUAL:
            tl.store(p3_ptr + tl.program_id(2).to(tl.int64) * stride_ps + pair.to(tl.int64) * stride_pm + cols,
                     tl.sum(acc3, 1), mask=cmask)
        if EPI == 2:
            tl.debug_barrier()   # every thread's sums stored before the release
            tok = pair // SLOTS
            cnt = cnt_ptr + tok * tl.num_programs(1) + tl.program_id(1)
            done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if done == SLOTS - 1:
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
                comb = tl.zeros([BLOCK_N], tl.float32)
                for j in tl.static_range(SLOTS):  # slot order
                    y = tl.load(p_ptr + (tok * SLOTS + j).to(tl.int64) * stride_pm + cols, mask=cmask, other=0.0,
                                cache_modifier=".cg")
                    comb += y.to(tl.bfloat16).to(tl.float32)
                tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, comb.to(out_ptr.dtype.element_ty), mask=cmask)


def gemv_fp4(x: torch.Tensor, ids: torch.Tensor, topk: int, w: torch.Tensor, ws: torch.Tensor, plan: GemvPlan,
             w3=None, ws3=None, act=None, wt=None, limit: float = 0.0, out=None, slots: int = 1):
    """fp32 partials [S, P, N] (and W3's with ``w3``) of pair p's activation row ``x[p // topk]`` (QDQ'd bf16
    [R, K]) times expert ``ids[p]``'s packed MXFP4 weight ``w`` [E, N, K/2] with E8M0 ``ws`` [E, N, K/32].
    ``plan.direct``: ``_gemv_fp4d`` (the same products and per-word sums; a row's words added in the tree of another
    register layout; activation rows not 16-byte aligned: ``_gemv_fp4``). Where :func:`fusable`: ``act`` (with
    ``w3``, the routing weights ``wt`` [P] fp32, the clamp ``limit``) receives the W2 input rows [P, N] bf16, or
    ``out`` (without ``w3``; ``slots`` pairs a token) the combined rows [P / slots, N]; no partials (None)."""
    P = ids.numel()
    w, ws = as_bytes(w), as_bytes(ws)
    N, KH = w.shape[1], w.shape[2]
    S, ksplit = fp4_slices(N, KH, P, plan)
    dual = w3 is not None
    epi = 1 if act is not None else 2 if out is not None else 0
    if epi and not fusable(x, N, KH, P, plan, dual):
        raise ValueError(f"gemv_fp4: the fused epilogue needs one K slice, a direct plan and aligned rows ({plan})")
    p = torch.empty(S, P, N, dtype=torch.float32, device=x.device) if epi != 1 else None
    p3 = torch.empty_like(p) if dual and not epi else p
    if P:
        bk = _block_k(KH, plan.block_k, 16)
        w3b = as_bytes(w3) if dual else w
        s3b = as_bytes(ws3) if dual else ws
        wv, w3v = w.view(torch.int32), w3b.view(torch.int32)
        # the direct loads read 16-byte vectors of the activation rows: their start and row stride aligned
        kernel = _gemv_fp4d if plan.direct and _aligned(x) else _gemv_fp4
        grid = (P, cdiv(N, plan.block_n), S)
        args = [x.view(torch.int32), ids, wv, ws, w3v, s3b, p if p is not None else act,
                p3 if p3 is not None else act, N, KH // 4, ksplit, x.stride(0) // 2, wv.stride(0), wv.stride(1),
                ws.stride(0), ws.stride(1), p.stride(0) if p is not None else 0, p.stride(1) if p is not None else 0]
        meta = {"TOPK": topk, "DUAL": dual, "BLOCK_N": plan.block_n, "BLOCK_K": bk, "USE_ASM": _use_asm(),
                "num_warps": plan.num_warps, "num_stages": plan.num_stages}
        if kernel is _gemv_fp4d:
            meta["DEPTH"] = plan.depth
        if epi == 1:
            kernel[grid](*args, wt_ptr=wt, act_ptr=act, stride_a=act.stride(0), limit=float(limit), EPI=1, **meta)
        elif epi == 2:
            kernel[grid](*args, cnt_ptr=_counters(x.device, out.shape[0] * grid[1]), out_ptr=out,
                         stride_o=out.stride(0), EPI=2, SLOTS=slots, **meta)
        else:
            kernel[grid](*args, **meta)
    if epi:
        return None
    return (p, p3) if dual else p


def fp4_slices(N: int, KH: int, P: int, plan: GemvPlan) -> tuple:
    """(slice count, slice width in packed bytes) of a ``gemv_fp4`` launch over P pairs of [N, KH] weights:
    ``plan.ksplits`` slices (a function of the weight and the plan only), else ``slices`` over the pairs' column
    blocks (the count depends on P where the pairs' blocks stay under ``TARGET_PROGRAMS``)."""
    if not plan.ksplits:
        return slices(N * max(P, 1), KH, plan, least=16)  # the pairs multiply the column blocks
    bk = _block_k(KH, plan.block_k, 16)
    steps = cdiv(KH, bk)
    ksplit = cdiv(steps, min(plan.ksplits, steps)) * bk
    return cdiv(KH, ksplit), ksplit


def _aligned(x: torch.Tensor) -> bool:
    return x.data_ptr() % 16 == 0 and x.stride(0) % 8 == 0 and x.stride(-1) == 1


def fusable(x: torch.Tensor, N: int, KH: int, P: int, plan: GemvPlan, dual: bool) -> bool:
    """Whether ``gemv_fp4`` runs this launch with its next launch's code (``plan.fuse``): a direct plan on
    16-byte aligned rows, one K slice, and for W1 | W3 column blocks on the per-32 QDQ groups."""
    return (plan.fuse and plan.direct and _aligned(x) and fp4_slices(N, KH, P, plan)[0] == 1
            and (not dual or (plan.block_n % 32 == 0 and N % 32 == 0)))


# the (token, column block) counters of the fused W2 launch (see DeviceCounters)
_counters = DeviceCounters(4096)
_COUNTERS = _counters.sets


def moe_gemv(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
             plan: GemvPlan = DEFAULT_PLAN) -> torch.Tensor:
    """``moe_mx`` for a few tokens as GEMV streams over the (token, slot) pairs in their own order (no sort):
    W1 | W3 of each pair's expert against its token's QDQ'd row, ``splitk_mx.reduce_swiglu`` (clamped SwiGLU,
    routing weight, bf16 rounding, the W2 input's per-32 FP8 QDQ), W2 against each pair's row,
    ``splitk_mx.reduce_combine`` (each slot rounded to bf16, a token's slots added in slot order). ``plan.fuse``:
    the SwiGLU in the W1 | W3 launch and the combine in the W2 launch where :func:`fusable` (the same bits)."""
    from redknot.kernels.triton.splitk_mx import reduce_combine, reduce_swiglu
    T, k = topk_idx.shape
    inter, D = w1.shape[1], w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    ids = topk_idx.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    wt = topk_weight.reshape(-1).float().contiguous()
    xq = qdq_bf16(x)
    act = torch.empty(T * k, inter, dtype=torch.bfloat16, device=x.device)
    if fusable(xq, inter, w1.shape[2], T * k, plan, True):  # SwiGLU in the W1 | W3 launch
        gemv_fp4(xq, ids, k, w1, w1_scale, plan, w3, w3_scale, act=act, wt=wt, limit=swiglu_limit)
    else:
        p1, p3 = gemv_fp4(xq, ids, k, w1, w1_scale, plan, w3, w3_scale)
        reduce_swiglu(p1, p3, wt, swiglu_limit, act, split=False)
    plan2 = GemvPlan(plan.w2_block_n, plan.w2_block_k or plan.block_k, plan.min_steps, plan.num_warps,
                     plan.num_stages, direct=plan.direct, fuse=plan.fuse, ksplits=min(plan.ksplits, 1),
                     depth=plan.depth) if plan.w2_block_n else plan
    if fusable(act, D, w2.shape[2], T * k, plan2, False):  # the combine in the W2 launch
        gemv_fp4(act, ids, 1, w2, w2_scale, plan2, out=out, slots=k)
        return out
    p2 = gemv_fp4(act, ids, 1, w2, w2_scale, plan2)
    inv = torch.arange(T * k, dtype=torch.int32, device=x.device)
    return reduce_combine(p2, inv, k, out)
