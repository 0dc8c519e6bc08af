"""Checks of the sparse attention kernel (the indexer's top-k has its own module, ``checks.indexer``)."""
from __future__ import annotations

from typing import List

import torch

from redknot.kernels import ref_attention
from redknot.kernels import reference as ref
from redknot.kernels.triton import attention, ops
from redknot.kernels.triton.checks.common import (CheckResult, Dims, paged_step, poisoned, random_choice_lists,
                                                  result, rope_tables, visible_lists)


def _attention_cases(d: Dims):
    w = d.window
    return [
        ("prefill, context < window, 2 seqs", [0, 3], [5, 4]),
        ("decode x3, ragged contexts", [w + 37, 5, 3 * w + 1], [1, 1, 1]),
        ("chunk over ring + fresh rows", [2 * w + 3, 0], [w + 5, 2]),
        ("decode, more entries than top-k", [d.topk * d.csa_ratio + 77, 2 * d.hca_ratio + 5], [1, 1]),
    ]


def check_sparse_attention(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    for case, ctx, new in _attention_cases(d):
        step = paged_step(ctx, new, d.block_size, device, gen)
        meta, t = step.meta, step.num_tokens
        rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        q, kv = rnd(t, d.heads, d.head_dim), rnd(t, d.head_dim)
        ring = rnd(step.num_slots, d.window + 8, d.head_dim)
        sinks = torch.randn(d.heads, generator=gen).to(device)
        scale = d.head_dim ** -0.5
        pools = {"csa": rnd(step.num_blocks, d.block_size // d.csa_ratio, d.head_dim),
                 "hca": rnd(step.num_blocks, d.block_size // d.hca_ratio, d.head_dim)}
        lists = {"csa": random_choice_lists(meta.positions, d.csa_ratio, d.topk, gen),
                 "hca": visible_lists(meta.positions, d.hca_ratio)}
        for mode in ("swa", "csa", "hca"):
            pool, idx = (None, None) if mode == "swa" else (pools[mode], lists[mode])
            if mode == "hca" and idx is None:
                continue  # no HCA entry is visible yet in this case
            want = ref_attention.sparse_attention(q, kv, ring, sinks, scale, d.window, meta, pool, idx)
            got = ops.sparse_attention(q, kv, ring, sinks, scale, d.window, meta, pool, idx)
            rows.append(result("sparse_attention", f"{mode}: {case}", dtype, got, want))
            rows.append(_fused_rope_row(d, meta, q, kv, ring, sinks, scale, pool, idx, want, mode, case, dtype))
    return rows


def _fused_rope_row(d: Dims, meta, q, kv, ring, sinks, scale, pool, idx, want, mode, case, dtype) -> CheckResult:
    """Kernel-level call with the inverse RoPE fused, a forced 3-way key split, index loads issued a block
    ahead and a poisoned output."""
    st = ops.step_tensors(meta)
    cos, sin = rope_tables(meta.positions, d.rope_dim)
    out = poisoned(q.shape, q.dtype, q.device)
    attention.sparse_attention_paged(
        q, kv, token_seq=st.token_seq, positions=meta.positions, context_lens=st.context_lens,
        query_start=st.query_start, window=d.window, sink=sinks, scale=scale, ring=ring, seq_slots=meta.seq_slots,
        cache=pool, block_table=meta.block_tables if pool is not None else None, ratio=1,
        block_size=pool.shape[1] if pool is not None else 0, topk=idx, rope_cos=cos, rope_sin=sin, out=out,
        config=attention.AttnConfig(block_h=64, block_n=32, num_warps=8, num_stages=1, num_splits=3,
                                    prefetch=True))
    return result("sparse_attention", f"{mode}+inv-rope, 3 splits, poisoned: {case}", dtype, out,
                  ref.rope(want, cos, sin, inverse=True))
