"""Row epilogues of V4.1 attention (norm, norm + RoPE, RoPE + FP4 grid, inverse RoPE) in one launch each when the
model runs the Triton attention ops on 16-bit rows (:mod:`redknot.kernels.triton.step_rope_v41`), else the
PyTorch math of :mod:`ref_math`. The eager layers and the tensor-only step call the same functions, so a
graph replay and an eager step compute the same bits.

A forward keeps one ``tables`` dict: the cos/sin of each (RoPE table, positions) pair are computed once per
step and shared by every layer and row kind that rotates with them.
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import torch

from redknot.models.deepseek_v41.kernel_ops import ops_of
from redknot.models.deepseek_v41.mhc import hc_collapse
from redknot.models.deepseek_v41.ref_math import apply_rope, index_qdq, rms_norm

log = logging.getLogger(__name__)
FAST_DTYPES = (torch.bfloat16, torch.float16)


_FAILED = []   # a row kernel that failed to build: the PyTorch math from then on (logged once)
# The prefill row fusions (``prefill_rows_v41``) by name, each on where the row kernels run; a test or a benchmark
# switches one off to compare against the path without it. "rope_cols" (the q rows' RoPE and the attention output's
# inverse RoPE in place, contiguous rows: ``prefill_rows_v41.rope_cols_``) is on: on an H100 (2026-12-06, V4.1
# cut) ``benchmarks/rope_cols_v41.py`` measured 0.0573 ms a call against 0.3992 ms for ``rope_rows`` at 8192 rows
# of 64 heads x 512 (same bits), and the 8192-row chunk after 8K ran 3.65 ms faster with it (10 calls); after 32K
# the chunk measured 1.45 ms slower, within that run's chunk-to-chunk noise (1-2 ms; the kernel's bytes do not
# depend on the context). The earlier stride-2 in-place form (0.57 ms a call) lives in the benchmark only.
# "hashes": the Engram hashes of a prefill step in two launches (``prefill_hash_v41``; the same integers) instead
# of ~60 small PyTorch launches (2.4 ms of host time per 8192-row chunk on the H100); not measured on a GPU yet.
PREFILL_ROWS = {"rope_cols": True, "swiglu": True, "add_post": True, "collapse": True, "route": True,
                "page_entries": True, "mhc_one_pass": True, "hashes": True}


def fused_ops(w) -> bool:
    """The attention ops resolve to Triton (and no row kernel failed to build): the row kernels' condition
    without the rows' dtype (the Engram hashes' integer rows)."""
    ops = ops_of(w)
    return (not _FAILED and ops is not None and ops.attention
            and all(ops.choice.get(op) == "triton" for op in ("sparse_attention_mx", "indexer_topk_mx",
                                                               "cache_insert_mx")))


def fused(w, x: torch.Tensor) -> bool:
    """The row kernels run where the attention ops resolve to Triton and the rows are 16-bit."""
    return x.dtype in FAST_DTYPES and fused_ops(w)


def _table(tables: Optional[Dict], pos: torch.Tensor, inv: torch.Tensor):
    from redknot.kernels.triton.step_rope_v41 import rope_table

    if tables is None:
        return rope_table(pos, inv)
    key = (id(inv), pos.data_ptr(), pos.shape[0])
    got = tables.get(key)
    if got is None:
        got = tables[key] = (*rope_table(pos, inv), pos, inv)   # the tensors kept alive with their key
    return got[0], got[1]


def _guarded(fn, *args, **kw) -> Optional[torch.Tensor]:
    """``fn(*args, **kw)``, or None (and the PyTorch math from then on) when its kernel does not build on
    this device; a failed build happens at the first, eager call, never inside a graph capture."""
    try:
        return fn(*args, **kw)
    except Exception as exc:   # noqa: BLE001  (Triton raises compiler-specific errors)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        log.warning("fused row kernel unavailable (%s); using the PyTorch row math", str(exc).splitlines()[0][:200])
        _FAILED.append(str(exc))
        return None


def _ok(x: torch.Tensor, inv: torch.Tensor, qdq: bool = False) -> bool:
    d = x.shape[-1]
    return d % 2 == 0 and 2 * inv.shape[0] <= d and (not qdq or (d & (d - 1) == 0 and d >= 32))


def norm(x: torch.Tensor, w, name: str, eps: float) -> torch.Tensor:
    """rms_norm(x, w[name]) (one launch on the fused path)."""
    if fused(w, x) and x.shape[-1] % 2 == 0:
        from redknot.kernels.triton.step_rope_v41 import rope_rows

        none = torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device)   # no rotated dims
        y = _guarded(rope_rows, x, none, none, norm_w=w.float(name), eps=eps)
        if y is not None:
            return y
    return rms_norm(x, w.float(name), eps)


def norm_rope(x: torch.Tensor, w, norm: str, eps: float, pos: torch.Tensor, inv: torch.Tensor,
              tables: Optional[Dict] = None) -> torch.Tensor:
    """RoPE(rms_norm(x, w[norm]))."""
    if fused(w, x) and _ok(x, inv):
        from redknot.kernels.triton.step_rope_v41 import rope_rows

        cos, sin = _table(tables, pos, inv)
        y = _guarded(rope_rows, x, cos, sin, norm_w=w.float(norm), eps=eps)
        if y is not None:
            return y
    return apply_rope(rms_norm(x, w.float(norm), eps), pos, inv)


def rope_tables(x: torch.Tensor, w, pos: torch.Tensor, inv: torch.Tensor, tables: Optional[Dict] = None,
                qdq: bool = False):
    """(cos, sin) [T, half] where :func:`rope` rotates ``x`` with the row kernels (the step's table, kept in
    ``tables``), else None (the PyTorch rotation)."""
    return _table(tables, pos, inv) if fused(w, x) and _ok(x, inv, qdq) else None


def rope(x: torch.Tensor, w, pos: torch.Tensor, inv: torch.Tensor, tables: Optional[Dict] = None,
         inverse: bool = False, qdq: bool = False, inplace: bool = False) -> torch.Tensor:
    """RoPE(x) (``inverse``: the conjugate rotation), then the FP4 index grid when ``qdq``. ``inplace`` (the
    caller gives up x): on the fused path without the grid only the rotated columns are read and rewritten,
    in x (``prefill_rows_v41.rope_cols_``: the same bits; at 8192 rows of 64 heads x 512, 134 MB moved instead
    of 1.07 GB)."""
    cs = rope_tables(x, w, pos, inv, tables, qdq)
    if cs is not None:
        from redknot.kernels.triton.step_rope_v41 import rope_rows

        cos, sin = cs
        if inplace and PREFILL_ROWS["rope_cols"] and not qdq and x.dim() in (2, 3) and x.stride(-1) == 1:
            from redknot.kernels.triton.prefill_rows_v41 import rope_cols_

            y = _guarded(rope_cols_, x, cos, sin, inverse=inverse)
            if y is not None:
                return y
        y = _guarded(rope_rows, x, cos, sin, inverse=inverse, qdq=qdq)
        if y is not None:
            return y
    y = apply_rope(x, pos, inv, inverse=inverse)
    return index_qdq(y) if qdq else y


def q_kv_rows(u: torch.Tensor, w, p: str, cfg, num, pos: torch.Tensor, inv: torch.Tensor,
              tables: Optional[Dict] = None, index: bool = False, pack: bool = False):
    """(qr, q, kv, qi, packed) = (norm(wq_a(u)), RoPE(wq_b(qr)) [T, H, Dh], norm_rope(wkv(u)), the indexer's
    query or None, kv's window-cache rows or None) of attention ``p`` in four launches
    (:func:`redknot.kernels.triton.step_proj_v41.proj_rows` twice: the ``wq_a`` | ``wkv`` stream and its row
    epilogues, the ``wq_b`` stream and its RoPE), the bits of ``linear`` with ``linear_mx``'s ``fp8`` decode
    followed by :func:`norm` / :func:`rope` / :func:`norm_rope`. ``index`` (an index source): the indexer's
    ``wq_b`` rides in the second stream and epilogue, ``qi`` [T, Hi, Di] = ``rope(linear(qr, indexer.wq_b),
    qdq=True)`` (else None). ``pack``: ``packed`` uint8 [T, Dh + Dh/32] holds the bytes
    ``cache_insert_mx(packed, arange(T), kv, "window")`` writes (the kv epilogue writes them). For the tensor
    step's and the eager layers' few rows (up to ``step_proj_v41.MAX_ROWS``) on the registry's FP8 linears with
    the row kernels; None elsewhere (the caller runs the linears and row functions)."""
    if not (u.dim() == 2 and u.dtype == num.dtype == torch.bfloat16 and fused(w, u)):
        return None
    from redknot.kernels.triton.step_proj_v41 import MAX_ROWS, Proj, epilogue_warps, proj_rows
    from redknot.models.deepseek_v41.moe import _fp8_linear_weights

    ops = ops_of(w)
    names = [f"{p}.{n}.weight" for n in ("wq_a", "wkv", "wq_b")] + ([f"{p}.indexer.wq_b.weight"] if index else [])
    got = [_fp8_linear_weights(ops, w, n, num) for n in names]
    d = cfg.head_dim
    if u.shape[0] > MAX_ROWS or any(g is None for g in got) or d % 2 or 2 * inv.shape[0] > d:
        return None
    (wa, sa), (wkv, skv), (wb, sb) = got[:3]
    if wa.shape[1] != u.shape[1] or wkv.shape != (d, u.shape[1]) or wb.shape != (cfg.n_heads * d, wa.shape[0]):
        return None
    second = [Proj(wb, sb, d, rope=True)]
    if index:
        (wi, si), di = got[3], cfg.index_head_dim
        if wi.shape != (cfg.index_n_heads * di, wa.shape[0]) or not _ok(u.new_empty(0, di), inv, qdq=True):
            return None
        second.append(Proj(wi, si, di, rope=True, qdq=True))
    first = [Proj(wa, sa, wa.shape[0], norm_w=w.float(f"{p}.q_norm.weight"), eps=cfg.norm_eps),
             Proj(wkv, skv, d, norm_w=w.float(f"{p}.kv_norm.weight"), eps=cfg.norm_eps, rope=True)]
    if epilogue_warps(first) is None:
        return None
    cos, sin = _table(tables, pos, inv)
    packed = torch.empty(u.shape[0], d + d // 32, dtype=torch.uint8, device=u.device) if pack and d % 32 == 0 \
        else None
    pair = _guarded(proj_rows, u, first, cos, sin, pack=packed)
    if pair is None:
        return None
    qr, kv = pair[0].view(u.shape[0], -1), pair[1].view(u.shape[0], d)
    q = _guarded(proj_rows, qr, second, cos, sin)
    if q is None:
        return None
    return qr, q[0], kv, (q[1] if index else None), packed


def linear_rows(x: torch.Tensor, w, name: str, num) -> Optional[torch.Tensor]:
    """``linear(x, w, name, num)`` [T, N] for few 16-bit rows on the registry's FP8 linears in two launches (the
    FP8 stream with the rows quantised inside, and the slice sums: ``step_proj_v41.proj_rows`` without an
    epilogue), the bits of ``linear_mx``'s ``fp8`` decode (three launches); None where it does not apply."""
    if not (x.dim() == 2 and x.dtype == num.dtype == torch.bfloat16 and fused(w, x)):
        return None
    from redknot.kernels.triton.step_proj_v41 import MAX_ROWS, Proj, proj_rows
    from redknot.models.deepseek_v41.moe import _fp8_linear_weights

    got = _fp8_linear_weights(ops_of(w), w, name, num)
    if x.shape[0] > MAX_ROWS or got is None or got[0].shape[1] != x.shape[1]:
        return None
    n = got[0].shape[0]
    dim = 512 if n % 512 == 0 else n           # rows of 512 columns: more programs, the same elementwise sums
    if dim % 2:
        return None
    none = torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device)
    y = _guarded(proj_rows, x, [Proj(got[0], got[1], dim)], none, none)
    return None if y is None else y[0].view(x.shape[0], n)


def wo_a_rows(o: torch.Tensor, wo_a: torch.Tensor, w, name: str, num) -> Optional[torch.Tensor]:
    """The grouped ``wo_a`` z [T, g·r] of few bf16 rows o [T, g, K] (``wo_a`` the dequantised [g, r, K]) through
    ``step_wo_a_v41.wo_a_rows`` (the einsum, or a GEMV on the stored FP8 weight where its tuner measured it faster;
    the same exact products); None where it does not apply (the caller's einsum)."""
    if not (o.dim() == 3 and o.dtype == num.dtype == wo_a.dtype == torch.bfloat16 and fused(w, o)):
        return None
    from redknot.kernels.triton.gemv_plan import MAX_ROWS
    from redknot.kernels.triton.step_wo_a_v41 import wo_a_rows as rows
    from redknot.models.deepseek_v41.moe import _fp8_linear_weights

    got = _fp8_linear_weights(ops_of(w), w, name, num)
    if o.shape[0] > MAX_ROWS or got is None or got[0].shape != (wo_a.shape[0] * wo_a.shape[1], o.shape[2]):
        return None
    # no _guarded: a GEMV that fails to build or check falls back to the einsum inside (stream_guard.first_use)
    return rows(o, got[0], got[1], wo_a, 32)


def linear_post_rows(x: torch.Tensor, w, name: str, num, h: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor) -> Optional[torch.Tensor]:
    """``mhc_post(linear(x, w, name, num), h, post, comb)`` (the fused mHC site's post after the attention's output
    linear) in two launches (``step_proj_v41.linear_post``), the bits of :func:`linear_rows` followed by
    ``step_mhc_v41.site_post``; None where it does not apply."""
    if not (x.dim() == 2 and x.dtype == num.dtype == h.dtype == torch.bfloat16 and fused(w, x)):
        return None
    from redknot.kernels.triton.step_proj_v41 import MAX_ROWS, linear_post
    from redknot.models.deepseek_v41.moe import _fp8_linear_weights

    got = _fp8_linear_weights(ops_of(w), w, name, num)
    if x.shape[0] > MAX_ROWS or got is None or got[0].shape[1] != x.shape[1]:
        return None
    d, n = got[0].shape[0], h.shape[1]
    bd = min(512, 1 << max(d - 1, 0).bit_length())
    if h.shape != (x.shape[0], n, d) or d % bd or d % 2 or n & (n - 1) or d % 512 and d != bd:
        return None
    return _guarded(linear_post, x, got[0], got[1], h, post, comb)


def collapse(h: torch.Tensor, pre: torch.Tensor, w) -> torch.Tensor:
    """``mhc.hc_collapse(h, pre)`` [T, D]; one read of the streams on the fused path
    (``prefill_rows_v41.collapse_rows``: fp32 sums in another order, one bf16 ulp at most). The eager forward
    and the tensor-only step both end with it, so a graph replay and an eager step compute the same bits."""
    n = h.shape[1] if h.dim() == 3 else 0
    if PREFILL_ROWS["collapse"] and fused(w, h) and n and not n & (n - 1):
        from redknot.kernels.triton.prefill_rows_v41 import collapse_rows

        y = _guarded(collapse_rows, h, pre)
        if y is not None:
            return y
    return hc_collapse(h, pre)
