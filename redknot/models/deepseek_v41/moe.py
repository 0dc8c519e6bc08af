"""V4.1 MoE (reference §3.7): sqrt-softplus router, bias for selection only, normalised
top-k weights times the routed scale (1.5), SwiGLU experts clamped at ``swiglu_limit``
(10) with the routing weight applied *before* W2, plus one shared expert (weight 1,
also clamped). Routed experts are MXFP4, the shared expert FP8; in reference numerics
every expert GEMM quantises its input per 32 (W2's too, after the routing weight).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from redknot.models.deepseek_v41.kernel_ops import ops_of
from redknot.models.deepseek_v41.ref_math import Numerics, Weights, linear, topk_ids


def route(u: torch.Tensor, w: Weights, prefix: str, cfg, acc: torch.dtype):
    """-> (expert ids [T, k], weights [T, k]) in the accumulation dtype."""
    logits = F.linear(u.to(acc), w.dense(f"{prefix}.gate.weight", acc)) / cfg.gate_temp
    scores = torch.sqrt(F.softplus(logits))                                    # [T, E]
    ids = topk_ids(scores + w.float(f"{prefix}.gate.bias"), cfg.n_activated_experts)
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.route_scale


def swiglu_expert(x: torch.Tensor, w: Weights, prefix: str, num: Numerics, limit: float,
                  weight: Optional[torch.Tensor]) -> torch.Tensor:
    """W2(bias-free SwiGLU(x) · weight) -> [N, D] in the accumulation dtype."""
    gate = linear(x, w, f"{prefix}.w1.weight", num).to(num.acc).clamp(max=limit)
    up = linear(x, w, f"{prefix}.w3.weight", num).to(num.acc).clamp(-limit, limit)
    act = F.silu(gate) * up
    if weight is not None:
        act = act * weight.unsqueeze(-1)
    return linear(act.to(num.dtype), w, f"{prefix}.w2.weight", num).to(num.acc)


def moe_forward(u: torch.Tensor, w: Weights, layer: int, cfg, num: Numerics,
                prefix: Optional[str] = None) -> torch.Tensor:
    """u [T, D] -> [T, D]: routed experts (rows grouped by expert, fp32 sum) + shared expert.
    ``prefix``: the tensors' name prefix (default ``layers.{layer}.ffn``; DSpark stages ``mtp.{s}.ffn``)."""
    prefix = prefix or f"layers.{layer}.ffn"
    ids, weights = route(u, w, prefix, cfg, num.acc)
    dispatch = getattr(w, "expert_dispatch", None)   # expert parallel (parallel.py), else None
    ep_layer = None if dispatch is None else dispatch.get(prefix)
    if ep_layer is not None:  # routed experts over the EP group; the shared expert stays local
        routed = ep_layer.dispatcher(None, u, ids, weights, ep_layer.experts, ep_layer.limit)
        out = routed.to(num.acc) + swiglu_expert(u, w, f"{prefix}.shared_experts", num, cfg.swiglu_limit, None)
        return out.to(num.dtype)
    ops = ops_of(w)
    routed = None if ops is None else ops.moe(u, ids, weights, w, prefix, cfg, num)
    if routed is not None:  # MXFP4 experts through the registry's grouped kernel
        out = routed.to(num.acc) + swiglu_expert(u, w, f"{prefix}.shared_experts", num, cfg.swiglu_limit, None)
        return out.to(num.dtype)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg.n_routed_experts).tolist()
    token = order // cfg.n_activated_experts
    out = torch.zeros(u.shape[0], cfg.dim, dtype=num.acc, device=u.device)
    start = 0
    for e, c in enumerate(counts):
        if c:
            sel = order[start:start + c]
            rows = token[start:start + c]
            y = swiglu_expert(u[rows], w, f"{prefix}.experts.{e}", num, cfg.swiglu_limit, weights.flatten()[sel])
            out.index_add_(0, rows, y)
        start += c
    out += swiglu_expert(u, w, f"{prefix}.shared_experts", num, cfg.swiglu_limit, None)
    return out.to(num.dtype)
