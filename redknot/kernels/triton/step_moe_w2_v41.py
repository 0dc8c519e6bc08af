"""The shared expert's W2 input and W2 weight-stream forms at decode sizes (``step_moe_v41.shared_expert_finish``):
the SwiGLU of the W1 | W3 partials quantised per 32 (``_swiglu_quant``), the FP8 W2 stream that forms its input
itself (``_w2_swiglu_stream``) and W2 as a CUDA-core GEMV (``_w2_gemv``: after ``_swiglu_quant``, or forming its
input in each program, ``_w2_swiglu_gemv``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2
from redknot.kernels.triton.step_moe_route_v41 import _LIBDEVICE, _exp
from redknot.kernels.triton.step_proj_v41 import _gemv_tile


@triton.jit
def _swiglu(g, u, limit, LIBDEVICE: tl.constexpr):
    """The SwiGLU of ``moe.swiglu_expert`` on the fp32 slice sums of W1 (g) and W3 (u): each rounded to bf16 and
    clamped, SiLU(g) · u in fp32, rounded to bf16 (returned as fp32)."""
    g = tl.minimum(g.to(tl.bfloat16).to(tl.float32), limit)
    u = tl.minimum(tl.maximum(u.to(tl.bfloat16).to(tl.float32), -limit), limit)
    return (tl.div_rn(g, 1.0 + _exp(-g, LIBDEVICE)) * u).to(tl.bfloat16).to(tl.float32)


@triton.jit
def _swiglu_quant(p_ptr, q_ptr, s_ptr, N, S, stride_ps, stride_pm, stride_q, stride_s, limit,
                  BLOCK_G: tl.constexpr, LIBDEVICE: tl.constexpr, QDQ_BF16: tl.constexpr = False):
    """Row r, BLOCK_G groups of 32 columns: g, u = bf16(Σ_s p) of W1 / W3 (slice order), the SwiGLU of
    ``moe.swiglu_expert`` in fp32, bf16, then the per-32 e4m3 + E8M0 of ``act_quant_mx``. QDQ_BF16: the
    quantised values times their powers of two as bf16 (exact; ``qdq_bf16``'s bits) at ``q_ptr``, no scales."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * (BLOCK_G * 32) + tl.arange(0, BLOCK_G * 32)
    cm = cols < N
    g = tl.zeros([BLOCK_G * 32], tl.float32)
    u = tl.zeros([BLOCK_G * 32], tl.float32)
    for s in range(S):  # slice order 0..S-1 (``reduce_rows``)
        base = p_ptr + s * stride_ps + r * stride_pm
        g += tl.load(base + cols, mask=cm, other=0.0)
        u += tl.load(base + N + cols, mask=cm, other=0.0)
    act = tl.where(cm, _swiglu(g, u, limit, LIBDEVICE), 0.0)
    ag = tl.reshape(act, (BLOCK_G, 32))
    e = e8m0_exponent(tl.max(tl.abs(ag), 1), 448.0, 1e-4)
    q = tl.minimum(tl.maximum(ag * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
    if QDQ_BF16:
        v = (q.to(tl.float32) * pow2(e)[:, None]).to(tl.bfloat16)
        tl.store(q_ptr + r * stride_q + cols, tl.reshape(v, (BLOCK_G * 32,)), mask=cm)
    else:
        tl.store(q_ptr + r * stride_q + cols, tl.reshape(q, (BLOCK_G * 32,)), mask=cm)
        gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        tl.store(s_ptr + r * stride_s + gs, (e + 127).to(tl.uint8), mask=gs * 32 < N)


@triton.jit
def _w2_swiglu_stream(p1_ptr, b_ptr, sb_ptr, p_ptr, M, N, K, S1, KSPLIT, stride_p1s, stride_p1m, stride_bn,
                      stride_sbn, stride_ps, stride_pm, limit, WB: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``_swiglu_quant`` as the prologue of the W2 stream (``_fp8_stream`` with quantised rows): each program
    forms its K slice of the W2 input from the W1 | W3 partials (``K`` = the expert width) itself, the same
    bits, one launch fewer; every column block repeats that work, so it runs for a row or two only."""
    pid_s = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    wrow = (cols // WB).to(tl.int64) * stride_sbn
    k_lo = pid_s * KSPLIT
    k_hi = tl.minimum(K, k_lo + KSPLIT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k_step in range(k_lo, k_hi, 32 * GROUPS):
        for g in tl.static_range(GROUPS):
            k0 = tl.multiple_of(k_step + 32 * g, 32)
            kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
            gs = tl.zeros([BLOCK_M, 32], tl.float32)
            us = tl.zeros([BLOCK_M, 32], tl.float32)
            for s in range(S1):  # slice order (``reduce_rows``)
                base = p1_ptr + s * stride_p1s + r64[:, None] * stride_p1m
                gs += tl.load(base + kk[None, :], mask=rmask[:, None], other=0.0)
                us += tl.load(base + K + kk[None, :], mask=rmask[:, None], other=0.0)
            gv = tl.minimum(gs.to(tl.bfloat16).to(tl.float32), limit)
            uv = tl.minimum(tl.maximum(us.to(tl.bfloat16).to(tl.float32), -limit), limit)
            x = (tl.div_rn(gv, 1.0 + _exp(-gv, LIBDEVICE)) * uv).to(tl.bfloat16).to(tl.float32)
            e = e8m0_exponent(tl.max(tl.abs(x), 1), 448.0, 1e-4)
            a = tl.minimum(tl.maximum(x * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
            sa = pow2(e)
            w = tl.load(b_ptr + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
            sw = e8m0_decode(tl.load(sb_ptr + wrow + k0 // WB, mask=cmask, other=127))
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
    tl.store(p_ptr + out, tl.trans(acc), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _w2_swiglu_gemv(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, stride_p1s, stride_p1m, stride_a,
                    stride_w, stride_s, stride_ps, stride_pm, limit, WB: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, LIBDEVICE: tl.constexpr):
    """W2 as a GEMV that forms its input itself (one launch instead of ``_swiglu_quant`` + ``_gemv_fp8``): each
    program first computes its K slice of every row's SwiGLU from the W1 | W3 partials (``_swiglu_quant``'s code
    with QDQ_BF16) into the scratch rows ``a_ptr`` (bf16; every program of the slice stores the same values at the
    same place), a barrier, then ``gemv_mx._gemv_fp8``'s loop on those rows read as int32 pairs at ``x_ptr``
    (``step_proj_v41._gemv_tile`` QX 1): the partials of ``_w2_gemv``, bit for bit. Every column block repeats
    the SwiGLU of its slice (S1 x 2 x slice fp32 loads from L2 per row), so the tuner decides."""
    _w2_swiglu_tile(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, stride_p1s, stride_p1m, stride_a,
                    stride_w, stride_s, stride_ps, stride_pm, limit, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, LIBDEVICE)


@triton.jit
def _w2_swiglu_tile(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, stride_p1s, stride_p1m, stride_a,
                    stride_w, stride_s, stride_ps, stride_pm, limit, WB: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, LIBDEVICE: tl.constexpr):
    """:func:`_w2_swiglu_gemv`'s program."""
    I = 4 * KW
    c_lo = tl.program_id(1) * KSPLIT
    c_hi = tl.minimum(I, c_lo + KSPLIT)
    for r in tl.static_range(ROWS):
        for c0 in range(c_lo, c_hi, BLOCK_K):
            cols = c0 + tl.arange(0, BLOCK_K)
            g = tl.zeros([BLOCK_K], tl.float32)
            u = tl.zeros([BLOCK_K], tl.float32)
            for s in range(S1):  # slice order 0..S1-1 (``reduce_rows``)
                base = p1_ptr + s * stride_p1s + r * stride_p1m
                g += tl.load(base + cols)
                u += tl.load(base + I + cols)
            ag = tl.reshape(_swiglu(g, u, limit, LIBDEVICE), (BLOCK_K // 32, 32))
            e = e8m0_exponent(tl.max(tl.abs(ag), 1), 448.0, 1e-4)
            q = tl.minimum(tl.maximum(ag * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
            tl.store(a_ptr + r * stride_a + cols, tl.reshape(q * pow2(e)[:, None], (BLOCK_K,)).to(tl.bfloat16))
    tl.debug_barrier()   # the slice's rows, stored by every thread of the program, then read back
    _gemv_tile(x_ptr, w_ptr, s_ptr, p_ptr, tl.program_id(0), tl.program_id(1), N, KW, KSPLIT, stride_a // 2,
               stride_w, stride_s, stride_ps, stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, 1)


def _w2_gemv(p1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float, block: int,
             name: str) -> torch.Tensor:
    """W2's fp32 partials [S, T, D] as a CUDA-core GEMV (``gemv_mx.PLANS[name]``) in two launches: the SwiGLU
    of the W1 | W3 partials quantised per 32 as bf16 rows (``_swiglu_quant`` with QDQ_BF16), then
    ``gemv_mx._gemv_fp8`` over them with the K slices ``gemv_mx.slices`` cuts for W2: Σ_s in slice order is
    ``gemv_mx.gemv_fp8(act, W2)``'s fp32 output bit for bit (act: the bf16 SwiGLU rows). ``pgemv*``: the same
    partials in one launch (``_w2_swiglu_gemv``: each program forms its K slice of the rows first)."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes
    from redknot.kernels.triton.step_proj_v41 import plan_name
    plan = gemv_mx.PLANS[plan_name(name)]
    S1, T, two_i = p1.shape
    inter = two_i // 2
    D = w2.shape[0]
    if T > gemv_mx.MAX_ROWS or block % plan.block_n:
        raise ValueError(f"shared_expert_finish: the W2 GEMV takes at most {gemv_mx.MAX_ROWS} rows and a scale tile "
                         f"({block}) that its {plan.block_n} columns divide")
    act = torch.empty(T, inter, dtype=torch.bfloat16, device=p1.device)
    bk = gemv_mx._block_k(inter, plan.block_k)
    S2, ks2 = gemv_mx.slices(D, inter, plan)
    p2 = torch.empty(S2, T, D, dtype=torch.float32, device=p1.device)
    wb = as_bytes(w2).view(torch.int32)
    if name.startswith("pgemv"):
        _w2_swiglu_gemv[(cdiv(D, plan.block_n), S2)](
            p1, act, act.view(torch.int32), wb, s2, p2, D, inter // 4, ks2, S1, p1.stride(0), p1.stride(1),
            act.stride(0), wb.stride(0), s2.stride(0), p2.stride(0), p2.stride(1), float(limit), WB=block, ROWS=T,
            BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(), LIBDEVICE=_LIBDEVICE,
            num_warps=plan.num_warps, num_stages=plan.num_stages)
        return p2
    bg = min(16, next_pow2(inter // 32))
    _swiglu_quant[(T, cdiv(inter // 32, bg))](p1, act, act, inter, S1, p1.stride(0), p1.stride(1), act.stride(0), 0,
                                              float(limit), BLOCK_G=bg, LIBDEVICE=_LIBDEVICE, QDQ_BF16=True,
                                              num_warps=4)
    gemv_mx._gemv_fp8[(cdiv(D, plan.block_n), S2)](
        act.view(torch.int32), wb, s2, p2, D, inter // 4, ks2, act.stride(0) // 2, wb.stride(0), s2.stride(0),
        p2.stride(0), p2.stride(1), WB=block, ROWS=T, BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(),
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return p2
