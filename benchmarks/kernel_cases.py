"""Timed cases for ``benchmarks/kernels_v4.py``: inputs at V4 dimensions, the Triton and reference calls,
and the FLOPs / bytes each must do (the same counting as ``shared/tools/roofline.py``).

A case builder returns a :class:`Case`; building allocates its inputs on the device, so the runner
builds one case at a time and drops it before the next.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from redknot.kernels import ref_attention, ref_moe
from redknot.kernels import reference as ref
from redknot.kernels.ref_quant import quantize_fp8_block
from redknot.kernels.triton import fp8, ops
from redknot.kernels.triton.checks.common import Dims, paged_step, random_choice_lists, rel_err, visible_lists
from redknot.kernels.triton.checks.indexer import RTOL_RANDOM, exact_scores, topk_violations

CORE_FLOPS = 4  # per (query, key, head, dim): QK and PV multiply-adds


@dataclass
class Case:
    op: str
    label: str
    context: int
    tokens: int
    triton: Callable[[], torch.Tensor]
    reference: Optional[Callable[[], torch.Tensor]]
    flops: float
    bytes: float
    peak: str = "bf16"          # which matrix ceiling the FLOPs are held against
    compare: str = "rel"        # "rel": relative error vs reference; "ids": a valid top-k (``validate``)
    tol: float = 1e-2
    validate: Optional[Callable[[torch.Tensor], List[str]]] = None  # "ids": problems of the output, [] if valid


def _keys_per_query(positions: torch.Tensor, window: int, mode: str, d: Dims) -> torch.Tensor:
    swa = torch.clamp(positions + 1, max=window)
    if mode == "csa":
        return swa + torch.clamp((positions + 1) // d.csa_ratio, max=d.topk)
    if mode == "hca":
        return swa + (positions + 1) // d.hca_ratio
    return swa


def _attention_inputs(d: Dims, device, mode: str, context: int, new: int, batch: int):
    """Inputs of ``ops.sparse_attention`` for ``batch`` sequences each adding ``new`` tokens at the end of
    ``context`` tokens, and the case's FLOPs and bytes."""
    step = paged_step([context - new] * batch, [new] * batch, d.block_size, device)
    meta, t = step.meta, step.num_tokens
    dt = torch.bfloat16
    q = torch.randn(t, d.heads, d.head_dim, device=device, dtype=dt)
    kv = torch.randn(t, d.head_dim, device=device, dtype=dt)
    ring = torch.randn(step.num_slots, d.window + 8, d.head_dim, device=device, dtype=dt)
    sinks = torch.randn(d.heads, device=device)
    pool = idx = None
    if mode != "swa":
        ratio = d.csa_ratio if mode == "csa" else d.hca_ratio
        pool = torch.randn(step.num_blocks, d.block_size // ratio, d.head_dim, device=device, dtype=dt)
        idx = (random_choice_lists(meta.positions, ratio, d.topk) if mode == "csa"
               else visible_lists(meta.positions, ratio))
    scale = d.head_dim ** -0.5
    keys = _keys_per_query(meta.positions, d.window, mode, d)
    flops = float(keys.sum()) * CORE_FLOPS * d.heads * d.head_dim
    # decode: every query reads its own keys; prefill chunk: the keys of the chunk's queries overlap,
    # so count the union (window + new rows, and at most every visible entry once per sequence)
    last = _keys_per_query(meta.positions.max().view(1), d.window, mode, d)
    n_keys_read = float(keys.sum()) if new == 1 else batch * (new + float(last) - min(d.window, context))
    nbytes = 2.0 * (2 * t * d.heads * d.head_dim + n_keys_read * d.head_dim) + (idx.numel() * 8 if idx is not None else 0)
    return (q, kv, ring, sinks, scale, d.window, meta, pool, idx), t, flops, nbytes


def attention_case(d: Dims, device, mode: str, context: int, new: int, batch: int, with_ref: bool) -> Case:
    """``batch`` sequences each adding ``new`` tokens at the end of ``context`` tokens (prefill chunk or decode)."""
    args, t, flops, nbytes = _attention_inputs(d, device, mode, context, new, batch)
    return Case("sparse_attention", f"{mode} {'decode' if new == 1 else 'prefill'} b{batch}", context, t,
                lambda: ops.sparse_attention(*args),
                (lambda: ref_attention.sparse_attention(*args)) if with_ref else None, flops, nbytes)


def _paged_call(args, config):
    """``ops.sparse_attention``'s kernel call (the same lowering of the step metadata) with a fixed launch shape."""
    from redknot.kernels.step_index import step_tensors
    from redknot.kernels.triton import attention
    q, kv, ring, sinks, scale, window, meta, pool, idx = args
    st = step_tensors(meta)
    return attention.sparse_attention_paged(
        q, kv, token_seq=st.token_seq, positions=meta.positions, context_lens=st.context_lens,
        query_start=st.query_start, window=window, sink=sinks, scale=scale, ring=ring, seq_slots=meta.seq_slots,
        cache=pool, block_table=meta.block_tables if pool is not None else None, ratio=1,
        block_size=pool.shape[1] if pool is not None else 0, topk=idx, config=config)


def attention_variant_case(d: Dims, device, mode: str, context: int, new: int, batch: int, config,
                           baseline) -> Case:
    """The case of :func:`attention_case` with one fixed launch shape ``config`` (``attention.AttnConfig`` or
    the transposed prefill kernel's ``attention.PrefillTConfig``, the Gluon kernel's ``PrefillWGConfig``); its reference is the same call with the
    ``baseline`` shape (checked against the reference op in the tuned row), so ``ref ms`` / ``speedup`` read
    as the baseline's time and the variant's gain over it."""
    args, t, flops, nbytes = _attention_inputs(d, device, mode, context, new, batch)
    tag = "/".join(str(v) if not isinstance(v, bool) else ("pf" if v else "") for v in vars(config).values())
    kind = {"PrefillTConfig": "T", "PrefillWGConfig": "WG"}.get(type(config).__name__, "S")
    return Case("sparse_attention", f"{mode} {kind}[{tag.rstrip('/')}]", context, t,
                lambda: _paged_call(args, config), lambda: _paged_call(args, baseline), flops, nbytes)


def _indexer_inputs(d: Dims, device, context: int, new: int, batch: int):
    step = paged_step([context - new] * batch, [new] * batch, d.block_size, device)
    meta, t = step.meta, step.num_tokens
    ratio, dt = d.csa_ratio, torch.bfloat16
    q = torch.randn(t, d.index_heads, d.index_dim, device=device, dtype=dt)
    w = torch.randn(t, d.index_heads, device=device)
    keys = torch.randn(step.num_blocks, d.block_size // ratio, d.index_dim, device=device, dtype=dt)
    n_vis = (meta.positions + 1) // ratio
    flops = float(n_vis.sum()) * 2 * d.index_heads * d.index_dim
    entries_read = float(n_vis.sum()) if new == 1 else float(n_vis.max()) * batch
    nbytes = entries_read * d.index_dim * 2 + t * (d.index_heads * (d.index_dim * 2 + 4) + d.topk * 8)
    return (q, w, keys, meta, ratio, d.topk, d.index_dim ** -0.5), t, flops, nbytes


def indexer_case(d: Dims, device, context: int, new: int, batch: int, with_ref: bool) -> Case:
    args, t, flops, nbytes = _indexer_inputs(d, device, context, new, batch)
    q, w, keys, meta, ratio, _, _ = args

    def validate(got: torch.Tensor) -> List[str]:
        """A valid ordered top-k of the float64 scores (near-ties within fp32 rounding may go either way);
        rows identical to the reference op are only reported: one swapped near-tie differs a whole row."""
        scores = exact_scores(q, w, keys, meta, ratio, d.index_dim ** -0.5)
        return topk_violations(got, scores, meta.positions, ratio, d.topk, rtol=RTOL_RANDOM)
    return Case("indexer_topk", f"{'decode' if new == 1 else 'prefill'} b{batch}", context, t,
                lambda: ops.indexer_topk(*args), (lambda: ref_attention.indexer_topk(*args)) if with_ref else None,
                flops, nbytes, compare="ids", validate=validate)


def _indexer_call(args, config):
    """``ops.indexer_topk``'s kernel call (the same arguments) with a fixed launch shape."""
    from redknot.kernels.triton import indexer
    q, w, keys, meta, ratio, topk, scale = args
    return indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc,
                                      keys=keys, block_table=meta.block_tables, ratio=ratio,
                                      block_size=ratio * keys.shape[1], topk=topk, scale=scale, config=config)


def indexer_variant_case(d: Dims, device, context: int, new: int, batch: int, config, baseline,
                         sample: int = 64) -> Case:
    """The case of :func:`indexer_case` with one fixed launch shape ``config`` (``indexer.IndexerConfig``, or the
    pipelined prefill form's ``indexer.IndexerXConfig``: label ``X[block_t/block_n/warps/stages]``); its reference
    is the same call with the ``baseline`` shape, so ``ref ms`` / ``speedup`` read as the baseline's time and the
    variant's gain over it. The check: ``sample`` random rows of the variant's output are a valid top-k of their
    float64 scores (the rule of ``checks.indexer``; all rows would cost a float64 pass over the whole chunk)."""
    args, t, flops, nbytes = _indexer_inputs(d, device, context, new, batch)
    q, w, keys, meta, ratio, topk, scale = args
    tag = "/".join(str(v) for v in vars(config).values() if not isinstance(v, bool))
    kind = "X" if type(config).__name__ == "IndexerXConfig" else "P"

    def validate(got: torch.Tensor) -> list[str]:
        from redknot.kernels.triton import oracle
        rows = torch.randperm(t)[:sample].sort().values.tolist()
        seq = torch.repeat_interleave(torch.arange(len(meta.num_tokens_per_seq)),
                                      torch.tensor(meta.num_tokens_per_seq)).tolist()
        n_vis = ((meta.positions[rows].long() + 1) // ratio).tolist()
        scores = torch.full((len(rows), max(max(n_vis), 1)), float("-inf"), dtype=torch.float64, device=q.device)
        for r, i in enumerate(rows):
            if n_vis[r]:
                k = oracle.entry_rows(keys, meta.block_tables[seq[i]], torch.arange(n_vis[r], device=q.device), ratio,
                                      ratio * keys.shape[1]).double()
                scores[r, :n_vis[r]] = (torch.relu(q[i].double() @ k.T) * w[i].double()[:, None]).sum(0) * scale
        return topk_violations(got[rows], scores, meta.positions[rows], ratio, topk, rtol=RTOL_RANDOM)
    return Case("indexer_topk", f"prefill b{batch} {kind}[{tag}]", context, t, lambda: _indexer_call(args, config),
                lambda: _indexer_call(args, baseline), flops, nbytes, compare="ids", validate=validate)


def moe_case(d: Dims, device, tokens: int, experts: int, weights: str, with_ref: bool, cache: dict) -> Case:
    """Routed experts at V4 width (D 4096, I 2048, top-6 of ``experts``), bf16 or FP8 block-scaled weights."""
    dm, inter, k = 4096, 2048, 6
    key = (experts, weights)
    if key not in cache:
        cache.clear()
        ws = []
        for shape in ((experts, inter, dm), (experts, dm, inter), (experts, inter, dm)):
            w = torch.randn(*shape, device=device, dtype=torch.bfloat16) * shape[2] ** -0.5
            if weights == "fp8":
                q = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
                s = torch.empty(experts, shape[1] // 128, shape[2] // 128, device=device)
                for e in range(experts):
                    q[e], s[e] = quantize_fp8_block(w[e])
                ws.append((q, s))
            else:
                ws.append((w, None))
            del w
        cache[key] = ws
    (w1, s1), (w2, s2), (w3, s3) = cache[key]
    x = torch.randn(tokens, dm, device=device, dtype=torch.bfloat16)
    scores = torch.rand(tokens, experts, device=device)
    ids = scores.topk(k, dim=1).indices
    wts = torch.rand(tokens, k, device=device)
    active = int(ids.unique().numel())
    wbytes = 1 if weights == "fp8" else 2
    flops = tokens * k * 6.0 * dm * inter
    nbytes = active * 3.0 * dm * inter * wbytes + tokens * dm * 4.0
    args = (x, ids, wts, w1, w2, w3, 10.0, s1, s2, s3)
    return Case("moe", f"{weights} experts={experts}", 0, tokens, lambda: ops.moe_op(*args),
                (lambda: ref_moe.moe(*args)) if with_ref else None, flops, nbytes, tol=2e-2)


def linear_case(device, tokens: int, n: int, k: int, kind: str, with_ref: bool) -> Case:
    x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5
    flops = 2.0 * tokens * n * k
    if kind == "bf16":
        return Case("linear", f"bf16 {n}x{k}", 0, tokens, lambda: ops.linear(x, w),
                    (lambda: ref.linear(x, w)) if with_ref else None, flops, 2.0 * (n * k + tokens * (n + k)))
    wq, ws = quantize_fp8_block(w)
    nbytes = n * k + 2.0 * tokens * (n + k)
    if kind == "fp8-w8a16":
        return Case("linear", f"fp8 weight-only {n}x{k}", 0, tokens, lambda: ops.linear(x, wq, ws),
                    (lambda: ref.linear(x, wq, ws)) if with_ref else None, flops, nbytes)
    # FP8 activations too: compared against the dequantised GEMM, so the quantisation error counts (~2-3 %).
    return Case("linear", f"fp8 w8a8 {n}x{k}", 0, tokens, lambda: fp8.linear_fp8(x, wq, ws, quantize_activations=True),
                (lambda: ref.linear(x, wq, ws)) if with_ref else None, flops, nbytes, peak="fp8", tol=5e-2)


def small_op_cases(device, tokens: int, with_ref: bool):
    """Memory-bound ops at V4 width: bytes read + written once is their floor."""
    dt, dm, hc, heads, hd = torch.bfloat16, 4096, 4, 64, 512
    x = torch.randn(tokens, dm, device=device, dtype=dt)
    wt = torch.rand(dm, device=device) + 0.5
    q = torch.randn(tokens, heads, hd, device=device, dtype=dt)
    ang = torch.rand(tokens, 32, device=device) * 100
    cos, sin = ang.cos(), ang.sin()
    streams = torch.randn(tokens, hc, dm, device=device, dtype=dt)
    fn = torch.randn((2 + hc) * hc, hc * dm, device=device) * (hc * dm) ** -0.5
    base, scale = torch.randn((2 + hc) * hc, device=device) * 0.5, torch.rand(3, device=device) + 0.5
    post, comb = torch.rand(tokens, hc, device=device), torch.rand(tokens, hc, hc, device=device)
    wr = with_ref
    yield Case("rms_norm", f"hidden {dm}", 0, tokens, lambda: ops.rms_norm(x, wt, 1e-6),
               (lambda: ref.rms_norm(x, wt, 1e-6)) if wr else None, 0.0, 4.0 * tokens * dm)
    yield Case("rope", f"q {heads}x{hd}", 0, tokens, lambda: ops.rope(q, cos, sin),
               (lambda: ref.rope(q, cos, sin)) if wr else None, 0.0, 4.0 * tokens * heads * hd)
    yield Case("mhc_pre", f"n={hc} D={dm}", 0, tokens,
               lambda: ops.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)[0],
               (lambda: ref.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)[0]) if wr else None,
               2.0 * tokens * fn.numel(), 2.0 * tokens * hc * dm + 2.0 * tokens * dm + fn.numel() * 4, peak="fp32")
    yield Case("mhc_post", f"n={hc} D={dm}", 0, tokens, lambda: ops.mhc_post(x, streams, post, comb),
               (lambda: ref.mhc_post(x, streams, post, comb)) if wr else None, 0.0, 2.0 * tokens * dm * (1 + 2 * hc))


def compare(case: Case, got, want) -> tuple:
    """(ok, error, note) of a timed case's output against the reference output."""
    if case.compare == "ids":
        bad = case.validate(got)
        same = float((got == want).all(dim=1).float().mean())
        return not bad, float(len(bad)), f"{same:.0%} rows identical to the reference; " + ("; ".join(bad[:2]) or
                                                                                             "valid top-k")
    err = rel_err(got, want)
    return err <= case.tol, err, ""
