"""Checks of the attention-side kernels: sparse attention and the lightning indexer's top-k."""
from __future__ import annotations

from typing import List

import torch

from redknot.kernels import ref_attention
from redknot.kernels import reference as ref
from redknot.kernels.triton import attention, indexer, ops, oracle
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
    """Kernel-level call with the inverse RoPE fused, a forced 3-way key split and a poisoned output."""
    st = ops.step_tensors(meta)
    cos, sin = rope_tables(meta.positions, d.rope_dim)
    out = poisoned(q.shape, q.dtype, q.device)
    attention.sparse_attention_paged(
        q, kv, token_seq=st.token_seq, positions=meta.positions, context_lens=st.context_lens,
        query_start=st.query_start, window=d.window, sink=sinks, scale=scale, ring=ring, seq_slots=meta.seq_slots,
        cache=pool, block_table=meta.block_tables if pool is not None else None, ratio=1,
        block_size=pool.shape[1] if pool is not None else 0, topk=idx, rope_cos=cos, rope_sin=sin, out=out,
        config=attention.AttnConfig(block_h=64, block_n=32, num_warps=8, num_stages=1, num_splits=3))
    return result("sparse_attention", f"{mode}+inv-rope, 3 splits, poisoned: {case}", dtype, out,
                  ref.rope(want, cos, sin, inverse=True))


def topk_violations(ids: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                    rtol: float) -> List[str]:
    """Rows whose ids are not a valid best-``topk`` list for the float64 ``scores`` (up to ``rtol`` of the
    row's largest |score|, so near-ties may go either way): wrong padding, invisible/duplicate ids, an
    entry clearly worse than the k-th best, or a clearly descending order broken."""
    bad = []
    ids, scores = ids.cpu(), scores.cpu()
    for i, p in enumerate(positions.tolist()):
        n_vis = (p + 1) // ratio
        c = min(topk, n_vis)
        row = ids[i].long()
        if (row[c:] != -1).any():
            bad.append(f"row {i}: expected {c} ids then -1, got {row.tolist()[:8]}…")
            continue
        sel = row[:c]
        if c and ((sel < 0).any() or (sel >= n_vis).any() or sel.unique().numel() != c):
            bad.append(f"row {i}: invalid or repeated ids {sel.tolist()[:8]}…")
            continue
        if c == 0:
            continue
        s = scores[i, :n_vis]
        tol = rtol * float(s.abs().max())
        kth = float(s.topk(c).values[-1])
        chosen = s[sel]
        if (chosen < kth - tol).any():
            bad.append(f"row {i}: an entry below the k-th best score {kth:.6g} was chosen")
        elif (chosen[1:] > chosen[:-1] + tol).any():
            bad.append(f"row {i}: not ordered by score")
    return bad


def _indexer_cases(d: Dims):
    cap = max(2 * d.topk, 1 << (d.topk + 64 - 1).bit_length())  # the selection buffer of the default config
    return [
        ("fewer visible than top-k", [1, 7], [3, 2]),
        ("prefill tiles across ragged seqs", [d.topk * d.csa_ratio + 5, 0, 13], [5, 7, 3]),
        ("decode, entries > selection buffer", [2 * cap * d.csa_ratio + 99, cap * d.csa_ratio + 3], [1, 1]),
    ]


def check_indexer_topk(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    ratio, scale = d.csa_ratio, d.index_dim ** -0.5
    for case, ctx, new in _indexer_cases(d) + [("ties: integer-valued scores", [40 * ratio + 2, 9], [3, 4])]:
        step = paged_step(ctx, new, d.block_size, device, gen)
        meta, t = step.meta, step.num_tokens
        integer = case.startswith("ties")
        draw = (lambda *s: torch.randint(-2, 3, s, generator=gen).float()) if integer else \
            (lambda *s: torch.randn(*s, generator=gen))
        q = draw(t, d.index_heads, d.index_dim).to(device=device, dtype=dtype)
        w = draw(t, d.index_heads).to(device)
        keys = draw(step.num_blocks, d.block_size // ratio, d.index_dim).to(device=device, dtype=dtype)
        want = ref_attention.indexer_topk(q, w, keys, meta, ratio, d.topk, scale)
        got = ops.indexer_topk(q, w, keys, meta, ratio, d.topk, scale)
        st = ops.step_tensors(meta)
        _, scores = oracle.indexer_topk_paged(q, w, token_seq=st.token_seq, positions=meta.positions, keys=keys,
                                              block_table=meta.block_tables, ratio=ratio,
                                              block_size=ratio * keys.shape[1], topk=d.topk, scale=scale)
        same = float((got == want).all(dim=1).float().mean())
        if integer:  # exact arithmetic: ties are real, so the order must match the reference exactly
            ok = bool((got == want).all())
            rows.append(CheckResult("indexer_topk", case, str(dtype).replace("torch.", ""), ok, 1.0 - same, 0.0,
                                    "exact match with the reference" if ok else "differs from the reference"))
        else:
            bad = topk_violations(got, scores, meta.positions, ratio, d.topk, rtol=1e-4)
            rows.append(CheckResult("indexer_topk", case, str(dtype).replace("torch.", ""), not bad,
                                    len(bad) / max(t, 1), 0.0,
                                    f"{same:.0%} rows identical to reference; " + ("; ".join(bad[:2]) or "valid")))
        rows.append(_indexer_poisoned_row(d, meta, q, w, keys, want, scores, integer, case, dtype))
    return rows


def _indexer_poisoned_row(d: Dims, meta, q, w, keys, want, scores, exact: bool, case, dtype) -> CheckResult:
    """Kernel-level call with a forced 2-way entry split, the smallest selection buffer (many compactions)
    and a poisoned output: every slot written."""
    out = poisoned((q.shape[0], d.topk), torch.long, q.device)
    indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc, keys=keys,
                               block_table=meta.block_tables, ratio=d.csa_ratio,
                               block_size=d.csa_ratio * keys.shape[1], topk=d.topk, scale=d.index_dim ** -0.5,
                               out=out, config=indexer.IndexerConfig(block_t=1, block_n=16, num_splits=2,
                                                                      capacity=1 << (d.topk + 16 - 1).bit_length()))
    unwritten = int((out == -7).sum())
    if exact:
        bad = [] if bool((out == want).all()) else ["differs from the reference"]
    else:
        bad = topk_violations(out, scores, meta.positions, d.csa_ratio, d.topk, rtol=1e-4)
    return CheckResult("indexer_topk", f"2 splits, poisoned: {case}", str(dtype).replace("torch.", ""),
                       unwritten == 0 and not bad, len(bad) / max(q.shape[0], 1), 0.0,
                       f"{unwritten} unwritten; " + ("; ".join(bad[:2]) or "valid"))
