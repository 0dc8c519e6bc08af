"""The fused MoE decode stream on FP8 tensor cores (``StreamPlan(decode="fp8")``): FP4 -> FP8 by byte
arithmetic on packed words, one FP8 MMA per 32-wide K group, the scales applied to its fp32 result.

Why: a decode step streams 4-bit weights, so at HBM speed an H200 SM receives ~32 weight values per clock
and has ~128 ALU lanes: a decode of more than ~3-4 instructions per value bounds the stream below
bandwidth. Decoding to bf16 costs ~9 (``moe_stream`` ``regs``) to ~17 (``splitk_mx`` ``registers``). Here:
an e2m1 nibble ``s e1 e0 m`` placed as the e4m3 byte ``s 0 0 e1 e0 m 0 0`` is the e2m1 value times 2^-6
(code 1, 0.5, lands on the e4m3 subnormal 2^-7), so four bytes of packed weights become the e4m3 bytes
of their four low nibbles by ``((w << 4) & 0x80808080) | ((w << 2) & 0x1C1C1C1C)`` and of their four high
nibbles by ``(w & 0x80808080) | ((w >> 2) & 0x1C1C1C1C)``: about 5 instructions per 8 values on the GPU
(inline PTX on 32-bit words; the interpreter runs the same arithmetic on bytes). The weight's scale
``2^(s-127)`` times 2^6 and the activation's E8M0 scale multiply each group's fp32 MMA result (exact:
powers of two), which is the reference's block-wise sum (§3.0) in K order.

Activations arrive as e4m3 + E8M0 per 32 (``quant_mx.act_quant_mx``; the W1 | W3 epilogue writes the W2
input in that form). Row tiles of 16 and the K slicing depend on the weight shape only (batch invariance).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.dequant_mx import as_bytes
from redknot.kernels.triton.moe_stream import stream_tile, swiglu_rows
from redknot.kernels.triton.quant_mx import e8m0_exponent, pow2

# (globals a kernel reads must be constexpr)
_LO_PTX = tl.constexpr("{ .reg .b32 t, u; shl.b32 t, $1, 4; shl.b32 u, $1, 2; and.b32 t, t, 0x80808080; "
                       "and.b32 u, u, 0x1C1C1C1C; or.b32 $0, t, u; }")
_HI_PTX = tl.constexpr("{ .reg .b32 t, u; shr.b32 u, $1, 2; and.b32 t, $1, 0x80808080; and.b32 u, u, 0x1C1C1C1C; "
                       "or.b32 $0, t, u; }")


@triton.jit
def fp4_e4m3(b, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed MXFP4 bytes [BN, 16] (one 32-wide K group) -> e4m3 [BN, 32] in natural K order, each value
    the e2m1 value times 2^-6 (module docstring)."""
    if USE_ASM:
        lo = tl.inline_asm_elementwise(_LO_PTX, "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(_HI_PTX, "=r,r", [b], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        lo = ((b & 0x08) << 4) | ((b & 0x07) << 2)
        hi = (b & 0x80) | ((b >> 2) & 0x1C)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, 32)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _group_dot(acc, bg, sbg, at, sa, c64, cmask, k0, stride_bn, stride_sbn, BLOCK_N: tl.constexpr,
               USE_ASM: tl.constexpr):
    """acc + (this group's e4m3 weight columns · at) · 2^(sb-127+6) · sa: one 32-wide K group at k0."""
    kh = tl.max_contiguous(tl.multiple_of(k0 // 2 + tl.arange(0, 16), 16), 16)
    b = tl.load(bg + c64[:, None] * stride_bn + kh[None, :], mask=cmask[:, None], other=0)
    sb = tl.load(sbg + c64 * stride_sbn + k0 // 32, mask=cmask, other=127).to(tl.int32)
    d = tl.dot(fp4_e4m3(b, BLOCK_N, USE_ASM), at)
    return acc + d * (pow2(sb - 121)[:, None] * sa[None, :])


@triton.jit
def swiglu_e4m3(acc, acc3, wt_ptr, rows, rmask, limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``moe_stream.swiglu_rows`` quantised per 32 columns: (e4m3 [BM, BN], E8M0 exponents [BM, BN/32]
    unbiased), the W2 input of the FP8 streams."""
    act = swiglu_rows(acc, acc3, wt_ptr, rows, rmask, limit)
    ag = tl.reshape(act, (BLOCK_M, BLOCK_N // 32, 32))
    e = e8m0_exponent(tl.max(tl.abs(ag), 2), 448.0, 1e-4)
    q = tl.reshape(ag * pow2(-e)[:, :, None], (BLOCK_M, BLOCK_N))
    q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
    return q, e


@triton.jit
def _stream_fp8_mm(a_ptr, sa_ptr, rowid_ptr, b_ptr, sb_ptr, b3_ptr, sb3_ptr, p_ptr, p3_ptr, ps_ptr, wt_ptr,
                   tile_group_ptr, tile_row_ptr, tile_end_ptr, offs_ptr, G, N, K, KSPLIT, limit,
                   stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_ps, stride_pm,
                   stride_psm, GATHER: tl.constexpr, DUAL: tl.constexpr, EPI: tl.constexpr,
                   USE_ASM: tl.constexpr, TILE_INLINE: tl.constexpr, G_POW2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """One program: an expert's row tile x BN weight columns x one K slice, GROUPS 32-wide groups per loop
    step. EPI 0: fp32 partials; 1: SwiGLU + routing weight + bf16, then e4m3 + E8M0 per 32 (the W2
    input); 2: bf16."""
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
        for k_step in range(k_lo, k_hi, 32 * GROUPS):
            for g in tl.static_range(GROUPS):
                k0 = tl.multiple_of(k_step + 32 * g, 32)
                kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
                a = tl.load(a_ptr + arow[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
                sa = pow2(tl.load(sa_ptr + arow * stride_sam + k0 // 32, mask=rmask, other=127).to(tl.int32) - 127)
                at = tl.trans(a)  # the rows' group, shared by W1 and W3
                acc = _group_dot(acc, bg, sbg, at, sa, c64, cmask, k0, stride_bn, stride_sbn, BLOCK_N, USE_ASM)
                if DUAL:
                    acc3 = _group_dot(acc3, b3g, sb3g, at, sa, c64, cmask, k0, stride_bn, stride_sbn, BLOCK_N,
                                      USE_ASM)
        r64 = rows.to(tl.int64)
        omask = rmask[:, None] & cmask[None, :]
        if EPI == 0:
            out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
            tl.store(p_ptr + out, tl.trans(acc), mask=omask)
            if DUAL:
                tl.store(p3_ptr + out, tl.trans(acc3), mask=omask)
        elif EPI == 1:
            q, e = swiglu_e4m3(acc, acc3, wt_ptr, rows, rmask, limit, BLOCK_M, BLOCK_N)
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], q, mask=omask)
            gs = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            tl.store(ps_ptr + r64[:, None] * stride_psm + gs[None, :], (e + 127).to(tl.uint8),
                     mask=rmask[:, None] & (gs[None, :] * 32 < N))
        else:
            tl.store(p_ptr + r64[:, None] * stride_pm + cols[None, :], tl.trans(acc).to(tl.bfloat16), mask=omask)


def use_asm(device: torch.device) -> bool:
    """Inline PTX whenever the kernel is compiled; Triton's CPU interpreter (``TRITON_INTERPRET``), which cannot
    run PTX, runs the byte arithmetic."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def stream_gemm_fp8(aq, sa, w, ws, rows: int, plan, *, offs, tiles, rowid=None, w3=None, ws3=None, wt=None,
                    limit: float = 0.0, epi: int = 0):
    """``moe_stream.stream_gemm`` on FP8 tensor cores: ``aq`` e4m3 [R, K] with E8M0 ``sa`` [R, K/32]. epi 0:
    fp32 partials [S, rows, N] (and W3's); 1: the W2 input (e4m3 [rows, N], E8M0 [rows, N/32]); 2: bf16."""
    from redknot.kernels.triton.moe_stream import ROW_TILE, slices
    w, ws = as_bytes(w), as_bytes(ws)
    N, K = w.shape[1], w.shape[2] * 2
    if K % 32:
        raise ValueError(f"stream_gemm_fp8: K={K} must be a multiple of 32")
    bn = plan.block_n
    if epi == 1 and bn % 32:
        raise ValueError(f"StreamPlan.block_n={bn}: the fused SwiGLU quantises per 32 columns (a multiple of 32)")
    groups = max(1, plan.block_k // 32)
    while K % (32 * groups):
        groups //= 2
    S = slices(N, K, plan) if epi == 0 else 1
    step = 32 * groups
    ksplit = cdiv(cdiv(K, S), step) * step
    S = cdiv(K, ksplit)
    return launch_stream(_stream_fp8_mm, aq, sa, w, ws, rows, plan, offs=offs, tiles=tiles, rowid=rowid, w3=w3,
                         ws3=ws3, wt=wt, limit=limit, epi=epi, slices=S, ksplit=ksplit, block_m=ROW_TILE,
                         scale_dtype=torch.uint8, BLOCK_M=ROW_TILE, BLOCK_N=bn, GROUPS=groups)


def launch_stream(kernel, aq, sa, w, ws, rows: int, plan, *, offs, tiles, rowid, w3, ws3, wt, limit: float, epi: int,
                  slices: int, ksplit: int, block_m: int, scale_dtype, **meta):
    """The host side shared by the FP8 stream kernels (``_stream_fp8_mm`` and ``moe_stream_fp8h``'s): the outputs
    for ``epi`` (0: fp32 partials [slices, rows, N] and W3's; 1: e4m3 [rows, N] with ``scale_dtype`` scales
    [rows, N/32]; 2: bf16 [rows, N]), the tile arguments (inline: ``block_m`` row tiles plus one per expert)
    and the launch over (tiles, N / plan.block_n, slices) with the kernel's own constexprs ``meta``. ``w`` and
    ``ws`` are already bytes (``as_bytes``)."""
    G, N, K = w.shape[0], w.shape[1], w.shape[2] * 2
    dual = w3 is not None
    dev = aq.device
    ps = None
    if epi == 0:
        p = torch.empty(slices, rows, N, dtype=torch.float32, device=dev)
        p3 = torch.empty_like(p) if dual else p
    elif epi == 1:
        p = torch.empty(rows, N, dtype=torch.float8_e4m3fn, device=dev)
        ps = torch.empty(rows, cdiv(N, 32), dtype=scale_dtype, device=dev)
        p3 = p
    else:
        p = torch.empty(rows, N, dtype=torch.bfloat16, device=dev)
        p3 = p
    result = (p, p3) if dual and epi == 0 else ((p, ps) if epi == 1 else p)
    if rows == 0:
        return result
    if plan.inline:
        n_tiles = cdiv(rows, block_m) + min(G, rows)
        tg = tr = te = offs
    else:
        tg, tr, te, n_tiles = tiles
    w3g = as_bytes(w3) if dual else w
    s3g = as_bytes(ws3) if dual else ws
    kernel[(n_tiles, cdiv(N, plan.block_n), slices)](
        aq, sa, rowid if rowid is not None else offs, w, ws, w3g, s3g, p, p3, ps if ps is not None else p,
        wt if wt is not None else p, tg, tr, te, offs, G, N, K, ksplit, float(limit),
        aq.stride(0), sa.stride(0), w.stride(0), w.stride(1), ws.stride(0), ws.stride(1),
        p.stride(0) if epi == 0 else 0, p.stride(-2), ps.stride(0) if ps is not None else 0,
        GATHER=rowid is not None, DUAL=dual, EPI=epi, USE_ASM=use_asm(dev), TILE_INLINE=plan.inline,
        G_POW2=max(16, next_pow2(G)), **meta, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return result
