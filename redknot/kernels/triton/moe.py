"""Routed-expert MoE on Hopper: permute tokens by expert, two grouped GEMMs, fused SwiGLU, ordered combine.

The grouped GEMMs are ``torch._grouped_mm`` (CUTLASS, bf16; measured at 71 % of the H200's bf16 peak at
V4 shapes), fed with rows sorted by expert and the per-expert end offsets. Around them, two Triton
kernels: the clamped SwiGLU between the GEMMs (one pass over ``[M, 2I]``) and the combine, which sums
each token's ``k`` expert rows in fixed slot order with their routing weights, so the result does not
depend on what else is in the batch (no atomics). A stack of one expert (the shared expert, which the
model runs through the same op) skips the routing: three plain GEMMs and the SwiGLU.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from redknot.kernels.ref_moe import gate_up_stack
from redknot.kernels.triton import gemv_bf16
from redknot.kernels.triton._common import next_pow2
from redknot.kernels.triton.fp8 import block_scaled_mm


@triton.jit
def _swiglu(g_ptr, u_ptr, out_ptr, M, I, stride_g, stride_u, stride_o, limit, HAS_LIMIT: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    r64 = rows[:, None].to(tl.int64)
    g = tl.load(g_ptr + r64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], a.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _combine(y_ptr, inv_ptr, w_ptr, out_ptr, add_ptr, add_w_ptr, D, stride_y, stride_o, stride_a, K: tl.constexpr,
             BLOCK_D: tl.constexpr, ADD: tl.constexpr = False):
    """A token's K expert rows weighted and summed in slot order, rounded to the output dtype. ``ADD`` (the shared
    expert's row ``a`` and weight ``w_a``): then ``out + round(a·w_a)`` rounded again, the two rows added as two
    rows of the output dtype are added (``moe_shared``'s composition, bit for bit)."""
    tok = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in range(K):  # fixed slot order: batch-invariant
        r = tl.load(inv_ptr + tok * K + j).to(tl.int64)
        wt = tl.load(w_ptr + tok * K + j).to(tl.float32)
        acc += wt * tl.load(y_ptr + r * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    if ADD:
        wa = tl.load(add_w_ptr + tok).to(tl.float32)
        a = tl.load(add_ptr + tok.to(tl.int64) * stride_a + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + (a * wa).to(out_ptr.dtype.element_ty).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok.to(tl.int64) * stride_o + cols, y, mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: Optional[float],
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``silu(min(gate, L)) * clamp(up, -L, L)`` for gate/up ``[M, I]`` (fp32 math, one rounding)."""
    M, inter = gate.shape
    out = torch.empty(M, inter, dtype=gate.dtype, device=gate.device) if out is None else out
    if M == 0:
        return out
    bm, bi = 16, min(256, next_pow2(inter))
    _swiglu[(triton.cdiv(M, bm), triton.cdiv(inter, bi))](
        gate, up, out, M, inter, gate.stride(0), up.stride(0), out.stride(0), float(limit or 0.0),
        HAS_LIMIT=limit is not None, BLOCK_M=bm, BLOCK_I=bi, num_warps=4)
    return out


def route_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Sort the ``T·k`` (token, slot) pairs by expert.

    Returns (token row of each sorted pair ``[T·k]``, position of each pair in the sorted order
    ``[T·k]``, per-expert end offsets ``[E]`` int32).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    order = torch.sort(flat, stable=True).indices  # [T*k] pair index, grouped by expert
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)  # no host sync (CUDA graphs)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    return order // topk_ids.shape[1], inv, offs


def grouped_linear(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                   w_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of ``a`` grouped by ``offs`` (ends) times their group's ``w[g] [N, K]`` transposed → ``[M, N]``.

    e4m3 weights with 128×128 block scales go through the block-scaled Triton GEMM (weights widened in
    registers); bf16 through ``torch._grouped_mm``; anything else one matmul per non-empty group (while a
    CUDA graph is captured: one per group over all rows, the other groups' rows masked).
    """
    if w.dtype == torch.float8_e4m3fn:
        return block_scaled_mm(a, None, w, w_scale.float(), offs=offs, out_dtype=a.dtype)
    if a.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    if a.is_cuda and torch.cuda.is_current_stream_capturing():  # no host sync: every group, rows masked
        group = torch.searchsorted(offs, torch.arange(a.shape[0], device=a.device, dtype=offs.dtype), right=True)
        out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
        for g in range(w.shape[0]):
            out = torch.where((group == g)[:, None], a @ w[g].to(a.dtype).T, out)
        return out
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)  # [M, N]
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ w[g].to(a.dtype).T
        start = end
    return out


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
                w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: Optional[float],
                w1_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                w3_scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Σ over each token's k experts of ``weight · W2_e swiglu(W1_e x, W3_e x)``.

    x ``[T, D]``; topk_ids/topk_weights ``[T, k]``; w1/w3 ``[E, I, D]``; w2 ``[E, D, I]`` (float, or e4m3
    with ``[E, ·/128, ·/128]`` block scales).
    """
    T = x.shape[0]
    k = topk_ids.shape[1]
    D = w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device) if out is None else out
    if T == 0:
        return out
    if w1_scale is None and gemv_shapes(x, w1, w2, w3):
        # decode at batch 1-4: the two-launch GEMV stream where the tuner measured it faster, per expert shape
        plan = gemv_plan(x, k, w1, w2, w3, swiglu_limit)
        if plan is not None:
            return gemv_bf16.moe_gemv(x, topk_ids, topk_weights, w1, w2, w3, swiglu_limit, out, plan)
    return _moe_rows(x, topk_ids, topk_weights, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale, out)


def gemv_shapes(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether ``moe_experts`` of these rows and float experts may take the GEMV stream (bf16 rows and experts, a
    small-row call)."""
    return (gemv_bf16.small_rows(x, x.shape[0]) and x.dtype == torch.bfloat16
            and all(w.dtype == torch.bfloat16 for w in (w1, w2, w3)))


def gemv_plan(x: torch.Tensor, k: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
              swiglu_limit: Optional[float]):
    """The GEMV plan the tuner chose for these expert shapes and ``k`` slots, or None where the library GEMMs won."""
    D = w2.shape[1]

    def grouped(xg, ids, wts):
        return _moe_rows(xg, ids, wts, w1, w2, w3, swiglu_limit, None, None, None,
                         torch.empty(xg.shape[0], D, dtype=x.dtype, device=x.device))
    choice = gemv_bf16.moe_choice(x, k, w1, w2, w3, swiglu_limit, grouped)
    return None if choice == "grouped" else gemv_bf16.PLANS[choice]


def one_expert_rows(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    swiglu_limit: Optional[float]) -> torch.Tensor:
    """One expert's ``W2 swiglu(W1 x, W3 x)`` for every row (three library GEMMs and the SwiGLU; two where w1 and
    w3 are one stack, ``gate_up_stack``), unweighted: ``[T, D]`` in x's dtype."""
    w13 = gate_up_stack(w1, w3)
    if w13 is not None:
        y13 = F.linear(x, w13)   # [T, 2I]
        return F.linear(swiglu(y13[:, :w1.shape[0]], y13[:, w1.shape[0]:], swiglu_limit), w2)
    return F.linear(swiglu(F.linear(x, w1), F.linear(x, w3), swiglu_limit), w2)


def _moe_rows(x, topk_ids, topk_weights, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale, out,
              add: Optional[torch.Tensor] = None, add_weight: Optional[torch.Tensor] = None):
    """``moe_experts`` through the library GEMMs: the one-expert GEMMs, or the routed grouped GEMMs. ``add`` /
    ``add_weight`` ([T, D] rows and [T, 1] weights; routed experts only): the combine adds ``add·add_weight`` to
    each token's sum as ``moe_shared`` adds the shared expert's rows (see ``_combine``)."""
    T, k, D = x.shape[0], topk_ids.shape[1], w2.shape[1]
    if w1.shape[0] == 1 and w1.dtype == x.dtype and w1_scale is None and add is None:  # one expert: no routing
        weight = topk_weights.to(torch.float32).sum(dim=1, keepdim=True)  # [T, 1]
        return out.copy_((one_expert_rows(x, w1[0], w2[0], w3[0], swiglu_limit).float() * weight).to(out.dtype))
    rows, inv, offs = route_by_expert(topk_ids, w1.shape[0])
    xs = x.index_select(0, rows)  # [T*k, D] sorted by expert
    w13 = gate_up_stack(w1, w3) if w1_scale is None else None
    if w13 is not None:  # gate and up as one grouped GEMM [T*k, 2I]: xs read once, twice the N of each half
        inter = w1.shape[1]
        y13 = grouped_linear(xs, w13, offs)
        act = swiglu(y13[:, :inter], y13[:, inter:], swiglu_limit)  # [T*k, I]
    else:
        act = swiglu(grouped_linear(xs, w1, offs, w1_scale), grouped_linear(xs, w3, offs, w3_scale),
                     swiglu_limit)  # [T*k, I]
    y = grouped_linear(act, w2, offs, w2_scale)  # [T*k, D]
    bd = min(1024, next_pow2(D))
    weights = topk_weights.to(torch.float32).contiguous()
    aw = None if add is None else add_weight.reshape(T).to(torch.float32).contiguous()
    # no fused multiply-adds: each weighted row is rounded before it is added, as PyTorch's mul and add round it
    # (in fp32 an FMA would skip that rounding, and the shared rows added here would differ from two calls' sum)
    _combine[(T, triton.cdiv(D, bd))](y, inv, weights, out, y if add is None else add, weights if aw is None else aw,
                                      D, y.stride(0), out.stride(0), 0 if add is None else add.stride(0), K=k,
                                      BLOCK_D=bd, ADD=add is not None, num_warps=4, enable_fp_fusion=False)
    return out


def moe_shared_rows(x, topk_ids, topk_weights, w1, w2, w3, swiglu_limit, shared_w1, shared_w2, shared_w3,
                    shared_weight) -> torch.Tensor:
    """``moe_shared`` of float experts at rows the library GEMMs take: the shared expert's rows by its three GEMMs,
    then the routed experts with those rows added in their combine (no separate weighting, rounding and add
    passes over [T, D]); bit for bit ``moe_experts`` of each added as rows of x's dtype."""
    shared = one_expert_rows(x, shared_w1, shared_w2, shared_w3, swiglu_limit)
    out = torch.empty(x.shape[0], w2.shape[1], dtype=x.dtype, device=x.device)
    return _moe_rows(x, topk_ids, topk_weights, w1, w2, w3, swiglu_limit, None, None, None, out, add=shared,
                     add_weight=shared_weight)
