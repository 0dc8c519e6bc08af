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
from redknot.models.deepseek_v41.ref_math import (
    Numerics,
    Weights,
    acc_linear,
    linear,
    topk_ids,
)
from redknot.step.overlap import beside


def route(u: torch.Tensor, w: Weights, prefix: str, cfg, acc: torch.dtype):
    """-> (expert ids [T, k], weights [T, k]) in the accumulation dtype. Where the row kernels run, the tail
    after the logits (sqrt-softplus, bias, top-k, normalisation) is one launch (``step_moe_v41.route_topk``,
    the step's router: ties to the lower id, ids ascending, PyTorch's CUDA transcendentals) instead of about
    ten, two of them sorts of [T, E]."""
    from redknot.models.deepseek_v41 import fused_rows

    k = cfg.n_activated_experts
    if fused_rows.PREFILL_ROWS["route"] and acc == torch.float32 and u.dim() == 2 and fused_rows.fused(w, u):
        from redknot.kernels.triton.step_moe_v41 import route_topk

        got = fused_rows._guarded(route_topk, acc_linear(u, w, f"{prefix}.gate.weight", acc),
                                  w.float(f"{prefix}.gate.bias"), k, cfg.gate_temp, cfg.norm_topk_prob and k > 1,
                                  cfg.route_scale)
        if got is not None:
            return got
    logits = acc_linear(u, w, f"{prefix}.gate.weight", acc) / cfg.gate_temp
    scores = torch.sqrt(F.softplus(logits))                                    # [T, E]
    ids = topk_ids(scores + w.float(f"{prefix}.gate.bias"), cfg.n_activated_experts)
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.route_scale


def swiglu_act(x: torch.Tensor, w: Weights, prefix: str, num: Numerics, limit: float,
               weight: torch.Tensor | None) -> torch.Tensor:
    """SwiGLU(x) · weight in the compute dtype (W2's input): fp32 clamp / SiLU / product, one cast. Where the
    row kernels run (``fused_rows.fused``, fp32 accumulation) the activation is one pass
    (``prefill_rows_v41.swiglu_rows``: PyTorch's CUDA transcendental and division) instead of seven fp32 ones."""
    from redknot.models.deepseek_v41 import fused_rows

    g = linear(x, w, f"{prefix}.w1.weight", num)
    u = linear(x, w, f"{prefix}.w3.weight", num)
    if (fused_rows.PREFILL_ROWS["swiglu"] and g.dim() == 2 and g.dtype == u.dtype == num.dtype
            and num.acc == torch.float32 and fused_rows.fused(w, g)
            and g.stride(-1) == 1 and u.stride(-1) == 1):
        from redknot.kernels.triton.prefill_rows_v41 import swiglu_rows

        wt = None if weight is None else weight.to(num.acc)
        act = fused_rows._guarded(swiglu_rows, g, u, limit, wt, num.dtype)
        if act is not None:
            return act
    gate = g.to(num.acc).clamp(max=limit)
    up = u.to(num.acc).clamp(-limit, limit)
    act = F.silu(gate) * up
    if weight is not None:
        act = act * weight.unsqueeze(-1)
    return act.to(num.dtype)


def swiglu_expert(x: torch.Tensor, w: Weights, prefix: str, num: Numerics, limit: float,
                  weight: Optional[torch.Tensor]) -> torch.Tensor:
    """W2(bias-free SwiGLU(x) · weight) -> [N, D] in the accumulation dtype."""
    return linear(swiglu_act(x, w, prefix, num, limit, weight), w, f"{prefix}.w2.weight", num).to(num.acc)


def moe_post(u: torch.Tensor, w: Weights, layer: int, cfg, num: Numerics, mix) -> torch.Tensor | None:
    """``hc_expand(moe_forward(u, ...), *mix)`` with ``mix`` = (h, post, comb) of the fused mHC site, for the rows
    the step kernels leave to the registry ops (more than ``step_moe_v41.MAX_ROWS``: prefill chunks, large
    batches): the routed experts (``moe_mx``) and the shared expert's W2 output stay bf16 and one launch sums
    them, rounds once and runs the post mix (``prefill_rows_v41.add_post``: the bits of the fp32 combine followed
    by ``mhc_post``). None where it does not apply (the caller runs ``moe_forward`` and the site's post)."""
    from redknot.models.deepseek_v41 import fused_rows

    prefix = f"layers.{layer}.ffn"
    h, post, comb = mix
    ops = ops_of(w)
    if (not fused_rows.PREFILL_ROWS["add_post"] or getattr(w, "expert_dispatch", None) is not None
            or u.dim() != 2 or num.acc != torch.float32
            or h.dtype != num.dtype or not fused_rows.fused(w, u) or ops.moe_mx is None
            or not (w.keep and num.act_quant and ops._dtype_ok("moe_mx", num))):
        return None
    from redknot.kernels.triton.step_moe_v41 import MAX_ROWS

    if u.shape[0] <= MAX_ROWS:
        return None
    sp = f"{prefix}.shared_experts"
    routed, shared = beside(u, lambda: ops.moe(u, *route(u, w, prefix, cfg, num.acc), w, prefix, cfg, num),
                            lambda: linear(swiglu_act(u, w, sp, num, cfg.swiglu_limit, None), w, f"{sp}.w2.weight",
                                           num))
    if routed is None:
        return None
    if routed.dtype == shared.dtype == num.dtype and routed.stride(-1) == 1 and shared.stride(-1) == 1:
        from redknot.kernels.triton.prefill_rows_v41 import add_post

        got = fused_rows._guarded(add_post, routed, shared, h, post, comb)
        if got is not None:
            return got
    from redknot.models.deepseek_v41.mhc import hc_expand

    return hc_expand((routed.to(num.acc) + shared.to(num.acc)).to(num.dtype), h, post, comb)


def moe_forward(u: torch.Tensor, w: Weights, layer: int, cfg, num: Numerics,
                prefix: Optional[str] = None) -> torch.Tensor:
    """u [T, D] -> [T, D]: routed experts (rows grouped by expert, fp32 sum) + shared expert.
    ``prefix``: the tensors' name prefix (default ``layers.{layer}.ffn``; DSpark stages ``mtp.{s}.ffn``)."""
    prefix = prefix or f"layers.{layer}.ffn"
    dispatch = getattr(w, "expert_dispatch", None)   # expert parallel (parallel.py), else None
    ep_layer = None if dispatch is None else dispatch.get(prefix)
    if ep_layer is None and prefix == f"layers.{layer}.ffn":
        # Few rows on the step kernels: the tensor step's fused MoE, so an eager decode or verify step and
        # its CUDA-graph replay compute the same bits (None elsewhere: the paths below).
        fused = moe_step_kernels(u, w, prefix, cfg, num)
        if fused is not None:
            return fused
    ids, weights = route(u, w, prefix, cfg, num.acc)
    if ep_layer is not None:  # routed experts over the EP group; the shared expert stays local
        routed = ep_layer.dispatcher(None, u, ids, weights, ep_layer.experts, ep_layer.limit)
        out = routed.to(num.acc) + swiglu_expert(u, w, f"{prefix}.shared_experts", num, cfg.swiglu_limit, None)
        return out.to(num.dtype)
    ops = ops_of(w)
    # the shared expert on the side stream next to the routed experts (redknot.step.overlap, where it is on)
    routed, shared = beside(u, lambda: None if ops is None else ops.moe(u, ids, weights, w, prefix, cfg, num),
                            lambda: swiglu_expert(u, w, f"{prefix}.shared_experts", num, cfg.swiglu_limit, None))
    if routed is not None:  # MXFP4 experts through the registry's grouped kernel
        return (routed.to(num.acc) + shared).to(num.dtype)
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
    out += shared
    return out.to(num.dtype)


def _fp8_linear_weights(ops, w: Weights, name: str, num: Numerics):
    """(e4m3 weight, E8M0 scale) when ``linear`` would run ``name`` through the registry's ``linear_mx``
    (the conditions of ``V41Ops.linear``), else None."""
    if ops.linear_mx is None or not (w.keep and num.act_quant and ops._dtype_ok("linear_mx", num)):
        return None
    weight, scale = w.tensors.get(name), w.tensors.get(Weights.scale_name(name))
    if weight is None or scale is None or weight.dtype != torch.float8_e4m3fn:
        return None
    return weight, scale


def _step_router_logits(u: torch.Tensor, w: Weights, name: str, num: Numerics) -> torch.Tensor:
    """The router's fp32 logits for :func:`moe_step_kernels`: ``F.linear`` on fp32 copies, or at 1-4 bf16 rows on
    a bf16-stored gate weight ``step_router_v41.router_logits`` (a tuner's choice among that, a bf16 GEMM with
    fp32 output and a Triton GEMV: the same exact products in another fp32 summation order)."""
    from redknot.kernels.triton.step_router_v41 import MAX_ROWS, router_logits

    wt = w.tensors.get(name)
    if (u.dim() == 2 and u.shape[0] <= MAX_ROWS and u.dtype == torch.bfloat16 and num.acc == torch.float32
            and wt is not None and wt.dtype == torch.bfloat16 and wt.dim() == 2 and wt.shape[1] == u.shape[1]):
        return router_logits(u, wt, lambda: w.dense(name, num.acc))
    return F.linear(u.to(num.acc), w.dense(name, num.acc))


def moe_step_kernels(u: torch.Tensor, w: Weights, prefix: str, cfg, num: Numerics, mix=None):
    """:func:`moe_forward`'s routed + shared sum for the tensor step's few rows with the fused decode kernels
    (``redknot.kernels.triton.step_moe_v41``): after the router's GEMV one launch for its tail and top-k and the
    shared expert's W1 | W3, the registry's grouped routed experts, then the shared expert's W2 with the
    combine in two or three launches. None where they do not apply (no Triton step kernels, more than
    ``MAX_ROWS`` rows, weights not kept FP8 / MXFP4, a kernel that does not build): the caller runs the
    PyTorch / per-linear path. ``mix`` = (h, post, comb) of the fused mHC site: returns (out, mixed), ``mixed``
    telling that ``out`` is already ``site_post(moe, h, post, comb)`` (the last launch runs the post mix too)."""
    from redknot.models.deepseek_v41 import fused_rows

    if u.dim() != 2 or num.acc != torch.float32 or not fused_rows.fused(w, u):
        return None
    from redknot.kernels.triton.step_moe_v41 import (
        MAX_ROWS,
        post_mix_fits,
        route_and_gate_up,
        shared_expert_finish,
    )

    ops = ops_of(w)
    sp = f"{prefix}.shared_experts"
    shared = [_fp8_linear_weights(ops, w, f"{sp}.{p}.weight", num) for p in ("w1", "w3", "w2")]
    if u.shape[0] > MAX_ROWS or any(s is None for s in shared) or ops.moe_mx is None:
        return None
    (w1, s1), (w3, s3), (w2, s2) = shared
    k = cfg.n_activated_experts
    logits = _step_router_logits(u, w, f"{prefix}.gate.weight", num)
    got = fused_rows._guarded(route_and_gate_up, logits, w.float(f"{prefix}.gate.bias"), k, cfg.gate_temp,
                              cfg.norm_topk_prob and k > 1, cfg.route_scale, u.to(num.dtype), w1, s1, w3, s3)
    if got is None:
        return None
    ids, weights, gate_up = got
    routed = ops.moe(u, ids, weights, w, prefix, cfg, num)
    if routed is None:
        return None
    if mix is not None and post_mix_fits(w2.shape[0], mix[0]) and mix[0].dtype == routed.dtype:
        got = fused_rows._guarded(shared_expert_finish, gate_up, w2, s2, cfg.swiglu_limit, routed, mix=mix)
        if got is not None:
            return got, True
    out = fused_rows._guarded(shared_expert_finish, gate_up, w2, s2, cfg.swiglu_limit, routed)
    if out is None:
        out = (routed.to(num.acc) + swiglu_expert(u, w, sp, num, cfg.swiglu_limit, None)).to(num.dtype)
    return out if mix is None else (out, False)
