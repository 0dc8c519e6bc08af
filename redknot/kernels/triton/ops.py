"""The ``triton`` backend of the kernel registry: the reference signatures, bound to the Triton kernels.

Ops that have no Triton kernel here (or inputs a kernel does not cover, such as packed FP4 weights)
run the reference implementation; ``KernelSet`` reports which backend each op resolved to.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from redknot.kernels import ref_attention, ref_moe
from redknot.kernels import reference as ref
from redknot.kernels.registry import register
from redknot.kernels.step_index import step_tensors
from redknot.kernels.triton import (
    attention,
    compress,
    fp8,
    gemv_bf16,
    indexer,
    mhc,
    moe,
    norm,
    route,
    step_mhc_v41,
    step_tables,
)
from redknot.kernels.triton._common import interpreting, next_pow2

BACKEND = "triton"


@register("rms_norm", BACKEND)
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return norm.rms_norm(x, weight, eps)


@register("rope", BACKEND)
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return norm.rope(x, cos, sin, inverse)


@register("rope_inplace", BACKEND)
def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    if norm.rope_inplace_supported(x, cos):
        return norm.rope_inplace(x, cos, sin, inverse)
    return ref.rope_inplace(x, cos, sin, inverse)


@register("linear", BACKEND)
def linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn and scale is not None:
        return fp8.linear_fp8(x, weight, scale)
    if weight.is_floating_point() and weight.dtype != torch.float8_e4m3fn:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (gemv_bf16.small_rows(x, rows) and x.dtype == torch.bfloat16
                and weight.dtype == torch.bfloat16 and weight.stride(-1) == 1):
            # decode at batch 1-4: a GEMV stream where the tuner measured it faster than cuBLAS for this shape
            x2 = x.reshape(rows, x.shape[-1])
            choice = gemv_bf16.linear_choice(x2, weight, lambda xt: F.linear(xt, weight))
            if choice != "cublas":
                return gemv_bf16.gemv(x2, weight, plan=gemv_bf16.PLANS[choice]).view(*x.shape[:-1], -1)
        return F.linear(x, weight.to(x.dtype))  # cuBLAS: the fastest dense float GEMM at 5+ rows
    return ref.linear(x, weight, scale)  # packed FP4: dequantised per call


@register("grouped_linear", BACKEND)
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    if (scale is None and x.dim() == 3 and gemv_bf16.small_rows(x, x.shape[0]) and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and weight.stride(-1) == 1 and weight.shape[0] % x.shape[1] == 0
            and weight.shape[1] == x.shape[2]):
        # decode at batch 1-4 (V4's wo_a): G GEMV streams in one launch where the tuner measured it faster
        choice = gemv_bf16.grouped_choice(x, weight, lambda xt: ref.grouped_linear(xt, weight))
        if choice != "bmm":
            return gemv_bf16.group_gemv(x, weight, gemv_bf16.PLANS[choice])
    return ref.grouped_linear(x, weight, scale)


@register("router_scores", BACKEND)
def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    if (gemv_bf16.small_rows(x, rows) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32)
            and weight.dtype == torch.bfloat16 and weight.stride(-1) == 1):
        # decode at batch 1-4: one launch (fp32 sums of the exact products, softplus and sqrt in the epilogue)
        # instead of the weight's fp32 copy, the GEMM and two elementwise launches
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32, device=x.device)
        return gemv_bf16.gemv(x, weight, out, gemv_bf16.ROUTER_PLAN, epilogue="softplus_sqrt")
    if rows and (x.is_cuda or interpreting()) and route.router_mm_supported(x, weight):
        # more rows (prefill, b32): one tensor-core GEMM with the epilogue, where the tuner timed it faster than
        # the reference's fp32 copies, FMA GEMM and elementwise passes
        choice = route.router_choice(x, weight, ref.router_scores)
        if choice != "reference":
            return route.router_mm(x, weight, choice)
    return ref.router_scores(x, weight)


@register("route", BACKEND)
def route_op(scores, bias, tid2eid, input_ids, top_k: int, scaling: float):
    hashed_ok = tid2eid is None or (tid2eid.dim() == 2 and tid2eid.shape[1] == top_k and tid2eid.stride(-1) == 1
                                    and input_ids.dim() == 1)
    if route.supported(scores, top_k) and hashed_ok and (bias is not None or tid2eid is not None):
        return route.route(scores, bias, tid2eid, input_ids, top_k, scaling)
    return ref.route(scores, bias, tid2eid, input_ids, top_k, scaling)


@register("rope_cos_sin", BACKEND)
def rope_cos_sin(positions: torch.Tensor, inv: torch.Tensor):
    if positions.dim() == 1 and inv.dim() == 1 and (positions.is_cuda or interpreting()):
        return step_tables.cos_sin_rows(positions, inv)
    return ref.rope_cos_sin(positions, inv)


@register("ring_write", BACKEND)
def ring_write(values: torch.Tensor, ring: torch.Tensor, seq_slots: torch.Tensor, positions: torch.Tensor) -> None:
    if step_tables.supported_ring_write(values, ring, seq_slots, positions):
        return step_tables.ring_write(values, ring, seq_slots, positions)
    return ref.ring_write(values, ring, seq_slots, positions)


@register("visible_entries", BACKEND)
def visible_entries(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    if positions.dim() == 1 and (positions.is_cuda or interpreting()):
        return step_tables.visible_entries(positions, ratio, width)
    return ref.visible_entries(positions, ratio, width)


@register("rms_norm_rope", BACKEND)
def rms_norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    if norm.norm_rope_supported(x, cos) and (x.is_cuda or interpreting()):
        return norm.norm_rope(x, weight, eps, cos, sin)
    return norm.rope(norm.rms_norm(x, weight, eps), cos, sin)


@register("mhc_pre", BACKEND)
def mhc_pre(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
    if streams.shape[1] & (streams.shape[1] - 1):
        return ref.mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return mhc.mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)


def _small_site(streams: torch.Tensor, norm_weight) -> bool:
    """Whether a V4 site takes the two-launch forms of ``step_mhc_v41``: 1-4 rows of a power-of-two count of 16-bit
    streams, and a norm weight."""
    t, n, _ = streams.shape
    return (gemv_bf16.small_rows(streams, t) and not n & (n - 1) and streams.dtype in (torch.bfloat16, torch.float16)
            and norm_weight is not None)


@register("mhc_pre_norm", BACKEND)
def mhc_pre_norm(streams, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm_weight,
                 rms_eps: float):
    if _small_site(streams, norm_weight):
        # decode at 1-4 rows: the mixing pass and one finish per token that also collapses and normalises (two
        # launches, where mhc_pre and rms_norm take three)
        u, _pre, post, comb = step_mhc_v41.site_pre(streams, None, fn, base, scale, norm_weight, sinkhorn_iters,
                                                    hc_eps, norm_eps, rms_eps=rms_eps)
        return u, post, comb
    u, post, comb = mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return rms_norm(u, norm_weight, rms_eps), post, comb


@register("mhc_post", BACKEND)
def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    if streams.shape[1] & (streams.shape[1] - 1):
        return ref.mhc_post(y, streams, post, comb)
    return mhc.mhc_post(y, streams, post, comb)


@register("mhc_post_pre_norm", BACKEND)
def mhc_post_pre_norm(y, streams, post, comb, fn, base, scale, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
                      norm_weight, rms_eps: float):
    if _small_site(streams, norm_weight) and y.dtype == streams.dtype:
        # decode at 1-4 rows: the post mix and the next site's mixing dots in one pass, then its finish (two
        # launches, where mhc_post, mhc_pre and rms_norm take four)
        out, u, _pre, post2, comb2 = step_mhc_v41.post_site_pre(y, streams, post, comb, fn, base, scale,
                                                                norm_weight, sinkhorn_iters, hc_eps, norm_eps,
                                                                rms_eps)
        return out, u, post2, comb2
    out = mhc_post(y, streams, post, comb)
    return (out,) + mhc_pre_norm(out, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, rms_eps)


@register("mhc_head", BACKEND)
def mhc_head(streams, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    if streams.shape[1] & (streams.shape[1] - 1):
        return ref.mhc_head(streams, fn, base, scale, hc_eps, norm_eps)
    return mhc.mhc_head(streams, fn, base, scale, hc_eps, norm_eps)


@register("moe", BACKEND)
def moe_op(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit: float, w1_scale=None, w2_scale=None,
           w3_scale=None) -> torch.Tensor:
    packed = any(w.dtype in (torch.int8, torch.uint8) for w in (w1, w2, w3))
    if packed:
        return ref_moe.moe(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale)
    return moe.moe_experts(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale, w3_scale)


@register("moe_shared", BACKEND)
def moe_shared(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit: float, w1_scale, w2_scale, w3_scale, shared_w1,
               shared_w2, shared_w3, shared_w1_scale, shared_w2_scale, shared_w3_scale, shared_idx,
               shared_weight) -> torch.Tensor:
    plain = [w1_scale, w2_scale, w3_scale, shared_w1_scale, shared_w2_scale, shared_w3_scale] == [None] * 6
    if (plain and moe.gemv_shapes(x, w1, w2, w3) and shared_w1.shape == w1.shape[1:]
            and shared_w2.shape == w2.shape[1:] and shared_w3.shape == w3.shape[1:]
            and all(w.dtype == torch.bfloat16 for w in (shared_w1, shared_w2, shared_w3))):
        # decode at batch 1-4: the shared expert in the routed experts' two GEMV launches, where the tuner chose
        # the GEMV stream for the routed ones
        plan = moe.gemv_plan(x, topk_idx.shape[1], w1, w2, w3, swiglu_limit)
        if plan is not None:
            return gemv_bf16.moe_gemv(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, plan=plan,
                                      shared=(shared_w1, shared_w2, shared_w3))
    if (plain and x.dim() == 2 and x.shape[0] > 0 and not moe.gemv_shapes(x, w1, w2, w3) and w1.shape[0] > 1
            and x.is_floating_point() and all(w.dtype == x.dtype for w in (w1, w2, w3, shared_w1, shared_w2, shared_w3))
            and shared_idx.shape[1] == 1):
        # rows the library GEMMs take (more than the GEMV streams' 4): the shared expert's rows added in the routed
        # experts' combine
        return moe.moe_shared_rows(x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, shared_w1, shared_w2,
                                   shared_w3, shared_weight)
    return ref_moe.moe_shared_with(moe_op, x, topk_idx, topk_weight, w1, w2, w3, swiglu_limit, w1_scale, w2_scale,
                                   w3_scale, shared_w1, shared_w2, shared_w3, shared_w1_scale, shared_w2_scale,
                                   shared_w3_scale, shared_idx, shared_weight)


@register("compressor", BACKEND)
def compressor(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
               has_prev: bool) -> torch.Tensor:
    if compress.supported(kv, gate, ape, ratio):
        return compress.compress(kv, gate, ape, ratio, overlap, has_prev)
    return ref_attention.compressor(kv, gate, ape, ratio, overlap, has_prev)


@register("compressor_decode", BACKEND)
def compressor_decode(kv, gate, kv_ring, gate_ring, ring_dest, window_src, window_valid, ape, norm_weight, eps,
                      ratio, overlap, cos, sin, closes, pool_dest, pool) -> None:
    if compress.decode_supported(kv, gate, kv_ring, gate_ring, ape, norm_weight, ratio, cos, pool):
        return compress.compress_decode(kv, gate, kv_ring, gate_ring, ring_dest, window_src, window_valid, ape,
                                        norm_weight, eps, ratio, overlap, cos, sin, closes, pool_dest, pool)
    return ref_attention.compressor_decode_with(compressor, norm.rms_norm, norm.rope, kv, gate, kv_ring, gate_ring,
                                                ring_dest, window_src, window_valid, ape, norm_weight, eps, ratio,
                                                overlap, cos, sin, closes, pool_dest, pool)


@register("compressor_decode_rows", BACKEND)
def compressor_decode_rows(positions, seq_slots, block_tables, ring_len: int, ratio: int, overlap: bool,
                           per_block: int, rope_inv):
    if (positions.is_cuda or interpreting()) and positions.dim() == 1 and block_tables.stride(-1) == 1:
        return compress.decode_rows(positions, seq_slots, block_tables, ring_len, ratio, overlap, per_block,
                                    rope_inv)
    return ref_attention.compressor_decode_rows(positions, seq_slots, block_tables, ring_len, ratio, overlap,
                                                per_block, rope_inv)


@register("indexer_topk", BACKEND)
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_pool: torch.Tensor, meta, ratio: int, topk: int,
                 scale: float, q_tile: int = 512) -> torch.Tensor:
    k2 = next_pow2(topk)  # the selection runs on a power of two; the best `topk` lead its list
    ids = torch.empty(q.shape[0], k2, dtype=torch.long, device=q.device)  # [T, topk]
    w = weights if weights.stride(-1) == 1 else weights.contiguous()   # the kernels take a row stride
    # the longest stream, from the host's lists (a tensor-only step's lists describe shapes, not this step)
    longest = None if meta.tensor_only else max((c + n) // ratio for c, n in zip(meta.context_lens,
                                                                               meta.num_tokens_per_seq))
    indexer.indexer_topk_paged(q.contiguous(), w, positions=step_tensors(meta).positions,
                               query_start_loc=meta.query_start_loc, keys=key_pool, block_table=meta.block_tables,
                               ratio=ratio, block_size=ratio * key_pool.shape[1], topk=k2, scale=scale, out=ids,
                               max_entries=longest)
    return ids[:, :topk]


@register("sparse_attention", BACKEND)
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, swa_ring: torch.Tensor, sinks: torch.Tensor, scale: float,
                     window: int, meta, extra_pool: Optional[torch.Tensor] = None,
                     extra_idx: Optional[torch.Tensor] = None, q_tile: int = 256) -> torch.Tensor:
    dtypes = {kv.dtype, swa_ring.dtype} | ({extra_pool.dtype} if extra_idx is not None else set())
    if len(dtypes) > 1:  # the kernel gathers every key through one pointer type
        return ref_attention.sparse_attention(q, kv, swa_ring, sinks, scale, window, meta, extra_pool,
                                              extra_idx, q_tile)
    st = step_tensors(meta)
    use_pool = extra_idx is not None and extra_pool is not None
    return attention.sparse_attention_paged(
        q.contiguous(), kv.contiguous(), token_seq=st.token_seq, positions=st.positions,
        context_lens=st.context_lens, query_start=st.query_start, window=window, sink=sinks, scale=scale,
        ring=swa_ring, seq_slots=meta.seq_slots, cache=extra_pool if use_pool else None,
        block_table=meta.block_tables if use_pool else None, ratio=1,
        block_size=extra_pool.shape[1] if use_pool else 0, topk=extra_idx if use_pool else None)
