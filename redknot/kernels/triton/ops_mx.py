"""The ``triton`` backend of the V4.1 shipped-format ops (signatures of :mod:`redknot.kernels.ref_v41`).

Inputs a kernel does not cover run the reference: a linear with activation groups other than 32, and an
Engram table in pageable host memory (the device can read only device or pinned host memory).
"""
from __future__ import annotations

from typing import Optional

import torch

from redknot.kernels import ref_v41
from redknot.kernels.registry import register
from redknot.kernels.triton import attention_mx, gemm_mx, indexer_mx, quant_mx

BACKEND = "triton"


@register("act_quant_mx", BACKEND)
def act_quant_mx(x: torch.Tensor, group: int = 32):
    return quant_mx.act_quant_mx(x, group)


@register("linear_mx", BACKEND)
def linear_mx(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int = 32,
              act_group: int = 32) -> torch.Tensor:
    if act_group != 32 or block % 32:
        return ref_v41.linear_mx(x, weight, weight_scale, block, act_group)
    k, n = x.shape[-1], weight.shape[0]
    if x.dtype == torch.bfloat16 and k and x.numel() // k > gemm_mx.SPLITK_MAX_ROWS:
        # prefill rows: the bf16 library GEMM on decoded operands or the rowwise FP8 one, measured per class
        from redknot.kernels.triton.linear_prefill_mx import linear_prefill

        x2 = x.reshape(-1, k)
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        return linear_prefill(x2, weight, weight_scale.view(torch.uint8), block).view(*x.shape[:-1], n)
    return gemm_mx.linear_mx(x, weight, weight_scale, block, act_group)


@register("moe_mx", BACKEND)
def moe_mx(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float):
    return gemm_mx.moe_mx(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit)


@register("cache_insert_mx", BACKEND)
def cache_insert_mx(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, fmt: str) -> torch.Tensor:
    return quant_mx.cache_insert_mx(cache, slots, x, fmt)


@register("sparse_attention_mx", BACKEND)
def sparse_attention_mx(q, window_cache, window_idx, sinks, scale: float, comp_cache=None, comp_idx=None,
                        q_tile: int = 128):
    return attention_mx.sparse_attention_mx(q, window_cache, window_idx, sinks, scale, comp_cache, comp_idx)


@register("indexer_topk_mx", BACKEND)
def indexer_topk_mx(q, weights, index_keys, visible, topk: int, cand_blocks: Optional[torch.Tensor] = None,
                    block_size: int = 8, bf16_scores: bool = False, q_tile: int = 256):
    return indexer_mx.indexer_topk_mx(q, weights, index_keys, visible, topk, cand_blocks, block_size, bf16_scores)


@register("indexer_candidates_mx", BACKEND)
def indexer_candidates_mx(q, weights, index_keys, visible, num_blocks: int = 2048, block_size: int = 8,
                          bf16_scores: bool = False, q_tile: int = 256):
    return indexer_mx.indexer_candidates_mx(q, weights, index_keys, visible, num_blocks, block_size, bf16_scores)


@register("indexer_source_mx", BACKEND)
def indexer_source_mx(q, weights, index_keys, visible, topk: int, num_blocks: int = 2048, block_size: int = 8,
                      bf16_scores: bool = False):
    return indexer_mx.indexer_source_mx(q, weights, index_keys, visible, topk, num_blocks, block_size, bf16_scores)


@register("engram_gather_mx", BACKEND)
def engram_gather_mx(table, table_scale, ids, dtype=torch.bfloat16):
    device_readable = table.device == ids.device or (ids.is_cuda and table.is_pinned())
    if not device_readable:
        return ref_v41.engram_gather_mx(table, table_scale, ids, dtype)
    return quant_mx.engram_gather_mx(table, table_scale, ids, dtype)
