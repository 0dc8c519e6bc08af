"""Blackwell (sm100) vendor bindings: FlashMLA sparse attention, DeepGEMM FP8 GEMMs.

These wrappers translate the registry signatures to the vendors' documented interfaces and cannot run
without the vendors' packages and a matching GPU; inputs they do not cover go to the reference op.

* ``sparse_attention`` (``flash_mla``): ``flash_mla_sparse_fwd`` over one key buffer made of the SWA
  ring, this step's rows and the compressed-entry pool, with per-query row indices (-1 = none).
* ``linear`` / ``moe`` (``deep_gemm``): FP8 e4m3 weights with 128×128 block scales through
  ``fp8_gemm_nt`` / ``m_grouped_fp8_gemm_nt_contiguous`` (activations quantised per 1×128 group);
  other weight formats use the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from redknot.kernels import ref_attention, ref_moe
from redknot.kernels import reference as ref
from redknot.kernels.bindings import require
from redknot.kernels.registry import register
from redknot.kernels.step_index import step_tensors


def attention_rows(q, kv, swa_ring, sinks, window: int, meta, extra_pool, extra_idx):
    """(keys ``[R+T+P, D]``, row indices ``[T, W+K]`` int32, -1 = none) for one key buffer made of the
    flattened ring, this step's rows and the flattened pool (the layout ``flash_mla_sparse_fwd`` reads)."""
    st = step_tensors(meta)
    pos = meta.positions.long()
    seq = st.token_seq.long()
    ring_rows = swa_ring.shape[0] * swa_ring.shape[1]
    offs = torch.arange(window, device=pos.device)
    p = pos[:, None] - window + 1 + offs[None, :]  # [T, W] window positions, oldest first
    ctx = st.context_lens.long()[seq][:, None]
    fresh = ring_rows + st.query_start.long()[seq][:, None] + (p - ctx)
    slot = meta.seq_slots.long()[seq][:, None]
    old = slot * swa_ring.shape[1] + torch.remainder(p, swa_ring.shape[1])
    swa = torch.where(p >= ctx, fresh, old)
    swa = torch.where(p >= 0, swa, torch.full_like(swa, -1))
    parts = [swa_ring.reshape(ring_rows, -1), kv]
    idx = [swa]
    if extra_idx is not None and extra_pool is not None:
        per_block = extra_pool.shape[1]
        w = extra_idx.long()
        blk = meta.block_tables.long()[seq[:, None], torch.clamp(w, min=0) // per_block]
        rows = ring_rows + kv.shape[0] + blk * per_block + torch.remainder(w, per_block)
        idx.append(torch.where(w >= 0, rows, torch.full_like(rows, -1)))
        parts.append(extra_pool.reshape(-1, extra_pool.shape[-1]))
    return torch.cat(parts), torch.cat(idx, dim=1).to(torch.int32)


@register("sparse_attention", "flash_mla")
def sparse_attention(q, kv, swa_ring, sinks, scale: float, window: int, meta, extra_pool=None, extra_idx=None,
                     q_tile: int = 256) -> torch.Tensor:
    flash_mla = require("flash_mla", "flash_mla")
    keys, idx = attention_rows(q, kv, swa_ring, sinks, window, meta, extra_pool, extra_idx)
    out = flash_mla.flash_mla_sparse_fwd(q.contiguous(), keys.unsqueeze(1).contiguous(), idx.unsqueeze(1), scale,
                                         q.shape[-1], sinks.float())[0]
    return out.to(q.dtype)


def _quant_act(x: torch.Tensor):
    from redknot.kernels.triton.fp8 import quantize_act  # 1x128 groups, power-of-two scales

    return quantize_act(x.contiguous(), ue8m0=True)


@register("linear", "deep_gemm")
def linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    if weight.dtype != torch.float8_e4m3fn or scale is None:
        return F.linear(x, weight.to(x.dtype)) if weight.is_floating_point() else ref.linear(x, weight, scale)
    deep_gemm = require("deep_gemm", "deep_gemm")
    lead = x.shape[:-1]
    xq, xs = _quant_act(x.reshape(-1, x.shape[-1]))
    out = torch.empty(xq.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [M, N]
    deep_gemm.fp8_gemm_nt((xq, xs), (weight, scale.float()), out)
    return out.reshape(*lead, weight.shape[0])


@register("moe", "deep_gemm")
def moe(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit: float, w1_scale=None, w2_scale=None,
        w3_scale=None) -> torch.Tensor:
    if w1.dtype != torch.float8_e4m3fn:
        return ref_moe.moe(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale)
    deep_gemm = require("deep_gemm", "deep_gemm")
    from redknot.kernels.triton.moe import route_by_expert

    rows, inv, offs = route_by_expert(topk_idx, w1.shape[0])
    ends = offs.long()
    group = torch.searchsorted(ends, torch.arange(rows.numel(), device=x.device), right=True).to(torch.int32)

    def grouped(a, w, s):
        aq, a_s = _quant_act(a)
        out = torch.empty(a.shape[0], w.shape[1], dtype=x.dtype, device=x.device)  # [M, N]
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((aq, a_s), (w, s.float()), out, group)
        return out

    xs = x.index_select(0, rows)  # [T*k, D] grouped by expert
    act = ref_moe.swiglu(grouped(xs, w1, w1_scale), grouped(xs, w3, w3_scale), swiglu_limit)
    y = grouped(act, w2, w2_scale).float()  # [T*k, D] in expert order
    pairs = y[inv].view(topk_idx.shape[0], topk_idx.shape[1], -1) * topk_weight.float()[..., None]
    out = pairs[:, 0]
    for j in range(1, topk_idx.shape[1]):  # slot order, as the reference
        out = out + pairs[:, j]
    return out.to(x.dtype)
