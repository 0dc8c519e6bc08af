"""Checks of the lightning indexer's streaming top-k, and what "the same top-k" means.

Contract of ``indexer_topk``: the ``topk`` entries of largest ``score(t, w) = scale · Σ_h weights[t, h] ·
relu(q[t, h] · K[w])`` among the visible ones, ordered by score, equal scores by lower entry id. The
score is a real-valued expression; every implementation evaluates it in fp32 in its own order, so two
entries whose scores differ by less than that rounding may come in either order. Hence:

* random inputs: the ids must form a valid ordered top-k of the float64 scores up to a relative
  ``rtol`` of the row's largest |score| (fp32 rounding of a 64-head sum of 128-deep dots: ~4e-6;
  ``1e-4`` leaves a margin and still catches any wrong, missing or misplaced entry);
* integer-valued inputs: every partial sum is exact in fp32, so ties are real and the order is fully
  determined: the kernel must give exactly the float64 oracle's order (lower id first among ties).
  The reference op multiplies each head's ``relu(q·k)`` by ``scale`` (128^-0.5, not representable)
  before the weighted head sum, which rounds exactly equal scores apart by an ulp, so its order among
  exact ties follows rounding, not ids; it is held to the same validity rule as random inputs (with a
  tolerance far below the smallest real score gap), which it passes.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from redknot.kernels import ref_attention
from redknot.kernels.triton import indexer, ops, oracle
from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.checks.common import CheckResult, Dims, paged_step

RTOL_RANDOM = 1e-4


def exact_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, meta, ratio: int, scale: float,
                 token_chunk: int = 64) -> torch.Tensor:
    """Float64 indexer scores ``[T, max visible]`` of every query over its sequence's visible entries
    (``-inf`` beyond), computed on the inputs' device in token chunks (vectorised form of the oracle)."""
    t_rows = q.shape[0]
    n_vis = (meta.positions.long() + 1) // ratio  # [T]
    width = max(int(n_vis.max()) if t_rows else 0, 1)
    out = torch.full((t_rows, width), float("-inf"), dtype=torch.float64, device=q.device)  # [T, N]
    block_size = ratio * keys.shape[1]
    for b, (s0, n) in enumerate(zip(meta.query_start_list, meta.num_tokens_per_seq)):
        most = int(n_vis[s0:s0 + n].max()) if n else 0
        if most == 0:
            continue
        k = oracle.entry_rows(keys, meta.block_tables[b], torch.arange(most, device=q.device), ratio,
                              block_size).double()  # [Ne, ID]
        for i0 in range(s0, s0 + n, token_chunk):
            i1 = min(s0 + n, i0 + token_chunk)
            s = torch.relu(torch.einsum("qhd,ed->qhe", q[i0:i1].double(), k))  # [q, IH, Ne]
            s = (s * weights[i0:i1].double()[:, :, None]).sum(1) * scale  # [q, Ne]
            w = torch.arange(most, device=q.device)
            out[i0:i1, :most] = s.masked_fill(w[None, :] >= n_vis[i0:i1, None], float("-inf"))
    return out


def topk_violations(ids: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                    rtol: float, limit: int = 4) -> List[str]:
    """Rows whose ids are not a valid best-``topk`` list for the float64 ``scores`` (up to ``rtol`` of the
    row's largest |score|, so near-ties may go either way): wrong padding, invisible/duplicate ids, an
    entry clearly worse than the k-th best, or a clearly descending order broken. Vectorised on the
    scores' device; at most ``limit`` rows are described."""
    dev = scores.device
    ids = ids.to(dev).long()
    t_rows, k = ids.shape
    if t_rows == 0:
        return []
    n_vis = (positions.to(dev).long() + 1) // ratio  # [T]
    c = torch.clamp(n_vis, max=topk)  # ids each row must have
    col = torch.arange(k, device=dev)[None, :]
    head = col < c[:, None]  # [T, K] slots that must hold ids
    bad_pad = ((ids != -1) & ~head).any(1)
    bad_range = (head & ((ids < 0) | (ids >= n_vis[:, None]))).any(1)
    srt = torch.sort(torch.where(head, ids, torch.full_like(ids, -1 - k)), dim=1, descending=True).values
    bad_dup = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(1)
    width = scores.shape[1]
    finite = torch.where(torch.isfinite(scores), scores, torch.zeros_like(scores))
    tol = rtol * finite.abs().amax(1)  # [T]
    kk = min(topk, width)
    best = torch.topk(scores, kk, dim=1).values  # [T, kk]
    kth = best.gather(1, (c.clamp(min=1) - 1).clamp(max=kk - 1)[:, None])[:, 0]
    chosen = scores.gather(1, ids.clamp(0, width - 1))  # [T, K]
    ok_ids = head & ~bad_range[:, None]
    bad_low = (ok_ids & (chosen < (kth - tol)[:, None])).any(1)
    pair = ok_ids[:, 1:] & ok_ids[:, :-1]
    bad_order = (pair & (chosen[:, 1:] > chosen[:, :-1] + tol[:, None])).any(1)
    reasons = [(bad_pad, "expected {c} ids then -1"), (bad_range, "invalid ids"), (bad_dup, "repeated ids"),
               (bad_low, "an entry below the k-th best score was chosen"), (bad_order, "not ordered by score")]
    any_bad = torch.zeros(t_rows, dtype=torch.bool, device=dev)
    for mask, _ in reasons:
        any_bad |= mask
    rows = torch.nonzero(any_bad).flatten().tolist()
    out = []
    for i in rows[:limit]:
        why = next(msg for mask, msg in reasons if bool(mask[i]))
        out.append(f"row {i}: {why.format(c=int(c[i]))} (ids {ids[i, :6].tolist()}...)")
    if len(rows) > limit:
        out.append(f"{len(rows)} bad rows in all")
    return out


def _indexer_cases(d: Dims):
    cap = max(2 * d.topk, 1 << (d.topk + 64 - 1).bit_length())  # the selection buffer of the default config
    return [
        ("fewer visible than top-k", [1, 7], [3, 2]),
        ("prefill tiles across ragged seqs", [d.topk * d.csa_ratio + 5, 0, 13], [5, 7, 3]),
        ("decode, entries > selection buffer", [2 * cap * d.csa_ratio + 99, cap * d.csa_ratio + 3], [1, 1]),
        ("ties: integer-valued scores", [40 * d.csa_ratio + 2, 9], [3, 4]),
    ]


def check_indexer_topk(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    ratio, scale = d.csa_ratio, d.index_dim ** -0.5
    dt = str(dtype).replace("torch.", "")
    for case, ctx, new in _indexer_cases(d):
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
        scores = exact_scores(q, w, keys, meta, ratio, scale)
        same = float((got == want).all(dim=1).float().mean())
        if integer:
            exact = _exact_order(scores, d.topk)
            rows.append(_exact_row(case, dt, got, exact, f"{same:.0%} rows identical to the reference op"))
            ref_bad = topk_violations(want, scores, meta.positions, ratio, d.topk, rtol=1e-7)
            rows.append(CheckResult("indexer_topk", "ties: reference op valid under exact scores", dt, not ref_bad,
                                    len(ref_bad) / max(t, 1), 0.0, "; ".join(ref_bad[:2]) or "valid"))
        else:
            exact = None
            bad = topk_violations(got, scores, meta.positions, ratio, d.topk, rtol=RTOL_RANDOM)
            rows.append(CheckResult("indexer_topk", case, dt, not bad, len(bad) / max(t, 1), 0.0,
                                    f"{same:.0%} rows identical to reference; " + ("; ".join(bad[:2]) or "valid")))
        rows.append(_indexer_poisoned_row(d, meta, q, w, keys, exact, scores, case, dt))
    return rows


def _exact_order(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Ids ``[T, topk]`` by float64 score, equal scores by lower id (-1 padded): the contract's order."""
    order = torch.sort(scores, dim=1, descending=True, stable=True)
    k = min(topk, scores.shape[1])
    top = order.indices[:, :k]
    ids = torch.where(torch.isfinite(order.values[:, :k]), top, torch.full_like(top, -1))
    if k < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - k), -1)], dim=1)
    return ids


def _exact_row(case: str, dt: str, got: torch.Tensor, exact: torch.Tensor, note: str) -> CheckResult:
    same = float((got.long() == exact.to(got.device)).all(dim=1).float().mean())
    ok = same == 1.0
    return CheckResult("indexer_topk", case, dt, ok, 1.0 - same, 0.0,
                       ("identical to the exact-arithmetic order; " if ok else "differs from the exact order; ") + note)


def _indexer_poisoned_row(d: Dims, meta, q, w, keys, exact: Optional[torch.Tensor], scores, case, dt) -> CheckResult:
    """Kernel-level call with a forced 2-way entry split, the smallest selection buffer (many compactions),
    block-table lookups issued a block ahead, heads on the dot's M axis (the plain call runs the default,
    heads on N) and a poisoned output: every slot written."""
    out = torch.full((q.shape[0], d.topk), -7, dtype=torch.long, device=q.device)
    indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc, keys=keys,
                               block_table=meta.block_tables, ratio=d.csa_ratio,
                               block_size=d.csa_ratio * keys.shape[1], topk=d.topk, scale=d.index_dim ** -0.5,
                               out=out, config=indexer.IndexerConfig(
                                   block_t=1, block_n=16, num_splits=2, prefetch=True, heads_on_n=False,
                                   capacity=1 << (d.topk + 16 - 1).bit_length()))
    unwritten = int((out == -7).sum())
    if exact is not None:
        row = _exact_row(f"2 splits, poisoned: {case}", dt, out, exact, f"{unwritten} unwritten")
        row.ok = row.ok and unwritten == 0
        return row
    bad = topk_violations(out, scores, meta.positions, d.csa_ratio, d.topk, rtol=RTOL_RANDOM)
    return CheckResult("indexer_topk", f"2 splits, poisoned: {case}", dt, unwritten == 0 and not bad,
                       len(bad) / max(q.shape[0], 1), 0.0, f"{unwritten} unwritten; " + ("; ".join(bad[:2]) or "valid"))


def check_inputs(device, dtype=torch.bfloat16, *, seed: int, heads: int = 64, dim: int = 128, topk: int = 512,
                 ratio: int = 4, block_size: int = 256, ctx: int = 12000, new: int = 48, short: int = 16):
    """``_launch_x`` keyword arguments for two sequences (``new`` queries after ``ctx`` tokens; ``short`` queries
    from position 0) over a shuffled paged pool of fresh random keys, and their float64 scores ``[T, N]``."""
    g = torch.Generator().manual_seed(seed)
    lens = [ctx + new, short]
    pages = [cdiv(n, block_size) + 1 for n in lens]
    perm = torch.randperm(sum(pages) + 2, generator=g)
    width = max(pages)
    bt = torch.zeros(2, width, dtype=torch.int32)
    bt[0, :pages[0]], bt[1, :pages[1]] = perm[:pages[0]].int(), perm[pages[0]:pages[0] + pages[1]].int()
    pos = torch.cat([torch.arange(ctx, ctx + new), torch.arange(short)]).int()
    t = new + short
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    w = torch.randn(t, heads, generator=g)
    keys = torch.randn(sum(pages) + 2, block_size // ratio, dim, generator=g).to(dtype)
    scores = torch.full((t, (ctx + new) // ratio), float("-inf"), dtype=torch.float64)
    for i in range(t):
        b = 0 if i < new else 1
        n = (int(pos[i]) + 1) // ratio
        e = torch.arange(n)
        rows = keys[bt[b, (e * ratio) // block_size].long(), e % (block_size // ratio)].double()   # [n, dim]
        scores[i, :n] = (torch.relu(q[i].double() @ rows.T) * w[i].double()[:, None]).sum(0) * dim ** -0.5
    args = {"q": q.to(device), "weights": w.to(device), "positions": pos.to(device),
            "query_start_loc": torch.tensor([0, new, t], dtype=torch.int32, device=device), "keys": keys.to(device),
            "block_table": bt.to(device), "ratio": ratio, "block_size": block_size, "topk": topk,
            "scale": dim ** -0.5, "out": torch.empty(t, topk, dtype=torch.int32, device=device)}
    return args, scores.to(device)
