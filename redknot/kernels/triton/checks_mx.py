"""Each V4.1 shipped-format Triton kernel against its PyTorch reference on fresh random inputs.

Shared by the CPU tests (Triton interpreter, ``TOY_V41``), the GPU tests and ``benchmarks/kernels_v41.py``
(real V4.1 dimensions, ``REAL_V41``). A check returns :class:`MxCheck` rows; nothing here decides what
a kernel should output except the reference ops of :mod:`redknot.kernels.ref_v41`.

Tolerances: byte formats (activation quantisation, cache rows, Engram rows) must match exactly; GEMMs
(bf16 output, FP8 operands identical to the reference's) 1e-2 norm-wise; MoE 3e-2 (its intermediate is
re-quantised to FP8 after a bf16 rounding, so a summation-order difference can move one element by one
FP8 step); attention 2e-2 (bf16 probabilities); indexer selections compare the reference scores of the
chosen sets (tie-aware: equal scores are interchangeable).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41 as ref
from redknot.kernels.capture import cuda_graph
from redknot.kernels.triton import ops_mx as fast


@dataclass(frozen=True)
class V41Dims:
    hidden: int = 5120
    experts: int = 384
    topk_experts: int = 6
    moe_inter: int = 2304
    heads: int = 64
    latent: int = 512
    window: int = 128
    attn_topk: int = 512
    index_heads: int = 32
    index_dim: int = 128
    index_topk: int = 512
    cand_blocks: int = 2048
    cand_block_size: int = 8
    engram_width: int = 256
    engram_rows_per_token: int = 24
    tokens: int = 64            # rows of the GEMM / MoE / insert checks
    attn_tokens: int = 16       # queries of the attention / indexer checks
    entries: int = 24576        # index keys / compressed entries present (> cand coverage 16384)


REAL_V41 = V41Dims()
TOY_V41 = V41Dims(hidden=64, experts=4, topk_experts=2, moe_inter=64, heads=4, latent=64, window=8, attn_topk=16,
                  index_heads=4, index_dim=64, index_topk=8, cand_blocks=3, cand_block_size=4, engram_width=64,
                  engram_rows_per_token=3, tokens=12, attn_tokens=5, entries=40)


@dataclass
class MxCheck:
    name: str
    ok: bool
    err: float
    tol: float
    detail: str = ""

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: err {self.err:.3g} (tol {self.tol:g}) {self.detail}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _gen(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, g, device, scale=1.0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def _close(name, out, want, tol) -> MxCheck:
    err = _rel(out, want)
    return MxCheck(name, bool(err <= tol and torch.isfinite(out.float()).all()), err, tol)


def _exact(name, out, want) -> MxCheck:
    out_b = out.view(torch.uint8) if out.dtype != torch.uint8 else out
    want_b = want.view(torch.uint8) if want.dtype != torch.uint8 else want
    diff = float((out_b != want_b).float().mean())
    return MxCheck(name, diff == 0.0, diff, 0.0, "fraction of bytes that differ")


def check_act_quant(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    g = _gen(seed, device)
    x = _randn((dims.tokens, dims.hidden), g, device) * torch.logspace(-4, 3, dims.hidden, device=device).to(
        torch.bfloat16)
    q, s = fast.act_quant_mx(x)
    rq, rs = ref.act_quant_mx(x)
    return [_exact("act_quant_mx values", q, rq), _exact("act_quant_mx scales", s, rs)]


def check_linear(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    g = _gen(seed, device)
    rows = []
    for block, n in ((32, dims.hidden), (128, dims.hidden)):
        w, ws = mx.quant_fp8_blocks(_randn((n, dims.hidden), g, device, 0.02, torch.float32), block)
        x = _randn((dims.tokens, dims.hidden), g, device)
        rows.append(_close(f"linear_mx block {block}", fast.linear_mx(x, w, ws, block),
                           ref.linear_mx(x, w, ws, block), 1e-2))
    return rows


def moe_inputs(dims: V41Dims, device, seed: int = 0, tokens: int = 0):
    g = _gen(seed, device)
    t = tokens or dims.tokens
    e, i, d = dims.experts, dims.moe_inter, dims.hidden
    x = _randn((t, d), g, device)
    logits = torch.randn(t, e, generator=g, device=device)
    topk_idx = logits.topk(dims.topk_experts, dim=-1).indices
    topk_w = torch.rand(t, dims.topk_experts, generator=g, device=device) + 0.1
    ws = []  # random MXFP4 bytes: any code, scale exponents 2^-10 .. 2^-6 (|w| <= 0.09)
    for n, k in ((i, d), (i, d), (d, i)):
        ws.append(torch.randint(0, 256, (e, n, k // 2), generator=g, device=device).to(torch.uint8))
        ws.append(torch.randint(117, 122, (e, n, k // 32), generator=g, device=device).to(torch.uint8))
    return x, topk_idx, topk_w, ws


def moe_batch(dims: V41Dims, tokens: int, seed: int, device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` routed rows for weights from ``moe_inputs``: bf16 activations, distinct top-k experts,
    positive combine weights (fresh for every seed, so batches of different sizes are independent)."""
    g = _gen(seed, device)
    x = torch.randn(tokens, dims.hidden, generator=g, device=device).to(torch.bfloat16)
    idx = torch.rand(tokens, dims.experts, generator=g, device=device).topk(dims.topk_experts, -1).indices
    wt = torch.rand(tokens, dims.topk_experts, generator=g, device=device) + 0.1
    return x, idx, wt


def capture_graph(fn: Callable[[], torch.Tensor]) -> Tuple["torch.cuda.CUDAGraph", torch.Tensor]:
    """``fn`` captured in a CUDA graph and replayed once: (graph, its output buffer). A warm-up on a
    side stream runs first, so launch-shape tuning and lazy allocations happen outside the capture; a
    host sync inside ``fn`` fails the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def moe_graph(x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor, w: List[torch.Tensor], limit: float = 10.0
              ) -> Tuple["torch.cuda.CUDAGraph", torch.Tensor, torch.Tensor]:
    """``moe_mx`` captured in a CUDA graph and replayed once: (graph, its output buffer, the eager
    result, computed first)."""
    eager = fast.moe_mx(x, idx, wt, *w, limit)
    graph, out = capture_graph(lambda: fast.moe_mx(x, idx, wt, *w, limit))
    return graph, out, eager


def check_moe(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(dims, device, seed)
    out = fast.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    want = ref.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    return [_close("moe_mx", out, want, 3e-2)]


def check_cache_insert(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    g = _gen(seed, device)
    rows = []
    for fmt, d, nbytes in (("window", dims.latent, mx.window_row_bytes(dims.latent)),
                           ("compressed", dims.latent, mx.compressed_entry_bytes(dims.latent)),
                           ("index", dims.index_dim, mx.index_key_bytes(dims.index_dim))):
        x = _randn((dims.tokens, d), g, device, 3.0)
        x[0] = 0  # an all-zero row: the scale floors
        slots = torch.randperm(2 * dims.tokens, generator=g, device=device)[:dims.tokens]
        slots[1] = -1
        base = torch.randint(0, 256, (2 * dims.tokens, nbytes), generator=g, device=device).to(torch.uint8)
        out = fast.cache_insert_mx(base.clone(), slots, x, fmt)
        want = ref.cache_insert_mx(base.clone(), slots, x, fmt)
        rows.append(_exact(f"cache_insert_mx {fmt}", out, want))
    return rows


def attention_inputs(dims: V41Dims, device, seed: int = 0, tokens: int = 0, n_window: int = 0, n_comp: int = 0):
    g = _gen(seed, device)
    t = tokens or dims.attn_tokens
    d = dims.latent
    nw = n_window or 4 * dims.window
    nc = n_comp or dims.entries
    win = mx.pack_window_rows(_randn((nw, d), g, device, 1.0, torch.float32))
    comp = mx.pack_compressed_entries(_randn((nc, d), g, device, 1.0, torch.float32))
    q = _randn((t, dims.heads, d), g, device)
    widx = torch.randint(0, nw, (t, dims.window), generator=g, device=device, dtype=torch.int32)
    cidx = torch.randint(0, nc, (t, dims.attn_topk), generator=g, device=device, dtype=torch.int32)
    widx[0, dims.window // 2:] = -1  # a short window
    cidx[0] = -1                     # no compressed entries
    if t > 1:
        widx[1] = -1
        cidx[1] = -1                 # nothing visible at all: output 0
    sinks = torch.randn(dims.heads, generator=g, device=device)
    return q, win, widx, comp, cidx, sinks


def check_sparse_attention(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    q, win, widx, comp, cidx, sinks = attention_inputs(dims, device, seed)
    scale = dims.latent ** -0.5
    out = fast.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    want = ref.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    rows = [_close("sparse_attention_mx", out, want, 2e-2)]
    out_w = fast.sparse_attention_mx(q, win, widx, sinks, scale)
    rows.append(_close("sparse_attention_mx window only", out_w, ref.sparse_attention_mx(q, win, widx, sinks, scale),
                       2e-2))
    return rows


def indexer_inputs(dims: V41Dims, device, seed: int = 0, tokens: int = 0, entries: int = 0):
    g = _gen(seed, device)
    t = tokens or dims.attn_tokens
    n = entries or dims.entries
    q = mx.act_quant_ref(_randn((t, dims.index_heads, dims.index_dim), g, device), "fp4")
    w = torch.randn(t, dims.index_heads, generator=g, device=device) * dims.index_heads ** -0.5
    keys = mx.pack_index_keys(_randn((n, dims.index_dim), g, device, 1.0, torch.float32))
    visible = torch.randint(n // 2, n + 1, (t,), generator=g, device=device, dtype=torch.int32)
    visible[0] = min(3, n)  # fewer visible than top-k
    return q, w, keys, visible


def _selected_scores(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    vals = scores.gather(1, ids.clamp(min=0).long()).masked_fill(ids < 0, float("-inf"))
    return vals.sort(dim=-1, descending=True).values


def _compare_selection(name, scores, got, want, tol=1e-3) -> MxCheck:
    """The chosen sets hold the same reference scores (ties interchangeable) and the same count."""
    a, b = _selected_scores(scores, got), _selected_scores(scores, want)
    same_count = bool(((got >= 0).sum(1) == (want >= 0).sum(1)).all())
    fin = torch.isfinite(b)
    err = float(((a - b).abs() / b.abs().clamp_min(1e-6)).masked_fill(~fin, 0).max()) if fin.any() else 0.0
    same_inf = bool((torch.isfinite(a) == fin).all())
    unique = all(len(set(r[r >= 0].tolist())) == int((r >= 0).sum()) for r in got)
    return MxCheck(name, same_count and same_inf and unique and err <= tol, err, tol,
                   f"counts equal {same_count}, ids unique {unique}")


def check_indexer(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    q, w, keys, visible = indexer_inputs(dims, device, seed)
    n = keys.shape[0]
    scores = ref.index_scores(q, w, mx.unpack_index_keys(keys))
    scores = scores.masked_fill(torch.arange(n, device=device)[None] >= visible.long()[:, None], float("-inf"))
    rows = []
    got = fast.indexer_topk_mx(q, w, keys, visible, dims.index_topk)
    want = ref.indexer_topk_mx(q, w, keys, visible, dims.index_topk)
    rows.append(_compare_selection("indexer_topk_mx", scores, got, want))
    bs, nb = dims.cand_block_size, dims.cand_blocks
    cand_got = fast.indexer_candidates_mx(q, w, keys, visible, nb, bs)
    cand_want = ref.indexer_candidates_mx(q, w, keys, visible, nb, bs)
    nblk = -(-n // bs)
    bscore = torch.nn.functional.pad(scores, (0, nblk * bs - n), value=float("-inf")).view(-1, nblk, bs).amax(-1)
    newest = ((visible.long() - 1) // bs).clamp(min=0)
    bscore.scatter_(1, newest[:, None], float("inf"))
    rows.append(_compare_selection("indexer_candidates_mx", bscore.nan_to_num(posinf=1e30), cand_got, cand_want))
    src_idx, src_blocks = fast.indexer_source_mx(q, w, keys, visible, dims.index_topk, nb, bs)
    rows.append(_compare_selection("indexer_source_mx top-k", scores, src_idx, want))
    rows.append(_compare_selection("indexer_source_mx blocks", bscore.nan_to_num(posinf=1e30), src_blocks, cand_want))
    got_c = fast.indexer_topk_mx(q, w, keys, visible, dims.index_topk, cand_want, bs)
    want_c = ref.indexer_topk_mx(q, w, keys, visible, dims.index_topk, cand_want, bs)
    allowed = torch.zeros(q.shape[0], nblk + 1, dtype=torch.bool, device=device)
    allowed.scatter_(1, torch.where(cand_want >= 0, cand_want.long(), nblk), True)
    masked = scores.masked_fill(~allowed[:, :nblk].repeat_interleave(bs, 1)[:, :n], float("-inf"))
    rows.append(_compare_selection("indexer_topk_mx in candidates", masked, got_c, want_c))
    return rows


def engram_inputs(dims: V41Dims, device, seed: int = 0, rows: int = 4096, tokens: int = 0):
    g = _gen(seed, device)
    t = tokens or dims.tokens
    q, s = mx.quant_fp8_groups(_randn((rows, dims.engram_width), g, device, 0.5, torch.float32))
    ids = torch.randint(0, rows, (t, dims.engram_rows_per_token), generator=g, device=device)
    return q, s, ids


def check_engram(dims: V41Dims, device, seed: int = 0) -> List[MxCheck]:
    table, scale, ids = engram_inputs(dims, device, seed)
    return [_exact("engram_gather_mx", fast.engram_gather_mx(table, scale, ids),
                   ref.engram_gather_mx(table, scale, ids))]


ALL_MX_CHECKS: Dict[str, Callable[..., List[MxCheck]]] = {
    "act_quant_mx": check_act_quant, "linear_mx": check_linear, "moe_mx": check_moe,
    "cache_insert_mx": check_cache_insert, "sparse_attention_mx": check_sparse_attention,
    "indexer_mx": check_indexer, "engram_gather_mx": check_engram,
}
