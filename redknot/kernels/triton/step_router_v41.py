"""The decode MoE router's logits at 1-4 rows: fp32 [T, E] = u [T, K] · Wᵀ for bf16 rows and the bf16-stored gate
weight W [E, K], which the reference applies in fp32.

``moe.moe_step_kernels`` ran it as ``F.linear(u.to(fp32), W_fp32)``: a copy of the rows to fp32 and an fp32 GEMV
(cuBLAS ``gemvx``) over the fp32 copy of the weight (V4.1: 384 x 5120, 7.9 MB a layer). Every bf16 x bf16
product is exact in fp32, so the same logits up to the fp32 summation order come from

* ``mm``: ``torch.mm(u, Wᵀ, out_dtype=fp32)`` on the bf16 weight (one library launch, half the bytes);
* ``gemv_e*``: :func:`router_gemv`, one Triton launch: each program ``BLOCK_E`` weight rows over all of K (the
  K steps unrolled, every load issued up front), the rows' products accumulated elementwise in fp32 and added
  over K once at the end.

``ROUTER_TUNER`` (key: the weight's shape and the rows) chooses; ``fp32`` first (what ran before; taken untimed
off the GPU and for a key first met under CUDA-graph capture, so eager and graph steps keep one choice). The
logits feed the top-k, so another summation order can flip a selection between near-tied experts, as any
change of GEMM would. Not measured on the H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv

MAX_ROWS = 4
# ``gemv_e{BLOCK_E}``: weight rows per program (E / BLOCK_E programs); K steps of ``BLOCK_K`` bf16 values.
GEMV_BLOCK_E = (1, 2, 4)
BLOCK_K = 1024
ROUTER_TUNER = ConfigTuner("step_router_small", ["fp32", "mm", *(f"gemv_e{b}" for b in GEMV_BLOCK_E)])


@triton.jit
def _router_gemv(x_ptr, w_ptr, out_ptr, E, K, stride_x, stride_w, stride_o, ROWS: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, KSTEPS: tl.constexpr):
    """Program: weight rows [pid·BLOCK_E, +BLOCK_E) against ROWS bf16 rows over K (KSTEPS unrolled steps)."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < E
    e64 = tl.minimum(e, E - 1).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for s in tl.static_range(KSTEPS):
        k = s * BLOCK_K + kk
        km = k < K
        w = tl.load(w_ptr + e64[:, None] * stride_w + k[None, :], mask=km[None, :], other=0.0).to(tl.float32)
        acc0 += w * tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)[None, :]
        if ROWS > 1:
            acc1 += w * tl.load(x_ptr + stride_x + k, mask=km, other=0.0).to(tl.float32)[None, :]
        if ROWS > 2:
            acc2 += w * tl.load(x_ptr + 2 * stride_x + k, mask=km, other=0.0).to(tl.float32)[None, :]
        if ROWS > 3:
            acc3 += w * tl.load(x_ptr + 3 * stride_x + k, mask=km, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + e, tl.sum(acc0, 1), mask=emask)
    if ROWS > 1:
        tl.store(out_ptr + stride_o + e, tl.sum(acc1, 1), mask=emask)
    if ROWS > 2:
        tl.store(out_ptr + 2 * stride_o + e, tl.sum(acc2, 1), mask=emask)
    if ROWS > 3:
        tl.store(out_ptr + 3 * stride_o + e, tl.sum(acc3, 1), mask=emask)


def router_gemv(u: torch.Tensor, weight: torch.Tensor, block_e: int = 2) -> torch.Tensor:
    """fp32 logits [T, E] = u · weightᵀ for T <= ``MAX_ROWS`` bf16 rows u [T, K] and a bf16 weight [E, K]."""
    T, K = u.shape
    E = weight.shape[0]
    if (T > MAX_ROWS or u.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.shape[1] != K
            or block_e & (block_e - 1)):
        raise ValueError(f"router_gemv: u {tuple(u.shape)} {u.dtype}, weight {tuple(weight.shape)} {weight.dtype}: "
                         f"need at most {MAX_ROWS} bf16 rows, a bf16 [E, K] weight, a power-of-two block")
    out = torch.empty(T, E, dtype=torch.float32, device=u.device)
    if T == 0 or E == 0:
        return out
    u = u if u.stride(-1) == 1 else u.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    _router_gemv[(cdiv(E, block_e),)](u, weight, out, E, K, u.stride(0), weight.stride(0), out.stride(0), ROWS=T,
                                      BLOCK_E=block_e, BLOCK_K=BLOCK_K, KSTEPS=cdiv(K, BLOCK_K), num_warps=4)
    return out


def router_logits(u: torch.Tensor, w_bf16: torch.Tensor, w_fp32, choice: str | None = None) -> torch.Tensor:
    """The router's fp32 logits [T, E] of bf16 rows u [T, K] (T <= ``MAX_ROWS``): ``ROUTER_TUNER``'s choice
    (``choice`` forces one). ``w_fp32()``: the fp32 weight the ``fp32`` candidate reads (kept by the caller)."""
    T = u.shape[0]

    def run(c):
        if c == "fp32":
            return torch.nn.functional.linear(u.float(), w_fp32())
        if c == "mm":
            return torch.mm(u, w_bf16.t(), out_dtype=torch.float32)
        return router_gemv(u, w_bf16, int(c[len("gemv_e"):]))

    if choice is None:
        key = (tuple(w_bf16.shape), T)
        if key not in ROUTER_TUNER.choices and u.is_cuda and torch.cuda.is_current_stream_capturing():
            ROUTER_TUNER.choices[key] = ROUTER_TUNER.candidates[0]   # eager and graph steps: one choice
        choice = ROUTER_TUNER.pick(key, run, u.device)
    return run(choice)
