"""V4.1's decode MoE router and the shared expert's W1 | W3 stream: the kernels and host helpers behind
``step_moe_v41.route_topk`` and ``step_moe_v41.route_and_gate_up`` (the router's tail and top-k after its GEMV,
the W1 | W3 FP8 stream or CUDA-core GEMV, and both in one launch). The arithmetic: ``step_moe_v41``'s module
docstring."""
from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2
from redknot.kernels.triton.step_proj_v41 import _gemv_tile

# Triton's CPU interpreter runs no extern (libdevice) calls: there ``tl.exp`` / ``tl.log`` (numpy's fp32) stand in.
_LIBDEVICE = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


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
    """(ids int64 [T, k] ascending, weights fp32 [T, k]) of fp32 router logits [T, E] (see
    ``step_moe_v41``'s module docstring); ``norm``: divide by the weights' sum (``norm_topk_prob`` and k > 1)."""
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
    """``step_moe_v41._gate_up_launch`` with the GEMV shape ``name``: one launch, the W1 | W3 partials [S, T, 2I]
    with the K slices ``gemv_mx.slices`` cuts for [I, D]."""
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
