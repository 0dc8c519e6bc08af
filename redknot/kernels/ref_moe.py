"""Reference routed-experts op of DeepSeek-V4 (reference §5)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from redknot.kernels.ref_quant import dequantize
from redknot.kernels.registry import register


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def expert_weight(w: torch.Tensor, scale: Optional[torch.Tensor], e: int, dtype) -> torch.Tensor:
    """Expert ``e``'s matrix of a stacked weight, dequantized to ``dtype``."""
    return dequantize(w[e], None if scale is None else scale[e], dtype)


def routed_slots(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int,
                 expert: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """fp32 [T, k, D]: slot (t, j) holds expert ``topk_idx[t, j]``'s output for token t times its routing
    weight. Rows are permuted by expert (stable), and ``expert(h, e)`` runs expert e once over exactly
    the rows that chose it, so a row's slots do not depend on the other rows' values."""
    t, k = topk_idx.shape
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    slots = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)  # [T*k, D]
    start = 0
    for e, cnt in enumerate(counts):
        if cnt == 0:
            continue
        rows = order[start:start + cnt]
        start += cnt
        y = expert(x[rows // k], e)
        slots[rows] = y.float() * topk_weight.reshape(-1)[rows, None].float()
    return slots.view(t, k, -1)


def gate_up_stack(w1: torch.Tensor, w3: torch.Tensor) -> Optional[torch.Tensor]:
    """``[E, 2I, D]`` (or ``[2I, D]`` for one expert's ``[I, D]``): w1 and w3 as one stack, where each expert's w3
    rows follow its w1 rows in one storage (``Experts.fuse_gate_up``, ``SharedExpert.fuse_gate_up``); else None."""
    if w1.dim() not in (2, 3) or w1.shape != w3.shape or w1.dtype != w3.dtype or w1.stride() != w3.stride():
        return None
    inter, d = w1.shape[-2:]
    if w1.stride() != (2 * inter * d, d, 1)[3 - w1.dim():]:
        return None
    if w1.untyped_storage().data_ptr() != w3.untyped_storage().data_ptr() or \
            w3.storage_offset() != w1.storage_offset() + inter * d:
        return None
    return w1.as_strided((*w1.shape[:-2], 2 * inter, d), w1.stride())


@register("moe")
def moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
        w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: float, w1_scale: Optional[torch.Tensor] = None,
        w2_scale: Optional[torch.Tensor] = None, w3_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y[t] = Σ_j topk_weight[t, j] · W2_e (swiglu(W1_e x_t, W3_e x_t)) with e = topk_idx[t, j].

    x [T, D]; topk_idx [T, k] int; topk_weight [T, k] fp32; w1/w3 [E, I, D], w2 [E, D, I] stacked
    per expert (float, FP8 + block scales, or packed FP4 + group scales). Rows are permuted by
    expert, each expert runs one GEMM over its rows, and the k contributions of a token are summed
    in slot order j = 0..k-1 (fp32), so a row's result does not depend on the other rows.
    """
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _moe_every_expert(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale)

    def expert(h: torch.Tensor, e: int) -> torch.Tensor:
        act = swiglu(F.linear(h, expert_weight(w1, w1_scale, e, x.dtype)),
                     F.linear(h, expert_weight(w3, w3_scale, e, x.dtype)), swiglu_limit)
        return F.linear(act, expert_weight(w2, w2_scale, e, x.dtype))

    return routed_slots(x, topk_idx, topk_weight, w1.shape[0], expert).sum(dim=1).to(x.dtype)


def moe_shared_with(moe_fn, x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale,
                    shared_w1, shared_w2, shared_w3, shared_w1_scale, shared_w2_scale, shared_w3_scale, shared_idx,
                    shared_weight) -> torch.Tensor:
    """``moe_shared`` composed from a backend's ``moe`` (the reference op's body)."""
    one = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731  [1, ...] expert stack
    routed = moe_fn(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale)
    shared = moe_fn(x, shared_idx, shared_weight, one(shared_w1), one(shared_w2), one(shared_w3), swiglu_limit,
                    one(shared_w1_scale), one(shared_w2_scale), one(shared_w3_scale))
    return routed + shared


@register("moe_shared")
def moe_shared(x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w1: torch.Tensor,
               w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: float, w1_scale: Optional[torch.Tensor],
               w2_scale: Optional[torch.Tensor], w3_scale: Optional[torch.Tensor], shared_w1: torch.Tensor,
               shared_w2: torch.Tensor, shared_w3: torch.Tensor, shared_w1_scale: Optional[torch.Tensor],
               shared_w2_scale: Optional[torch.Tensor], shared_w3_scale: Optional[torch.Tensor],
               shared_idx: torch.Tensor, shared_weight: torch.Tensor) -> torch.Tensor:
    """:func:`moe` of the routed experts plus the shared expert (shared_w1/w3 [I, D], shared_w2 [D, I]) as a
    one-expert :func:`moe` that every row selects (``shared_idx`` [T, 1] zeros, ``shared_weight`` [T, 1] ones),
    the two rows added in x's dtype."""
    return moe_shared_with(moe, x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale,
                           shared_w1, shared_w2, shared_w3, shared_w1_scale, shared_w2_scale, shared_w3_scale,
                           shared_idx, shared_weight)


def _moe_every_expert(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale):
    """:func:`moe` without a host sync (CUDA-graph capture): every expert runs on every row and
    each slot keeps the rows that chose it; same per-slot math and slot-order sum."""
    t, k = topk_idx.shape
    slots = torch.zeros(t, k, x.shape[1], dtype=torch.float32, device=x.device)  # [T, k, D]
    for e in range(w1.shape[0]):
        act = swiglu(F.linear(x, expert_weight(w1, w1_scale, e, x.dtype)),
                     F.linear(x, expert_weight(w3, w3_scale, e, x.dtype)), swiglu_limit)
        y = F.linear(act, expert_weight(w2, w2_scale, e, x.dtype)).float()  # [T, D]
        chosen = (topk_idx == e).unsqueeze(-1)  # [T, k, 1]
        slots = torch.where(chosen, y.unsqueeze(1) * topk_weight.float().unsqueeze(-1), slots)
    return slots.sum(dim=1).to(x.dtype)
