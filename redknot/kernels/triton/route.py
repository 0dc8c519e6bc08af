"""V4's MoE routing (the ``route`` registry op) in one launch: one program per token holds the token's expert
affinities, takes its experts (the hash table's row, or the top-k of affinities + bias by repeated maxima: best
first, ties to the lower expert id) and renormalises their affinities to sum 1 times the routed scale, instead of
the reference's five to seven PyTorch launches (index or add + top-k, gather, sum, add, divide, multiply).

``router_mm``: the affinities themselves (``router_scores``) at many rows, ``sqrt(softplus(x · Wᵀ))`` for bf16 rows
and a bf16 router weight as one tiled tensor-core GEMM with the softplus and sqrt in its epilogue. The reference
widens x and W to fp32 (a [T, D] fp32 copy, the weight's copy every call), runs an fp32 GEMM on the FMA units
and two elementwise passes; bf16 x bf16 products are exact in fp32, so the MMA's fp32 sums differ from the
reference's only in their order, as another fp32 GEMM's would."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2
from redknot.kernels.triton.gemv_bf16 import _epilogue


@triton.jit
def _route(s_ptr, b_ptr, tab_ptr, ids_ptr, idx_ptr, w_ptr, E, stride_s, stride_tab, scaling, K: tl.constexpr,
           HASH: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    em = e < E
    kk = tl.arange(0, KP)
    km = kk < K
    row = s_ptr + t.to(tl.int64) * stride_s
    if HASH:
        tok = tl.load(ids_ptr + t).to(tl.int64)
        ids = tl.load(tab_ptr + tok * stride_tab + kk, mask=km, other=0).to(tl.int64)
        w = tl.load(row + ids, mask=km, other=0.0)
    else:
        sc = tl.load(row + e, mask=em, other=0.0)
        v = tl.where(em, sc + tl.load(b_ptr + e, mask=em, other=0.0), float("-inf"))
        ids = tl.zeros([KP], tl.int64)
        w = tl.zeros([KP], tl.float32)
        for j in tl.static_range(K):
            best = tl.max(v, 0)
            i = tl.min(tl.where(v == best, e, EP), 0)   # the lowest expert id among equal maxima
            ids = tl.where(kk == j, i.to(tl.int64), ids)
            w = tl.where(kk == j, tl.sum(tl.where(e == i, sc, 0.0), 0), w)
            v = tl.where(e == i, float("-inf"), v)
    w = w / (tl.sum(tl.where(km, w, 0.0), 0) + 1e-20) * scaling
    tl.store(idx_ptr + t * K + kk, ids, mask=km)
    tl.store(w_ptr + t * K + kk, w, mask=km)


def supported(scores: torch.Tensor, top_k: int) -> bool:
    """One program holds a token's affinities: up to 4096 experts, fp32, contiguous rows."""
    return (scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(-1) == 1
            and 0 < scores.shape[1] <= 4096 and 0 < top_k <= scores.shape[1])


def route(scores: torch.Tensor, bias: Optional[torch.Tensor], tid2eid: Optional[torch.Tensor],
          input_ids: torch.Tensor, top_k: int, scaling: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``reference.route`` in one launch (see the module docstring)."""
    T, E = scores.shape
    idx = torch.empty(T, top_k, dtype=torch.int64, device=scores.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=scores.device)
    if T == 0:
        return idx, w
    hashed = tid2eid is not None
    tab = tid2eid if hashed else scores
    _route[(T,)](scores, bias if bias is not None else scores, tab, input_ids if hashed else scores, idx, w, E,
                 scores.stride(0), tab.stride(0), float(scaling), K=top_k, HASH=hashed, EP=next_pow2(E),
                 KP=next_pow2(top_k), num_warps=4)
    return idx, w


@dataclass(frozen=True)
class RouterPlan:
    """``router_mm``'s launch shape: ``block_m`` rows x ``block_n`` experts a program, ``block_k`` deep steps."""
    block_m: int
    block_n: int
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


# ``router_scores`` past the GEMV rows, per row class and router shape: the reference first (what runs untimed
# off the GPU and under capture), then tiles for prefill chunks (V4: [8192, 4096] x [256, 4096]: 128 or 64
# programs) and for a few dozen rows (narrow expert blocks, so that several programs stream the weight).
ROUTER_TUNER = ConfigTuner("router_scores_rows", [
    "reference", RouterPlan(64, 256, 64, 8, 3), RouterPlan(128, 128, 64, 8, 3), RouterPlan(64, 128, 64, 4, 4),
    RouterPlan(32, 32, 128, 4, 3), RouterPlan(16, 16, 256, 4, 3),
])


@triton.jit
def _router_mm(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, stride_w, stride_o, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    xrow = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    wrow = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        km = kk < K
        a = tl.load(xrow + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)   # [BM, BK] bf16
        b = tl.load(wrow + kk[None, :], mask=cmask[:, None] & km[None, :], other=0.0)   # [BN, BK] bf16
        acc += tl.dot(a, tl.trans(b))   # exact products, fp32 sums
    y = _epilogue(acc, 1)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], y,
             mask=rmask[:, None] & cmask[None, :])


def router_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``router_mm`` takes these operands: 2-D bf16 rows and a bf16 ``[E, D]`` weight, both with
    contiguous rows."""
    return (x.dim() == 2 and weight.dim() == 2 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.shape[1] == weight.shape[1] and x.stride(-1) == 1 and weight.stride(-1) == 1)


def router_mm(x: torch.Tensor, weight: torch.Tensor, plan: RouterPlan, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``sqrt(softplus(x · weightᵀ))`` [T, E] fp32 for bf16 x [T, D] and weight [E, D] (``router_mm_supported``)."""
    if not router_mm_supported(x, weight):
        raise ValueError(f"router_mm: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}: "
                         "needs bf16 rows and a bf16 [E, D] weight with contiguous rows")
    T, D = x.shape
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device) if out is None else out
    if T == 0:
        return out
    _router_mm[(cdiv(T, plan.block_m), cdiv(E, plan.block_n))](
        x, weight, out, T, E, D, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return out


def router_choice(x: torch.Tensor, weight: torch.Tensor, reference) -> object:
    """``ROUTER_TUNER``'s choice for this call's class: ``"reference"`` or a ``RouterPlan`` (timed on these rows;
    the class is the row count's power of two, at most 16384, and the router's shape)."""
    key = (min(next_pow2(x.shape[0]), 16384), tuple(weight.shape), str(x.dtype))

    def run(choice):
        return reference(x, weight) if choice == "reference" else router_mm(x, weight, choice)
    return ROUTER_TUNER.pick(key, run, x.device)
