"""V4.1's MoE router and shared expert at decode sizes in four or five launches instead of ~33 small ones.

At batch 1 a decode step's MoE (reference §3.7) is a dozen element-wise PyTorch ops around the router's
GEMV (division by the temperature, softplus, sqrt, bias, two sorts for the top-k, gather, sum, division,
route scale) and three FP8 linears for the shared expert (each: activation quantisation, split-K weight
stream, slice reduction) with their clamps, SiLU, product and casts, then the combine with the routed
experts. In a replayed graph each launch costs its fixed few microseconds, not its bytes. Here:

* :func:`route_topk`: one program per token takes the router's fp32 logits (the GEMV stays the library's,
  so the logits keep their bits) and writes the ids and weights of :func:`moe.route`: ``sqrt(softplus(l /
  temp))`` (``softplus``: ``l`` above 20, else ``log1p(exp(l))``, as PyTorch), ``k`` rounds of arg-max
  over ``s + bias`` (ties to the lower id, as the stable sort), ids ascending, weights ``s[id]`` normalised
  by their fp32 sum in id order plus 1e-20 (IEEE division), times the route scale.
* :func:`shared_expert_combine`: W1 | W3 in one FP8 weight stream (``stream_fp8``'s arithmetic: the token
  rows quantised per 32 inside, one FP8 MMA per 32-wide group scaled by both powers of two, K slices as
  ``splitk_mx.splitk_mm`` cuts them for ``decode="fp8"``), one program per row block that sums the slices,
  rounds each linear to bf16, clamps, applies SiLU · up, rounds to bf16 and quantises the W2 input per 32
  (the bits of ``act_quant_mx``), the W2 stream (``stream_fp8.fp8_stream``), and one reduction that sums
  W2's slices, rounds to bf16 and adds the routed experts' bf16 sum in fp32: ``bf16(routed + shared)``. With
  ``prologue=True`` (no row count by default: ``PROLOGUE_MAX_ROWS``) the W2 stream forms its slice of the W2
  input itself from the W1 | W3 partials (the same bits; three launches). At one to four bf16 rows the W1 | W3 stream and the W2
  stream may each be a CUDA-core GEMV (``gemv_mx``'s decode; ``step_proj_v41.STEP_SMALL_TUNER`` /
  ``STEP_W2_TUNER`` choose, ``fp8`` first): W2's GEMV reads the SwiGLU rows quantised once by
  ``_swiglu_quant`` (bf16 QDQ values, one launch more than the prologue stream). Not measured on the H200.

With the dense linears' ``fp8`` decode (``gemm_mx.LINEAR_DECODE_TUNER``'s first choice) every partial and
every sum is the one ``linear_mx`` computes, so the shared expert keeps its bits; with another decode the
results differ by summation order only. Transcendentals use libdevice's ``exp`` / ``log1p`` and
correctly rounded ``sqrt`` / division (what PyTorch's CUDA kernels call), not Triton's fast ``exp``; the
router's normalising sum adds the k weights in id order (PyTorch's reduction order may differ by an ulp).
"""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2
from redknot.kernels.triton.step_proj_v41 import _gemv_tile, _post_block

# Triton's CPU interpreter runs no extern (libdevice) calls: there ``tl.exp`` / ``tl.log`` (numpy's fp32) stand in.
_LIBDEVICE = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

# Rows up to which the step runs these kernels (decode and speculative verify); above, the PyTorch ops and
# the registry's linears, whose per-row launch costs no longer dominate.
MAX_ROWS = 16
# Rows up to which the W2 stream forms its input itself (``_w2_swiglu_stream``: one launch fewer). Each of
# its D/64 column blocks re-reads the W1 | W3 partials of its K slice from L2 (about 7 MB at one V4.1 row).
# Measured on an H100 (8K decode in graphs, 2026-12-06): 0.114 ms a call at one row for 11.8 MB of weight, where
# the two-launch form's W2 stream took 0.0525 ms a call at 32 rows: the re-reads cost more than the launch
# saved, so no row count takes it by default (``prologue=True`` still runs it).
PROLOGUE_MAX_ROWS = 0


# ---------------------------------------------------------------------- router
@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _softplus(x, LIBDEVICE: tl.constexpr):
    """PyTorch's softplus (beta 1, threshold 20): x above 20, else log1p(exp(x))."""
    if LIBDEVICE:
        y = libdevice.log1p(libdevice.exp(x))
    else:  # log1p(v) = log(1 + v) · v / ((1 + v) - 1), exact to a few ulp (v = 0 where 1 + v rounds to 1)
        v = tl.exp(x)
        w = 1.0 + v
        y = tl.where(w == 1.0, v, tl.log(w) * (v / (w - 1.0)))
    return tl.where(x > 20.0, x, y)


@triton.jit
def _route_row(l_ptr, b_ptr, ids_ptr, w_ptr, t, E, stride_l, inv_temp, scale, K: tl.constexpr, KP: tl.constexpr,
               NORM: tl.constexpr, TEMP: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Token t's ids (ascending) and weights; everything stays in registers until the two stores."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = tl.load(l_ptr + t * stride_l + e, mask=em, other=0.0).to(tl.float32)
    if TEMP:  # PyTorch divides by a scalar as a product with its fp32 reciprocal
        x = x * inv_temp
    s = tl.sqrt_rn(_softplus(x, LIBDEVICE))
    cur = tl.where(em, s + tl.load(b_ptr + e, mask=em, other=0.0), float("-inf"))
    sel = tl.zeros([BLOCK_E], tl.int32) != 0
    for _j in tl.static_range(K):  # arg-max, ties to the lower id (the stable descending sort)
        m = tl.max(cur, 0)
        idx = tl.min(tl.where((cur == m) & em & (sel == 0), e, BLOCK_E), 0)
        hit = e == idx
        sel = sel | hit
        cur = tl.where(hit, float("-inf"), cur)
    j_all = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int32)
    ws = tl.zeros([KP], tl.float32)
    prev = tl.full([], -1, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    for j in tl.static_range(K):  # ids ascending; their scores summed in that order
        idx = tl.min(tl.where(sel & (e > prev), e, BLOCK_E), 0)
        wj = tl.sum(tl.where(e == idx, s, 0.0), 0)
        ids = tl.where(j_all == j, idx, ids)
        ws = tl.where(j_all == j, wj, ws)
        total = total + wj
        prev = idx
    if NORM:
        ws = tl.div_rn(ws, tl.zeros_like(ws) + (total + 1e-20))
    km = j_all < K
    tl.store(ids_ptr + t * K + j_all, ids.to(tl.int64), mask=km)
    tl.store(w_ptr + t * K + j_all, ws * scale, mask=km)


@triton.jit
def _route_topk(l_ptr, b_ptr, ids_ptr, w_ptr, E, stride_l, inv_temp, scale, K: tl.constexpr, KP: tl.constexpr,
                NORM: tl.constexpr, TEMP: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):
    _route_row(l_ptr, b_ptr, ids_ptr, w_ptr, tl.program_id(0), E, stride_l, inv_temp, scale, K, KP, NORM, TEMP,
               BLOCK_E, LIBDEVICE)


def route_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, temp: float, norm: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [T, k] ascending, weights fp32 [T, k]) of fp32 router logits [T, E] (see the module
    docstring); ``norm``: divide by the weights' sum (``norm_topk_prob`` and k > 1)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"route_topk: logits {logits.dtype} and bias {bias.dtype} must be float32")
    if not 0 < k <= E:
        raise ValueError(f"route_topk: k={k} must be in 1..{E} (the expert count)")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T:
        inv = float(np.float32(1.0) / np.float32(temp))   # host arithmetic: no tensor op, no device read
        be = max(16, next_pow2(E))
        _route_topk[(T,)](logits, bias.contiguous(), ids, w, E, logits.stride(0), inv, float(scale), K=k,
                          KP=next_pow2(k), NORM=bool(norm), TEMP=temp != 1.0, BLOCK_E=be, LIBDEVICE=_LIBDEVICE,
                          num_warps=4 if be <= 512 else 8)
    return ids, w


def route_topk_reference(logits: torch.Tensor, bias: torch.Tensor, k: int, temp: float, norm: bool,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch math of ``moe.route`` after its GEMV (the test reference)."""
    scores = torch.sqrt(torch.nn.functional.softplus(logits / temp))
    order = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[..., :k]
    ids = order.sort(dim=-1).values
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * scale


# ---------------------------------------------------------------------- shared expert
@triton.jit
def _gate_up(a_ptr, b1_ptr, sb1_ptr, b3_ptr, sb3_ptr, p_ptr, pid_m, pid_n, pid_s, M, N, K, KSPLIT, NB, stride_am,
             stride_bn, stride_sbn, stride_ps, stride_pm, WB: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """``stream_fp8._fp8_stream`` (A_RAW) over two weights of one shape: column blocks [0, NB) read W1 and
    write partial columns [0, N), blocks [NB, 2·NB) read W3 and write columns [N, 2N)."""
    half = (pid_n >= NB).to(tl.int32)
    b_ptr = b1_ptr
    sb_ptr = sb1_ptr
    if pid_n >= NB:
        b_ptr = b3_ptr
        sb_ptr = sb3_ptr
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    cols = (pid_n - half * NB) * BLOCK_N + tl.arange(0, BLOCK_N)
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
            x = tl.load(a_ptr + r64[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
            x = x.to(tl.float32)
            e = e8m0_exponent(tl.max(tl.abs(x), 1), 448.0, 1e-4)
            a = tl.minimum(tl.maximum(x * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
            sa = pow2(e)
            w = tl.load(b_ptr + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
            sw = e8m0_decode(tl.load(sb_ptr + wrow + k0 // WB, mask=cmask, other=127))
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + (half * N + cols)[None, :]
    tl.store(p_ptr + out, tl.trans(acc), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _route_gate_up(a_ptr, b1_ptr, sb1_ptr, b3_ptr, sb3_ptr, p_ptr, M, N, K, KSPLIT, NB, stride_am, stride_bn,
                   stride_sbn, stride_ps, stride_pm, l_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, inv_temp, scale,
                   WB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
                   ROUTE: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                   TEMP: tl.constexpr, BLOCK_E: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The shared expert's W1 | W3 stream (``_gate_up``); with ROUTE M more columns of programs, the first
    program of each routing one token (``_route_row``): the router and the stream in one launch."""
    pid_n = tl.program_id(1)
    if pid_n < 2 * NB:
        _gate_up(a_ptr, b1_ptr, sb1_ptr, b3_ptr, sb3_ptr, p_ptr, tl.program_id(0), pid_n, tl.program_id(2), M, N,
                 K, KSPLIT, NB, stride_am, stride_bn, stride_sbn, stride_ps, stride_pm, WB, BLOCK_M, BLOCK_N,
                 GROUPS)
    elif ROUTE:  # noqa: SIM102  (program column 2·NB + t routes token t; the top-k rounds are serial reductions)
        if (tl.program_id(0) == 0) & (tl.program_id(2) == 0):
            _route_row(l_ptr, bias_ptr, ids_ptr, w_ptr, pid_n - 2 * NB, E, stride_l, inv_temp, scale, TOPK, KP, NORM,
                       TEMP, BLOCK_E, LIBDEVICE)


@triton.jit
def _route_gate_up_gemv(x_ptr, KW, stride_x, xs_ptr, stride_xs, b1_ptr, sb1_ptr, b3_ptr, sb3_ptr, p_ptr, N, KSPLIT, NB, stride_bn,
                        stride_sbn, stride_ps, stride_pm, l_ptr, bias_ptr, ids_ptr, w_ptr, E, stride_l, inv_temp, scale,
                        WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_ASM: tl.constexpr, QX: tl.constexpr, ROUTE: tl.constexpr, TOPK: tl.constexpr,
                        KP: tl.constexpr, NORM: tl.constexpr, TEMP: tl.constexpr, BLOCK_E: tl.constexpr,
                        LIBDEVICE: tl.constexpr):
    """``_route_gate_up`` with the W1 | W3 stream as CUDA-core GEMV programs (``step_proj_v41._gemv_tile``: raw
    bf16 rows quantised per 32 inside, before (QX 1) or by each program first into ``xs_ptr`` (QX 2);
    ``gemv_mx``'s word-wise FP8 decode):
    program columns [0, NB) W1 into partial columns [0, N), [NB, 2·NB) W3 into [N, 2N), then (ROUTE) one
    routing program per token."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    if pid_n < NB:
        _gemv_tile(x_ptr, b1_ptr, sb1_ptr, p_ptr, pid_n, pid_s, N, KW, KSPLIT, stride_x, stride_bn, stride_sbn,
                   stride_ps, stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, QX, xs_ptr, stride_xs)
    elif pid_n < 2 * NB:
        _gemv_tile(x_ptr, b3_ptr, sb3_ptr, p_ptr + N, pid_n - NB, pid_s, N, KW, KSPLIT, stride_x, stride_bn,
                   stride_sbn, stride_ps, stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, QX, xs_ptr, stride_xs)
    elif ROUTE:  # noqa: SIM102  (a constexpr branch, then a runtime one)
        if pid_s == 0:
            _route_row(l_ptr, bias_ptr, ids_ptr, w_ptr, pid_n - 2 * NB, E, stride_l, inv_temp, scale, TOPK, KP, NORM,
                       TEMP, BLOCK_E, LIBDEVICE)


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


@triton.jit
def _reduce_add(p_ptr, r_ptr, out_ptr, D, S, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D: tl.constexpr):
    """out = bf16(fp32(routed) + fp32(bf16(Σ_s p))) (slice order)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(S):
        acc += tl.load(p_ptr + s * stride_ps + t * stride_pm + cols, mask=cm, other=0.0)
    y = acc.to(tl.bfloat16).to(tl.float32)
    routed = tl.load(r_ptr + t * stride_r + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (routed + y).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _add_block(p_ptr, r_ptr, out_ptr, t, blk, D, S, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D: tl.constexpr,
               CG: tl.constexpr):
    """out[t, block] = bf16(fp32(routed) + fp32(bf16(Σ_s p))) (slice order; CG: the partials from L2)."""
    cols = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(S):
        if CG:
            acc += tl.load(p_ptr + s * stride_ps + t * stride_pm + cols, mask=cm, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(p_ptr + s * stride_ps + t * stride_pm + cols, mask=cm, other=0.0)
    y = acc.to(tl.bfloat16).to(tl.float32)
    routed = tl.load(r_ptr + t * stride_r + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (routed + y).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _w2_fused(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, S2, stride_p1s, stride_p1m, stride_a,
              stride_w, stride_s, stride_ps, stride_pm, limit, cnt_ptr, r_ptr, out_ptr, stride_r, stride_o, h_ptr,
              post_ptr, comb_ptr, h_out_ptr, stride_st, stride_sn, stride_ht, stride_hn, WB: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
              LIBDEVICE: tl.constexpr, BLOCK_D: tl.constexpr, MIX: tl.constexpr, NS: tl.constexpr,
              PRO: tl.constexpr = True):
    """The shared expert's W2 and its finish in one launch: :func:`_w2_swiglu_gemv`'s program, then (as
    ``step_proj_v41._gemv_post``) a barrier and one acquire-release increment of its ``BLOCK_D``-column block's
    counter; the program that takes it to the block's last count resets it and runs ``_reduce_add`` (MIX:
    ``_reduce_add_post``) for the block and each row, the partials from L2. The bits of those launches. PRO
    False: the SwiGLU rows come quantised (``_swiglu_quant`` launched before; ``gemv_fp8``'s loop on them)."""
    if PRO:
        _w2_swiglu_tile(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, stride_p1s, stride_p1m,
                        stride_a, stride_w, stride_s, stride_ps, stride_pm, limit, WB, ROWS, BLOCK_N, BLOCK_K,
                        USE_ASM, LIBDEVICE)
    else:
        _gemv_tile(x_ptr, w_ptr, s_ptr, p_ptr, tl.program_id(0), tl.program_id(1), N, KW, KSPLIT, stride_a // 2,
                   stride_w, stride_s, stride_ps, stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, 1)
    tl.debug_barrier()   # every thread's partials stored before the release
    blk = (tl.program_id(0) * BLOCK_N) // BLOCK_D
    done = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
    if done == (BLOCK_D // BLOCK_N) * S2 - 1:
        tl.atomic_xchg(cnt_ptr + blk, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
        for t in tl.static_range(ROWS):
            _add_block(p_ptr, r_ptr, out_ptr, t, blk, N, S2, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D, True)
            if MIX:
                tl.debug_barrier()   # the block, stored by every thread of the program, then read back
                _post_block(out_ptr, h_ptr, post_ptr, comb_ptr, h_out_ptr, t, blk, N, stride_o, stride_st, stride_sn,
                            stride_ht, stride_hn, NS, BLOCK_D)


@triton.jit
def _reduce_add_post(p_ptr, r_ptr, out_ptr, D, S, stride_ps, stride_pm, stride_r, stride_o, s_ptr, post_ptr, comb_ptr,
                     h_out_ptr, stride_st, stride_sn, stride_ht, stride_hn, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_reduce_add`` of one (token, column block) into ``out``, then the mHC post mix of that block
    (``mhc._mhc_post``'s code, ``BLOCK_D`` its block width) into ``h_out``."""
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(D, BLOCK_D)
    t = pid // nb
    blk = pid - t * nb
    _add_block(p_ptr, r_ptr, out_ptr, t, blk, D, S, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D, False)
    tl.debug_barrier()   # the block, stored by every thread of the program, then read back
    _post_block(out_ptr, s_ptr, post_ptr, comb_ptr, h_out_ptr, t, blk, D, stride_o, stride_st, stride_sn, stride_ht,
                stride_hn, N, BLOCK_D)


def _slices(N: int, K: int, rows: int) -> tuple[int, int, int, int]:
    """(S, ksplit, block_m, block_n) of ``splitk_mx.splitk_mm`` with ``decode="fp8"`` for an [N, K] weight."""
    from redknot.kernels.triton import splitk_mx as sk
    block_n = sk.SCALED_BLOCK_N
    bk = sk.block_k_for(K, False, sk.SCALED_BLOCK_K)
    S = sk.split_count(N, K, block_n, bk, sk.SCALED_MIN_STEPS) if rows <= sk.SPLIT_MAX_ROWS else 1
    ksplit = cdiv(cdiv(K, S), bk) * bk
    return cdiv(K, ksplit), ksplit, sk.dense_row_tile(rows), block_n


def _check_shared(u, w1, s1, w3, s3, w2, block: int, name: str):
    D = u.shape[1]
    inter = w1.shape[0]
    w2_shape = (D, inter) if w2 is None else tuple(w2.shape)
    if w1.shape != (inter, D) or w3.shape != w1.shape or w2_shape != (D, inter):
        raise ValueError(f"{name}: weights {tuple(w1.shape)}, {tuple(w3.shape)}, {w2_shape} "
                         f"do not fit u [T, {D}]: W1, W3 must be [I, {D}] and W2 [{D}, I]")
    if D % 32 or inter % 32 or block % 32:
        raise ValueError(f"{name}: D={D}, I={inter}, block={block} must be multiples of 32")
    if s1.stride() != s3.stride() or w1.stride() != w3.stride():
        raise ValueError(f"{name}: W1 and W3 (and their scales) must have the same strides")


def _gate_up_launch(u, w1, s1, w3, s3, block: int, route=None, stream: str | None = None) -> torch.Tensor:
    """The W1 | W3 partials [S, T, 2I] (``_route_gate_up``); ``route``: (logits, bias, ids, w, k, temp, norm,
    scale), the router's programs (one per token) in the same launch. ``stream``: ``fp8`` (the FP8 MMA stream) or
    a ``step_proj_v41.STEP_SMALL_TUNER`` GEMV name (at most ``gemv_mx.MAX_ROWS`` bf16 rows: ``_route_gate_up_gemv``,
    ``qgemv*`` with the rows quantised once by a ``qdq_bf16`` launch before, ``pgemv*`` by each program first; each
    linear's slice sums the bits of ``gemv_mx.gemv_fp8``); None: ``step_proj_v41.small_choice``'s for (W1, W3)."""
    from redknot.kernels.triton import step_proj_v41 as sp
    T, D = u.shape
    inter = w1.shape[0]
    if stream is None:
        stream = sp.small_choice("gate_up", u, [w1, w3], block,
                                 lambda c: _gate_up_launch(u[:1], w1, s1, w3, s3, block, stream=c)) or "fp8"
    if stream != "fp8":
        return sp._with_check(u.device, stream, lambda: _gate_up_gemv(u, w1, s1, w3, s3, block, route, stream),
                              lambda: _gate_up_launch(u, w1, s1, w3, s3, block, route, "fp8"))
    S1, ks1, bm, bn = _slices(inter, D, T)
    p1 = torch.empty(S1, T, 2 * inter, dtype=torch.float32, device=u.device)
    groups = 4 if ks1 % 128 == 0 and D % 128 == 0 else 1
    nb = cdiv(inter, bn)
    rargs, rkw = _route_args(route, p1)
    _route_gate_up[(cdiv(T, bm), 2 * nb + (T if route is not None else 0), S1)](
        u, w1, s1, w3, s3, p1, T, inter, D, ks1, nb, u.stride(0), w1.stride(0), s1.stride(0), p1.stride(0),
        p1.stride(1), *rargs, WB=block, BLOCK_M=bm, BLOCK_N=bn, GROUPS=groups, LIBDEVICE=_LIBDEVICE, **rkw,
        num_warps=4, num_stages=4)
    return p1


def _route_args(route, p1):
    """The router's launch arguments and constexprs (unread placeholders without ``route``)."""
    if route is None:
        return (p1, p1, p1, p1, 0, 0, 1.0, 1.0), {"ROUTE": False, "TOPK": 1, "KP": 1, "NORM": False, "TEMP": False,
                                                  "BLOCK_E": 16}
    logits, bias, ids, w, k, temp, norm, scale = route
    rargs = (logits, bias, ids, w, logits.shape[1], logits.stride(0), float(np.float32(1.0) / np.float32(temp)),
             float(scale))
    return rargs, {"ROUTE": True, "TOPK": k, "KP": next_pow2(k), "NORM": bool(norm), "TEMP": temp != 1.0,
                   "BLOCK_E": max(16, next_pow2(logits.shape[1]))}


def _gate_up_gemv(u, w1, s1, w3, s3, block: int, route, name: str) -> torch.Tensor:
    """:func:`_gate_up_launch` with the GEMV shape ``name``: one launch, the W1 | W3 partials [S, T, 2I] with the K
    slices ``gemv_mx.slices`` cuts for [I, D]."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes, qdq_bf16
    from redknot.kernels.triton.step_proj_v41 import plan_name, quantise_mode
    plan = gemv_mx.PLANS[plan_name(name)]
    mode = quantise_mode(name)
    T, D = u.shape
    inter = w1.shape[0]
    if T > gemv_mx.MAX_ROWS or u.dtype != torch.bfloat16 or block % plan.block_n or u.stride(0) % 2:
        raise ValueError(f"route_and_gate_up: the GEMV stream takes at most {gemv_mx.MAX_ROWS} bf16 rows and a "
                         f"scale tile ({block}) that its {plan.block_n} columns divide")
    bk = gemv_mx._block_k(D, plan.block_k)
    S, ks = gemv_mx.slices(inter, D, plan)
    p1 = torch.empty(S, T, 2 * inter, dtype=torch.float32, device=u.device)
    nb = cdiv(inter, plan.block_n)
    b1, b3 = as_bytes(w1).view(torch.int32), as_bytes(w3).view(torch.int32)
    rargs, rkw = _route_args(route, p1)
    if mode == 1:
        u = qdq_bf16(u)
    xs = torch.empty(T, D, dtype=torch.bfloat16, device=u.device) if mode == 2 else u
    _route_gate_up_gemv[(2 * nb + (T if route is not None else 0), S)](
        u.view(torch.int32), D // 4, u.stride(0) // 2, xs.view(torch.int32), xs.stride(0) // 2, b1, s1, b3, s3, p1, inter, ks, nb, b1.stride(0), s1.stride(0),
        p1.stride(0), p1.stride(1), *rargs, WB=block, ROWS=T, BLOCK_N=plan.block_n, BLOCK_K=bk,
        USE_ASM=gemv_mx._use_asm(), QX=mode, LIBDEVICE=_LIBDEVICE, **rkw, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    return p1


def post_mix_fits(D: int, h: torch.Tensor) -> bool:
    """Whether :func:`shared_expert_finish` can end with the mHC post mix over ``h`` [T, n, D] (``mhc_post``'s
    column blocks tile D, n a power of two)."""
    n = h.shape[1]
    bd = min(512, next_pow2(D))
    return h.dim() == 3 and h.shape[2] == D and D % bd == 0 and n & (n - 1) == 0


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


def w2_self_check(name: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when :func:`_w2_gemv` with ``name`` computes, at one and three rows of random W1 | W3 partials, the W2
    sums the split-K ``registers`` stream computes on the ``fp8`` path's quantised SwiGLU rows (``_swiglu_quant``'s
    e4m3 + E8M0, dequantised) within ``stream_guard.CHECK_TOL``, else what differs: the first-use check of the
    shared expert's W2 GEMV (``stream_guard.first_use``, key ``("step_w2", name)``)."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import splitk_mx
    from redknot.kernels.triton.stream_guard import CHECK_TOL, _rel
    g = torch.Generator(device=device).manual_seed(seed)
    inter, D, S1, limit = 1024, 96, 3, 10.0
    w2, s2 = mx.quant_fp8_blocks(torch.randn(D, inter, generator=g, device=device) * 0.02, 32)
    s2 = s2.view(torch.uint8)
    worst = 0.0
    for rows in (1, 3):
        p1 = torch.randn(S1, rows, 2 * inter, generator=g, device=device) * 2
        aq = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=device)
        sa = torch.empty(rows, inter // 32, dtype=torch.uint8, device=device)
        _swiglu_quant[(rows, inter // 32 // 16)](p1, aq, sa, inter, S1, p1.stride(0), p1.stride(1), aq.stride(0),
                                                 sa.stride(0), limit, BLOCK_G=16, LIBDEVICE=_LIBDEVICE, num_warps=4)
        act = (aq.float().view(rows, -1, 32) * torch.exp2(sa.float() - 127)[..., None]).view(rows, inter)
        want = splitk_mx.splitk_mm(act.to(torch.bfloat16), w2, s2, rows, w_fp4=False, wb=32,
                                   decode="registers").sum(0)
        if name.startswith(("fpgemv", "fgemv")):  # the finish in W2's launch: the bits of the launches, twice
            w2b, s2b = mx.quant_fp8_blocks(torch.randn(1024, inter, generator=g, device=device) * 0.02, 32)
            routed = torch.randn(rows, 1024, generator=g, device=device).to(torch.bfloat16)
            h = torch.randn(rows, 4, 1024, generator=g, device=device).to(torch.bfloat16)
            mix = (h, torch.rand(rows, 4, generator=g, device=device), torch.rand(rows, 4, 4, generator=g,
                                                                                device=device))
            for m in (None, mix, None):
                got = shared_expert_finish(p1, w2b, s2b, limit, routed, mix=m, stream=name)
                if not torch.equal(got, shared_expert_finish(p1, w2b, s2b, limit, routed, mix=m, stream=name[1:])):
                    return f"shared expert W2 GEMV {name}: the finish in the W2 launch differs from the launches"
        else:
            worst = max(worst, _rel(_w2_gemv(p1, w2, s2, limit, 32, name).sum(0), want))
    return None if worst <= CHECK_TOL else (f"shared expert W2 GEMV {name} differs from decode='registers' by "
                                            f"{worst:.3g} (tolerance {CHECK_TOL:g})")


def shared_expert_finish(p1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float, routed: torch.Tensor,
                         block: int = 32, prologue: bool | None = None, mix=None,
                         stream: str | None = None) -> torch.Tensor:
    """bf16(routed + W2(SwiGLU)) [T, D] from the W1 | W3 partials ``p1`` [S, T, 2I] of :func:`route_and_gate_up`:
    the SwiGLU + quantisation, the W2 stream, the reduction with the combine (``prologue``: the W2 stream
    forms its input; None: up to ``PROLOGUE_MAX_ROWS`` rows). Same bits either way. ``mix`` = (h, post, comb): the
    last launch also runs ``mhc_post(out, h, post, comb)`` per block and returns h' [T, n, D] (the same bits;
    ``post_mix_fits`` must hold). ``stream``: W2's weight stream, ``fp8`` or (at most ``gemv_mx.MAX_ROWS`` bf16
    rows) a ``gemv_mx.PLANS`` dense shape (:func:`_w2_gemv`: one launch more, W2's sums those of
    ``gemv_mx.gemv_fp8``, behind ``stream_guard``'s first-use check of that shape) or that shape with a ``p``
    (the same sums, the SwiGLU formed in the W2 launch: no launch more); None:
    ``step_proj_v41.small_choice``'s with ``STEP_W2_TUNER`` (``fp8`` first)."""
    from redknot.kernels.triton import step_proj_v41 as sp
    from redknot.kernels.triton.stream_fp8 import fp8_stream

    S1, T, two_i = p1.shape
    inter = two_i // 2
    D = w2.shape[0]
    if w2.shape != (D, inter) or routed.shape != (T, D):
        raise ValueError(f"shared_expert_finish: W2 {tuple(w2.shape)} and routed {tuple(routed.shape)} must be "
                         f"[D, {inter}] and [{T}, D]")
    out = torch.empty(T, D, dtype=routed.dtype, device=p1.device)
    if T == 0:
        return out if mix is None else torch.empty_like(mix[0])
    s2 = s2.view(torch.uint8)
    if stream is None:
        def timed(c):  # STEP_W2_TUNER times a choice on the first row
            one = None if mix is None else (mix[0][:1], mix[1][:1], mix[2][:1])
            return shared_expert_finish(p1[:, :1], w2, s2, limit, routed[:1], block, prologue, one, stream=c)
        stream = sp.small_choice("w2", routed, [w2], block, timed, tuner=sp.STEP_W2_TUNER) or "fp8"
    if stream != "fp8":
        def fast():
            if stream.startswith(("fpgemv", "fgemv")):
                return _w2_fused_launch(p1, w2, s2, limit, block, stream, routed, out, mix)
            return _finish(_w2_gemv(p1, w2, s2, limit, block, stream), routed, out, mix)
        if p1.device.type != "cuda":
            return fast()
        from redknot.kernels.triton import stream_guard
        return stream_guard.first_use(("step_w2", stream), stream_guard._CHECKED, stream_guard.DECODE_ERRORS,
                                      lambda: w2_self_check(stream, p1.device), fast,
                                      lambda: shared_expert_finish(p1, w2, s2, limit, routed, block, prologue, mix,
                                                                   stream="fp8"), stream_guard._fail)
    S2, ks2, bm2, bn2 = _slices(D, inter, T)
    p2 = torch.empty(S2, T, D, dtype=torch.float32, device=p1.device)
    if prologue is None:
        prologue = T <= PROLOGUE_MAX_ROWS
    if prologue:
        g2 = 4 if ks2 % 128 == 0 and inter % 128 == 0 else 1
        _w2_swiglu_stream[(cdiv(T, bm2), cdiv(D, bn2), S2)](
            p1, w2, s2, p2, T, D, inter, S1, ks2, p1.stride(0), p1.stride(1), w2.stride(0), s2.stride(0),
            p2.stride(0), p2.stride(1), float(limit), WB=block, BLOCK_M=bm2, BLOCK_N=bn2, GROUPS=g2,
            LIBDEVICE=_LIBDEVICE, num_warps=4, num_stages=4)
    else:
        aq = torch.empty(T, inter, dtype=torch.float8_e4m3fn, device=p1.device)
        sa = torch.empty(T, inter // 32, dtype=torch.uint8, device=p1.device)
        bg = min(16, next_pow2(inter // 32))
        _swiglu_quant[(T, cdiv(inter // 32, bg))](p1, aq, sa, inter, S1, p1.stride(0), p1.stride(1), aq.stride(0),
                                                  sa.stride(0), float(limit), BLOCK_G=bg, LIBDEVICE=_LIBDEVICE,
                                                  num_warps=4)
        fp8_stream(aq, sa, w2, s2, p2, ks2, block, bm2, bn2, num_warps=4)
    return _finish(p2, routed, out, mix)


def _w2_fused_launch(p1, w2, s2, limit: float, block: int, name: str, routed, out, mix):
    """:func:`shared_expert_finish` with ``fpgemv*``: W2 (its SwiGLU formed inside) and the finish in one
    ``_w2_fused`` launch; ``fgemv*``: ``_swiglu_quant`` (the rows quantised once), then W2 and the finish in one
    launch (at most ``gemv_mx.MAX_ROWS`` rows; D a multiple of the 512-column block)."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes
    from redknot.kernels.triton.step_proj_v41 import _counters, plan_name
    plan = gemv_mx.PLANS[plan_name(name)]
    S1, T, two_i = p1.shape
    inter = two_i // 2
    D = w2.shape[0]
    bd = min(512, next_pow2(D))
    if T > gemv_mx.MAX_ROWS or block % plan.block_n or D % bd or bd % plan.block_n:
        raise ValueError(f"shared_expert_finish: {name} takes at most {gemv_mx.MAX_ROWS} rows, D ({D}) a multiple "
                         f"of its {bd}-column block and a scale tile ({block}) its {plan.block_n} columns divide")
    routed = routed if routed.stride(-1) == 1 else routed.contiguous()
    act = torch.empty(T, inter, dtype=torch.bfloat16, device=p1.device)
    bk = gemv_mx._block_k(inter, plan.block_k)
    S2, ks2 = gemv_mx.slices(D, inter, plan)
    p2 = torch.empty(S2, T, D, dtype=torch.float32, device=p1.device)
    wb = as_bytes(w2).view(torch.int32)
    pro = name.startswith("fpgemv")
    if not pro:
        bg = min(16, next_pow2(inter // 32))
        _swiglu_quant[(T, cdiv(inter // 32, bg))](p1, act, act, inter, S1, p1.stride(0), p1.stride(1), act.stride(0),
                                                  0, float(limit), BLOCK_G=bg, LIBDEVICE=_LIBDEVICE, QDQ_BF16=True,
                                                  num_warps=4)
    if mix is not None:
        sh, post, comb, h_out = _mix_rows(mix, T, D)
        margs = (sh, post, comb, h_out, sh.stride(0), sh.stride(1), h_out.stride(0), h_out.stride(1))
    else:
        margs = (out, out, out, out, 0, 0, 0, 0)
    _w2_fused[(cdiv(D, plan.block_n), S2)](
        p1, act, act.view(torch.int32), wb, s2, p2, D, inter // 4, ks2, S1, S2, p1.stride(0), p1.stride(1),
        act.stride(0), wb.stride(0), s2.stride(0), p2.stride(0), p2.stride(1), float(limit),
        _counters(p1.device, D // bd), routed, out, routed.stride(0), out.stride(0), *margs, WB=block, ROWS=T,
        BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(), LIBDEVICE=_LIBDEVICE, BLOCK_D=bd,
        MIX=mix is not None, NS=mix[0].shape[1] if mix is not None else 1, PRO=pro, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    return out if mix is None else h_out


def _mix_rows(mix, T: int, D: int):
    """The mHC post mix's operands for W2's [T, D] output: (h contiguous, post fp32, comb fp32, h' to fill)."""
    h, post, comb = mix
    if not post_mix_fits(D, h) or h.shape[0] != T:
        raise ValueError(f"shared_expert_finish: h {tuple(h.shape)} does not fit the post mix of [{T}, {D}]")
    sh = h.contiguous()
    return sh, post.float().contiguous(), comb.float().contiguous(), torch.empty_like(sh)


def _finish(p2: torch.Tensor, routed: torch.Tensor, out: torch.Tensor, mix) -> torch.Tensor:
    """:func:`shared_expert_finish`'s last launch: W2's slices summed, rounded, added to ``routed`` into ``out``
    (and with ``mix`` the mHC post mix, returning h')."""
    S2, T, D = p2.shape
    routed = routed if routed.stride(-1) == 1 else routed.contiguous()
    if mix is not None:
        sh, post, comb, h_out = _mix_rows(mix, T, D)
        bd = min(512, next_pow2(D))
        _reduce_add_post[(T * (D // bd),)](p2, routed, out, D, S2, p2.stride(0), p2.stride(1), routed.stride(0),
                                           out.stride(0), sh, post, comb, h_out, sh.stride(0), sh.stride(1),
                                           h_out.stride(0), h_out.stride(1), N=sh.shape[1], BLOCK_D=bd, num_warps=4)
        return h_out
    bd = min(1024, next_pow2(D))
    _reduce_add[(T, cdiv(D, bd))](p2, routed, out, D, S2, p2.stride(0), p2.stride(1), routed.stride(0),
                                  out.stride(0), BLOCK_D=bd, num_warps=4)
    return out


def route_and_gate_up(logits: torch.Tensor, bias: torch.Tensor, k: int, temp: float, norm: bool, scale: float,
                      u: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                      block: int = 32, stream: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, weights) of :func:`route_topk` and the shared expert's W1 | W3 partials [S, T, 2I] in one launch
    (u bf16 [T, D]; W1, W3 e4m3 [I, D] with E8M0 tiles of ``block``); :func:`shared_expert_finish` ends it.
    ``stream``: the W1 | W3 weight stream (:func:`_gate_up_launch`; None: the step's 1-4-row choice)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"route_and_gate_up: logits {logits.dtype} and bias {bias.dtype} must be float32")
    if not 0 < k <= E:
        raise ValueError(f"route_and_gate_up: k={k} must be in 1..{E} (the expert count)")
    if u.shape[0] != T:
        raise ValueError(f"route_and_gate_up: u has {u.shape[0]} rows, the logits {T}")
    s1, s3 = s1.view(torch.uint8), s3.view(torch.uint8)
    _check_shared(u, w1, s1, w3, s3, None, block, "route_and_gate_up")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, w, torch.empty(1, 0, 2 * w1.shape[0], dtype=torch.float32, device=u.device)
    p1 = _gate_up_launch(u, w1, s1, w3, s3, block, (logits, bias.contiguous(), ids, w, k, temp, norm, scale),
                         stream)
    return ids, w, p1


def shared_expert_combine(u: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          w2: torch.Tensor, s2: torch.Tensor, limit: float, routed: torch.Tensor,
                          block: int = 32, prologue: bool | None = None) -> torch.Tensor:
    """bf16(routed + W2(SwiGLU(u))) [T, D]: u bf16 [T, D]; W1, W3 e4m3 [I, D] and W2 e4m3 [D, I] with E8M0
    tiles of ``block``; routed [T, D] 16-bit (the routed experts' sum). Four launches (module docstring), three
    with ``prologue`` (the W2 stream forms its input; None: up to ``PROLOGUE_MAX_ROWS`` rows). Same bits."""
    T, D = u.shape
    s1, s3 = s1.view(torch.uint8), s3.view(torch.uint8)
    _check_shared(u, w1, s1, w3, s3, w2, block, "shared_expert_combine")
    if routed.shape != (T, D):
        raise ValueError(f"shared_expert_combine: routed {tuple(routed.shape)} must be [{T}, {D}]")
    if T == 0:
        return torch.empty(T, D, dtype=routed.dtype, device=u.device)
    u = u if u.stride(-1) == 1 else u.contiguous()
    return shared_expert_finish(_gate_up_launch(u, w1, s1, w3, s3, block), w2, s2, limit, routed, block, prologue)
