"""Timed cases of ``kernels_v41.py``: builders that make inputs at V4.1 dimensions and count the FLOPs
and the bytes each op must move (stored formats at their stored sizes, every byte once)."""
from __future__ import annotations

from typing import Callable, Iterator, List, Tuple

import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41 as ref
from redknot.kernels.triton import ops_mx as fast
from redknot.kernels.triton.gemm_mx import linear_mx, linear_path, moe_mx, moe_path
from redknot.kernels.triton.checks_mx import V41Dims, capture_graph, moe_graph, moe_inputs

# (name, N, K) of the dense FP8 linears of a V4.1 layer (§4.2)
LINEARS = [("wq_a", 1280, 5120), ("wq_b", 32768, 1280), ("wkv", 512, 5120), ("wo_b", 5120, 8192),
           ("shared w1", 2304, 5120), ("shared w2", 5120, 2304)]


def _case(op, label, run, flops, nbytes, peak="fp8", note="", key="", variant=""):
    from kernels_v41 import Case
    return Case(op, label, run, float(flops), float(nbytes), peak, note, key, variant)


def _sizes(dims: V41Dims, smoke: bool):
    prefill = 16 if smoke else 8192
    decode = [1, 4] if smoke else [1, 32, 128]
    return prefill, decode


def _rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _checked(op: str, label: str, fn, want_fn, tol: float) -> str:
    """Run ``fn`` once against the reference ``want_fn`` (fresh inputs at the timed size): a note with the
    error, or an error that makes the timed row a FAIL."""
    err = _rel_err(fn(), want_fn())
    if not err <= tol:
        raise AssertionError(f"{op} {label}: rel err {err:.3g} vs ref_v41 above {tol:g}")
    return f"err vs ref {err:.2g}"


def _linear_case(device, name: str, n: int, k: int, m: int, block: int, path: str):
    g = torch.Generator(device=device).manual_seed(m + n)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, block)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    nbytes = m * k * 2 + n * k + ws.numel() + m * n * 2
    chosen = linear_path(m, path)
    run = lambda: linear_mx(x, w, ws, block, path=path)  # noqa: E731
    note = chosen
    if chosen != "fused":
        note += "; " + _checked("linear_mx", name, run, lambda: ref.linear_mx(x, w, ws, block), 1e-2)
    return _case("linear_mx", f"{name} M={m} b={block} {chosen}", run, 2 * m * n * k, nbytes, note=note)


def linear_cases(dims: V41Dims, device, smoke: bool, extras: bool = False) -> Iterator[Tuple[str, Callable]]:
    """Every dense linear at the prefill row count (the ``auto`` path: bf16 weight chunks + library GEMM)
    and at decode row counts (split-K), eager and replayed from CUDA graphs. ``extras``: only the
    comparison rows, the FP8-MMA kernel the default paths replaced (``fused``) for wq_b / wo_b."""
    prefill, decode = _sizes(dims, smoke)
    shapes = [("toy", dims.hidden, dims.hidden)] if smoke else LINEARS
    for name, n, k in shapes:
        for m in [prefill] + (decode if name in ("toy", "wq_b", "wo_b", "shared w1") else []):
            paths = ["auto"] if not extras else []
            if extras and m == prefill and name in ("toy", "wq_b", "wo_b"):
                paths.append("fused")
            if extras and smoke and m == prefill:
                paths.append("dequant")
            for block in ((32, 128) if name in ("toy", "wo_b") else (32,)):
                for path in paths:
                    yield (f"linear_mx {name} M={m} b={block} {path}",
                           lambda a=(device, name, n, k, m, block, path): _linear_case(*a))
    if device.type == "cuda" and not extras:
        for name, n, k in (("wq_b", 32768, 1280), ("wo_b", 5120, 8192)):
            for m in decode:
                yield (f"linear_mx graph {name} M={m}",
                       lambda a=(device, name, n, k, m): _linear_graph_case(*a))


def _linear_graph_case(device, name: str, n: int, k: int, m: int):
    """A decode linear replayed from a CUDA graph (launch overhead gone, as in the engine's decode)."""
    g = torch.Generator(device=device).manual_seed(m + n + 1)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    eager = linear_mx(x, w, ws, 32)
    graph, out = capture_graph(lambda: linear_mx(x, w, ws, 32))
    return _case("linear_mx (CUDA graph)", f"{name} M={m} b=32 {linear_path(m)}", graph.replay, 2 * m * n * k,
                 m * k * 2 + n * k + ws.numel() + m * n * 2, note=f"graph output == eager: {torch.equal(out, eager)}")


def _moe_bytes(dims: V41Dims, idx: torch.Tensor) -> float:
    d, i = dims.hidden, dims.moe_inter
    per_expert = 3 * (d * i // 2 + d * i // 32)
    t = idx.shape[0]
    return idx.unique().numel() * per_expert + t * d * 2 * 2


def _moe_case_inputs(dims: V41Dims, device, t: int, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(t, dims.hidden, generator=g, device=device).to(torch.bfloat16)
    idx = torch.rand(t, dims.experts, generator=g, device=device).topk(dims.topk_experts, -1).indices
    wt = torch.rand(t, dims.topk_experts, generator=g, device=device) + 0.1
    return x, idx, wt


def moe_cases(dims: V41Dims, device, smoke: bool, extras: bool = False) -> Iterator[Tuple[str, Callable]]:
    """Prefill (``auto``: the plan ``moe_mx.PREFILL_TUNER`` measured fastest) and decode batches (split-K),
    eager and in CUDA graphs. ``extras``: only the comparison rows, each prefill plan by name (``grouped``
    bf16 expert chunks + ``torch._grouped_mm``, ``tiled`` FP4 decoded in registers), ``fused`` the FP8-MMA
    kernel they replace, and the split-K / prefill crossover at 1024 tokens. Each non-``fused`` case is
    checked against ``ref_v41.moe_mx`` first."""
    prefill, decode = _sizes(dims, smoke)
    flops_per_token = 2 * dims.topk_experts * 3 * dims.hidden * dims.moe_inter
    inputs = {}

    def weights():
        if "w" not in inputs:  # one set of expert weights for every case (7.2 GB at V4.1 size)
            inputs["w"] = moe_inputs(dims, device, seed=5, tokens=1)[3]
        return inputs["w"]

    mid = 32 if smoke else 1024
    if extras:  # comparison rows: each prefill plan by name, the kernel they replace, the crossover
        plan = [(prefill, p) for p in ("grouped", "tiled", "fused")]
        plan += [(mid, p) for p in ("splitk", "grouped", "tiled")]
    else:
        plan = [(prefill, "auto")] + [(t, "auto") for t in decode]
    wanted = {}

    def want(t, x, idx, wt, w):
        if t not in wanted:  # one reference per token count (inputs depend only on t)
            wanted.clear()
            wanted[t] = ref.moe_mx(x, idx, wt, *w, 10.0)
        return wanted[t]

    for t, path in plan:
        def build(t=t, path=path):
            x, idx, wt = _moe_case_inputs(dims, device, t, t)
            w = weights()
            chosen = moe_path(t, path)
            run = lambda: moe_mx(x, idx, wt, *w, 10.0, path=path)  # noqa: E731
            note = f"{idx.unique().numel()} experts touched; {chosen}"
            if chosen != "fused":
                note += "; " + _checked("moe_mx", f"T={t}", run, lambda: want(t, x, idx, wt, w), 3e-2)
            return _case("moe_mx", f"T={t} (top-{dims.topk_experts} of {dims.experts}) {chosen}", run,
                         t * flops_per_token, _moe_bytes(dims, idx), note=note)
        yield f"moe_mx T={t} {path}", build
    if device.type == "cuda" and not extras:
        for t in decode:
            def build_graph(t=t):
                x, idx, wt = _moe_case_inputs(dims, device, t, t + 1)
                graph, out, eager = moe_graph(x, idx, wt, weights(), 10.0)
                same = bool(torch.equal(out, eager))
                return _case("moe_mx (CUDA graph)", f"T={t} {moe_path(t)}", graph.replay, t * flops_per_token,
                             _moe_bytes(dims, idx), note=f"graph output == eager: {same}")
            yield f"moe_mx graph T={t}", build_graph


def cache_insert_cases(dims: V41Dims, device, smoke: bool) -> Iterator[Tuple[str, Callable]]:
    prefill, _ = _sizes(dims, smoke)

    def build_act():
        x = torch.randn(prefill, dims.hidden, device=device).to(torch.bfloat16)
        return _case("act_quant_mx", f"{prefill} x {dims.hidden}", lambda: fast.act_quant_mx(x), 0,
                     prefill * dims.hidden * (2 + 1 + 1 / 32), "hbm")
    yield "act_quant_mx", build_act
    for fmt, d, row in (("window", dims.latent, mx.window_row_bytes(dims.latent)),
                        ("compressed", dims.latent, mx.compressed_entry_bytes(dims.latent)),
                        ("index", dims.index_dim, mx.index_key_bytes(dims.index_dim))):
        def build(fmt=fmt, d=d, row=row):
            x = torch.randn(prefill, d, device=device).to(torch.bfloat16)
            cache = torch.empty(2 * prefill, row, dtype=torch.uint8, device=device)
            slots = torch.randperm(2 * prefill, device=device)[:prefill]
            return _case("cache_insert_mx", f"{fmt} rows={prefill}", lambda: fast.cache_insert_mx(cache, slots, x, fmt),
                         0, prefill * (d * 2 + row + 8), "hbm")
        yield f"cache_insert_mx {fmt}", build


def _packed_rows(pack, n: int, d: int, device, chunk: int = 131072) -> torch.Tensor:
    """n random rows packed by ``pack`` (built in chunks to bound the fp32 temporaries)."""
    return torch.cat([pack(torch.randn(min(chunk, n - i), d, device=device)) for i in range(0, n, chunk)])


def attention_cases(dims: V41Dims, device, contexts: List[int], smoke: bool) -> Iterator[Tuple[str, Callable]]:
    prefill, decode = _sizes(dims, smoke)
    prefill = min(prefill, 4096)
    cache = {}
    for ctx in contexts:
        for t in [prefill] + decode:
            def build(ctx=ctx, t=t):
                if cache.get("ctx") != ctx:
                    cache.clear()
                    cache.update(ctx=ctx, comp=_packed_rows(mx.pack_compressed_entries, ctx, dims.latent, device))
                comp = cache["comp"]
                is_prefill = t == prefill
                nwin = t + dims.window if is_prefill else t * dims.window
                win = _packed_rows(mx.pack_window_rows, nwin, dims.latent, device)
                ar = torch.arange(dims.window, device=device, dtype=torch.int32)
                tt = torch.arange(t, device=device, dtype=torch.int32)[:, None]
                widx = tt + ar if is_prefill else tt * dims.window + ar  # sliding window / own ring per sequence
                k = min(dims.attn_topk, ctx)
                cidx = torch.rand(t, ctx, device=device).topk(k, -1).indices.sort(-1).values.to(torch.int32) \
                    if t * ctx <= 2 ** 28 else torch.randint(0, ctx, (t, k), device=device, dtype=torch.int32)
                q = torch.randn(t, dims.heads, dims.latent, device=device).to(torch.bfloat16)
                sinks = torch.randn(dims.heads, device=device)
                keys = dims.window + k
                flops = 4 * t * dims.heads * keys * dims.latent
                comp_rows = min(ctx, t * k)
                nbytes = nwin * win.shape[1] + comp_rows * comp.shape[1] + 2 * t * dims.heads * dims.latent * 2
                return _case("sparse_attention_mx", f"ctx={ctx} T={t} {'prefill' if is_prefill else 'decode'}",
                             lambda: fast.sparse_attention_mx(q, win, widx, sinks, dims.latent ** -0.5, comp, cidx),
                             flops, nbytes, "bf16", f"{dims.window} window + {k} compressed rows per query")
            yield f"sparse_attention_mx ctx={ctx} T={t}", build


def indexer_cases(dims: V41Dims, device, contexts: List[int], smoke: bool) -> Iterator[Tuple[str, Callable]]:
    prefill = 16 if smoke else 1024
    decode = [1, 4] if smoke else [1, 32]
    keys_cache = {}
    for ctx in contexts:
        for t in [prefill] + decode:
            for mode in ("topk", "candidates", "source (topk + candidates)", "topk in candidates"):
                def build(ctx=ctx, t=t, mode=mode):
                    if keys_cache.get("ctx") != ctx:
                        keys_cache.clear()
                        keys_cache.update(ctx=ctx, keys=_packed_rows(mx.pack_index_keys, ctx, dims.index_dim, device))
                    keys = keys_cache["keys"]
                    q = mx.act_quant_ref(torch.randn(t, dims.index_heads, dims.index_dim, device=device)
                                         .to(torch.bfloat16), "fp4")
                    w = torch.randn(t, dims.index_heads, device=device) * dims.index_heads ** -0.5
                    visible = torch.arange(ctx - t + 1, ctx + 1, device=device, dtype=torch.int32)
                    nb, bs = dims.cand_blocks, dims.cand_block_size
                    per_q = ctx
                    if mode == "topk":
                        fn = lambda: fast.indexer_topk_mx(q, w, keys, visible, dims.index_topk)  # noqa: E731
                    elif mode == "candidates":
                        fn = lambda: fast.indexer_candidates_mx(q, w, keys, visible, nb, bs)  # noqa: E731
                    elif mode.startswith("source"):
                        fn = lambda: fast.indexer_source_mx(q, w, keys, visible, dims.index_topk, nb, bs)  # noqa: E731
                    else:
                        cand = fast.indexer_candidates_mx(q, w, keys, visible, nb, bs)
                        per_q = min(ctx, nb * bs)
                        fn = lambda: fast.indexer_topk_mx(q, w, keys, visible, dims.index_topk, cand, bs)  # noqa: E731
                    flops = 2 * t * per_q * dims.index_heads * dims.index_dim
                    nbytes = min(ctx, t * per_q) * keys.shape[1] + t * dims.index_heads * dims.index_dim * 2
                    return _case(f"indexer {mode}", f"ctx={ctx} T={t}", fn, flops, nbytes, "bf16",
                                 "queries share one key cache" if t > 1 and t != prefill else "")
                yield f"indexer {mode} ctx={ctx} T={t}", build


def engram_cases(dims: V41Dims, device, smoke: bool) -> Iterator[Tuple[str, Callable]]:
    prefill, decode = _sizes(dims, smoke)
    rows = 4096 if smoke else 1 << 22
    for t in [prefill] + decode:
        def build(t=t):
            table, scale, ids = _engram_table(dims, device, rows, t)
            n = ids.numel()
            return _case("engram_gather_mx", f"HBM table, T={t} x {dims.engram_rows_per_token} rows",
                         lambda: fast.engram_gather_mx(table, scale, ids), 0,
                         n * (table.shape[1] + scale.shape[1] + table.shape[1] * 2 + 8), "hbm")
        yield f"engram_gather_mx T={t}", build


def _engram_table(dims: V41Dims, device, rows: int, t: int):
    table = torch.randint(0, 126, (rows, dims.engram_width), dtype=torch.uint8, device=device)
    scale = torch.randint(110, 130, (rows, dims.engram_width // 32), dtype=torch.uint8, device=device)
    ids = torch.randint(0, rows, (t, dims.engram_rows_per_token), device=device)
    return table, scale, ids


def engram_transfer(dims: V41Dims, device, smoke: bool, log) -> List[dict]:
    """Engram gather from an HBM table vs a pinned host table read by the device, next to the measured
    host-to-device copy bandwidth (the bus ceiling a host table can reach)."""
    from kernels_v41 import time_ms
    out = []
    if device.type != "cuda":
        return [dict(case="engram transfer", status="skipped: needs CUDA (pinned memory read by the device)")]
    rows = 1 << 22
    table, scale, _ = _engram_table(dims, device, rows, 1)
    host_t = torch.empty_like(table, device="cpu").pin_memory()
    host_s = torch.empty_like(scale, device="cpu").pin_memory()
    host_t.copy_(table)
    host_s.copy_(scale)
    buf = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dev = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    ms = time_ms(lambda: dev.copy_(buf, non_blocking=True), device, 10)
    out.append(dict(case="host->device copy, 256 MiB pinned", ms=ms, gbps=buf.numel() / ms / 1e6, note="bus ceiling"))
    d2d = torch.empty_like(dev)
    ms = time_ms(lambda: d2d.copy_(dev), device, 10)
    out.append(dict(case="device->device copy, 256 MiB", ms=ms, gbps=2 * dev.numel() / ms / 1e6,
                    note="HBM, read + write"))
    for t in (1, 32, 8192):
        ids = torch.randint(0, rows, (t, dims.engram_rows_per_token), device=device)
        per_row = table.shape[1] + scale.shape[1]
        want = fast.engram_gather_mx(table, scale, ids)
        for where, (tab, sc) in (("HBM", (table, scale)), ("pinned host", (host_t, host_s))):
            try:
                got = fast.engram_gather_mx(tab, sc, ids)
                same = bool(torch.equal(got, want))
                ms = time_ms(lambda tab=tab, sc=sc: fast.engram_gather_mx(tab, sc, ids), device, 10)
                out.append(dict(case=f"gather {where}, T={t} x {dims.engram_rows_per_token} rows", ms=ms,
                                gbps=ids.numel() * per_row / ms / 1e6,
                                note=f"table bytes read; output equals HBM gather: {same}"))
            except Exception as exc:
                out.append(dict(case=f"gather {where}, T={t}", status=f"FAIL {type(exc).__name__}: {exc}"[:200]))
            log(f"engram {out[-1]}")
    return out


def timed_cases(dims: V41Dims, device, contexts: List[int], smoke: bool) -> Iterator[Tuple[str, Callable]]:
    """Every op's default path first; the GEMM comparison rows (other paths, the kernels they replaced)
    last, so that a run cut by its time budget loses those first."""
    yield from linear_cases(dims, device, smoke)
    yield from moe_cases(dims, device, smoke)
    yield from cache_insert_cases(dims, device, smoke)
    yield from engram_cases(dims, device, smoke)
    yield from attention_cases(dims, device, contexts, smoke)
    from kernels_v41_attention_cases import attention_variant_cases
    yield from attention_variant_cases(dims, device, contexts[0], smoke)
    yield from indexer_cases(dims, device, contexts, smoke)
    yield from linear_cases(dims, device, smoke, extras=True)
    yield from moe_cases(dims, device, smoke, extras=True)


def _graph_or_eager(fn, device, graph: bool):
    """(callable to time, its output, note): ``fn`` itself, or its CUDA graph replayed (output checked
    against an eager call)."""
    if not graph:
        return fn, fn(), "eager"
    eager = fn()
    g, out = capture_graph(fn)
    return g.replay, out, f"graph output == eager: {bool(torch.equal(out, eager))}"


def moe_memo(dims, device) -> Tuple[Callable, Callable]:
    """``weights()``: the MoE case's stored expert weights, made once; ``want(t, x, idx, wt)``: the reference
    ``moe_mx`` output for ``t`` tokens, kept for the last ``t`` only (a real-size output is large)."""
    shared = {}

    def weights():
        if "w" not in shared:
            shared["w"] = moe_inputs(dims, device, seed=5, tokens=1)[3]
        return shared["w"]

    def want(t, x, idx, wt):
        key = ("moe", t)
        if key not in shared:
            for k in [k for k in shared if k != "w"]:
                del shared[k]
            shared[key] = ref.moe_mx(x, idx, wt, *weights(), 10.0)
        return shared[key]

    return weights, want


def decode_compare_cases(dims: V41Dims, device, smoke: bool) -> Iterator[Tuple[str, Callable]]:
    """Before / after pairs of the weight-stream GEMMs: each case once with the split-K kernels' earlier
    weight decode (``decode="registers"``: nibble masks and fp32 scale multiplies in registers, activations
    quantised inside the kernel up to 128 rows, 16-row tiles) and once with the defaults (the decode the
    tuners measure fastest per weight shape: ``scaled`` / ``fp8`` / ``registers``), eager and replayed
    from CUDA graphs: MoE decode batches, the MoE prefill plan (``grouped``, the earlier default, against
    the measured choice over all plans), then the dense linears. Each row is checked against ``ref_v41``
    on its own inputs first. Rows carry ``key`` / ``variant`` so the report pairs them."""
    from redknot.kernels.triton import moe_mx as fast_moe
    prefill, decode = _sizes(dims, smoke)
    flops_per_token = 2 * dims.topk_experts * 3 * dims.hidden * dims.moe_inter
    graphs = [False, True] if device.type == "cuda" else [False]
    weights, want_moe = moe_memo(dims, device)

    for t in decode:
        for graph in graphs:
            for variant, dec in (("before", "registers"), ("after", None)):
                def build(t=t, graph=graph, variant=variant, dec=dec):
                    x, idx, wt = _moe_case_inputs(dims, device, t, t)
                    fn = lambda: fast_moe.moe_splitk(x, idx, wt, *weights(), 10.0, decode=dec)  # noqa: E731
                    note = _checked("moe_mx", f"T={t}", fn, lambda: want_moe(t, x, idx, wt), 3e-2)
                    run, _, how = _graph_or_eager(fn, device, graph)
                    return _case("moe_mx split-K", f"T={t} {'graph' if graph else 'eager'}", run, t * flops_per_token,
                                 _moe_bytes(dims, idx), note=f"decode={dec or _tuned('moe', _moe_key(weights()))}; "
                                 f"{how}; {note}",
                                 key=f"moe T={t} {'graph' if graph else 'eager'}", variant=variant)
                yield f"compare moe T={t} graph={graph} {variant}", build
    yield from prefill_compare_cases(dims, device, smoke, weights, want_moe)
    shapes = [("toy", dims.hidden, dims.hidden)] if smoke else [("wo_b", 5120, 8192), ("wq_b", 32768, 1280)]
    for name, n, k in shapes:
        for m in decode:
            for graph in graphs:
                for variant, dec in (("before", "registers"), ("after", None)):
                    def build(name=name, n=n, k=k, m=m, graph=graph, variant=variant, dec=dec):
                        g = torch.Generator(device=device).manual_seed(m + n)
                        w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
                        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
                        fn = lambda: linear_mx(x, w, ws, 32, path="splitk", decode=dec)  # noqa: E731
                        note = _checked("linear_mx", name, fn, lambda: ref.linear_mx(x, w, ws, 32), 1e-2)
                        run, _, how = _graph_or_eager(fn, device, graph)
                        label = f"{name} M={m} {'graph' if graph else 'eager'}"
                        return _case("linear_mx split-K", label, run, 2 * m * n * k,
                                     m * k * 2 + n * k + ws.numel() + m * n * 2,
                                     note=f"decode={dec or _tuned('linear', (tuple(w.shape), 32))}; {how}; {note}",
                                     key=f"linear {label}", variant=variant)
                    yield f"compare linear {name} M={m} graph={graph} {variant}", build


def prefill_compare_cases(dims: V41Dims, device, smoke: bool, weights=None,
                          want_moe=None) -> Iterator[Tuple[str, Callable]]:
    """MoE prefill at the prefill token count: the ``grouped`` plan (before) against the measured choice over
    all ``PREFILL_TUNER`` plans (after), then every FP8 tensor-core plan (``moe_prefill_fp8``) by name, each
    checked against ``ref_v41.moe_mx`` first (ms and % of floor in the timings table)."""
    from redknot.kernels.triton import moe_mx as fast_moe
    prefill, _ = _sizes(dims, smoke)
    flops_per_token = 2 * dims.topk_experts * 3 * dims.hidden * dims.moe_inter
    if weights is None:
        weights, want_moe = moe_memo(dims, device)
    plans = [("before", fast_moe.MoePlan("grouped")), ("after", None)]
    plans += [(f"plan {p.decode} {p.block_m}x{p.block_n} bk{p.block_k} w{p.num_warps} s{p.num_stages}", p)
              for p in fast_moe.PREFILL_TUNER.candidates if p.path == "fp8"]
    for variant, plan in plans:
        def build(variant=variant, plan=plan):
            x, idx, wt = _moe_case_inputs(dims, device, prefill, prefill)
            fn = lambda: fast_moe.moe_prefill(x, idx, wt, *weights(), 10.0, plan=plan)  # noqa: E731
            note = _checked("moe_mx", f"T={prefill}", fn, lambda: want_moe(prefill, x, idx, wt), 3e-2)
            chosen = plan or fast_moe.PREFILL_TUNER.choices.get(
                (min(1 << (prefill - 1).bit_length(), 65536), dims.topk_experts, tuple(weights()[0].shape),
                 tuple(weights()[4].shape)), "measured choice")
            from redknot.kernels.triton import stream_guard
            if plan in stream_guard.DECODE_ERRORS:  # refused by its first-use check: the grouped plan ran
                note += f"; refused, grouped ran instead: {stream_guard.DECODE_ERRORS[plan]}"
            paired = variant in ("before", "after")
            return _case("moe_mx prefill", f"T={prefill}" + ("" if paired else f" {variant}"), fn,
                         prefill * flops_per_token, _moe_bytes(dims, idx), note=f"plan {chosen}; {note}",
                         key=f"moe prefill T={prefill}" if paired else "", variant=variant if paired else "")
        yield f"compare moe prefill {variant}", build


def prefill_part_cases(dims: V41Dims, device, smoke: bool, weights=None) -> Iterator[Tuple[str, Callable]]:
    """The FP8 prefill plans by part at the prefill token count (where the time goes): the routing + e4m3 rows,
    each plan's W1 | W3 launch (SwiGLU epilogue) and W2 launch alone (FLOPs of that GEMM; the weights of the
    touched experts as bytes), the slot combine. Unchecked (the whole plan is checked in its own row)."""
    from redknot.kernels.triton import moe_mx as fast_moe
    from redknot.kernels.triton.moe_prefill_fp8 import prefill_gemm, prefill_inputs
    from redknot.kernels.triton.splitk_mx import reduce_combine, tile_map
    prefill, _ = _sizes(dims, smoke)
    if weights is None:
        weights, _ = moe_memo(dims, device)
    made = {}

    def inputs(plan=None):
        if not made:
            x, idx, wt = _moe_case_inputs(dims, device, prefill, prefill)
            made["x"], made["idx"], made["wt"] = x, idx, wt
        if plan is not None:
            form = plan.decode.split("_")[0]  # fp8 / fp8h / fp8ht / bf16: the rows' form (prefill_inputs)
            if ("pairs", form) not in made:
                made["pairs", form] = prefill_inputs(made["x"], made["idx"], made["wt"], dims.experts, plan)
            made["pairs"] = made["pairs", form]
        return made

    d, i, m = dims.hidden, dims.moe_inter, prefill * dims.topk_experts
    touched = lambda: _moe_bytes(dims, inputs()["idx"])  # noqa: E731  (all three matrices, stored bytes)

    def build_route():
        x, idx = inputs()["x"], inputs()["idx"]
        wt = torch.rand(idx.shape, device=device) + 0.1
        return _case("moe_mx prefill part", f"T={prefill} routing + e4m3 rows", lambda: fast_moe._sorted_pairs(
            idx, wt, dims.experts, x, fp8=True), 0, x.numel() * 2 + x.numel() * (1 + 1 / 32) + m * 16, "hbm")
    yield "prefill part routing", build_route
    for plan in [p for p in fast_moe.PREFILL_TUNER.candidates if p.path == "fp8"]:
        name = f"{plan.decode} {plan.block_m}x{plan.block_n} bk{plan.block_k} w{plan.num_warps} s{plan.num_stages}"

        def build_w13(plan=plan, name=name):
            rows, _, offs, wt, xq, xs = inputs(plan)["pairs"]
            w = weights()
            tiles = tile_map(offs, plan.block_m, m)
            fn = lambda: prefill_gemm(xq, xs, w[0], w[1], m, plan, offs=offs, rowid=rows, w3=w[2],  # noqa: E731
                                      ws3=w[3], wt=wt, limit=10.0, tiles=tiles)
            made["act", plan] = fn()
            return _case("moe_mx prefill part", f"T={prefill} W1+W3 {name}", fn, 2 * m * d * 2 * i,
                         touched() * 2 / 3)

        def build_w2(plan=plan, name=name):
            offs = inputs(plan)["pairs"][2]
            w = weights()
            aq, sa = made.get(("act", plan)) or build_w13(plan, name).run()
            tiles = tile_map(offs, plan.block_m, m)
            fn = lambda: prefill_gemm(aq, sa, w[4], w[5], m, plan, offs=offs, tiles=tiles)  # noqa: E731
            made["y"] = fn()
            return _case("moe_mx prefill part", f"T={prefill} W2 {name}", fn, 2 * m * i * d, touched() / 3)
        yield f"prefill part W1+W3 {name}", build_w13
        yield f"prefill part W2 {name}", build_w2

    def build_combine():
        inv = inputs(fast_moe.MoePlan("fp8", decode="fp8"))["pairs"][1]
        y = made.get("y")
        if y is None:
            y = torch.randn(m, d, device=device).to(torch.bfloat16)
        out = torch.empty(prefill, d, dtype=torch.bfloat16, device=device)
        return _case("moe_mx prefill part", f"T={prefill} slot combine", lambda: reduce_combine(
            y[None], inv, dims.topk_experts, out), 0, m * d * 2 + prefill * d * 2, "hbm")
    yield "prefill part combine", build_combine


class _Knobs:
    """Module constants of ``splitk_mx`` set while a case builds and runs (launch-shape variants)."""

    def __init__(self, **values):
        self.values = values

    def wrap(self, fn):
        def run():
            from redknot.kernels.triton import splitk_mx
            old = {k: getattr(splitk_mx, k) for k in self.values}
            for k, v in self.values.items():
                setattr(splitk_mx, k, v)
            try:
                return fn()
            finally:
                for k, v in old.items():
                    setattr(splitk_mx, k, v)
        return run


STREAM_VARIANTS = [  # most informative first (a run cut by its budget loses the last)
    ("scaled 4 K steps", dict(SCALED_MIN_STEPS=4)), ("scaled 16 K steps", dict(SCALED_MIN_STEPS=16)),
    ("fp8 MMA 4 K steps", dict(SCALED_MIN_STEPS=4)), ("scaled BN=128", dict(SCALED_BLOCK_N=128)),
    ("fp8 MMA BN=128", dict(SCALED_BLOCK_N=128)), ("scaled BK=256", dict(SCALED_BLOCK_K=256)),
    ("scaled in-kernel QDQ", dict(SCALED_RAW_MAX_ROWS=128)),
    ("fp8 MMA in-kernel quant", dict(FP8_INKERNEL_QUANT_MAX_ROWS=128)),
]


def _tuned(which: str, key) -> str:
    """The decode a tuner chose for ``key`` (or what runs untimed)."""
    from redknot.kernels.triton import gemm_mx, moe_mx
    tuner = moe_mx.DECODE_TUNER if which == "moe" else gemm_mx.LINEAR_DECODE_TUNER
    return str(tuner.choices.get(key, f"{tuner.candidates[0]} (untimed)"))


def _moe_key(w):
    return tuple(w[0].shape), tuple(w[4].shape)


def stream_variant_cases(dims: V41Dims, device, smoke: bool) -> Iterator[Tuple[str, Callable]]:
    """Launch-shape variants of the ``scaled`` streams (timed after the before / after pairs), in CUDA
    graphs where there is a GPU: the data for choosing the defaults. Each checked against ``ref_v41``."""
    from redknot.kernels.triton import moe_mx as fast_moe
    _, decode = _sizes(dims, smoke)
    graph = device.type == "cuda"
    flops_per_token = 2 * dims.topk_experts * 3 * dims.hidden * dims.moe_inter
    w_moe = {}
    for name, values in STREAM_VARIANTS:
        knobs = _Knobs(**values)
        for t in decode[:2] if name.startswith("scaled") else []:
            def build(t=t, knobs=knobs, name=name):
                if "w" not in w_moe:
                    w_moe["w"] = moe_inputs(dims, device, seed=5, tokens=1)[3]
                w = w_moe["w"]
                x, idx, wt = _moe_case_inputs(dims, device, t, t)
                fn = knobs.wrap(lambda: fast_moe.moe_splitk(x, idx, wt, *w, 10.0, decode="scaled"))
                note = _checked("moe_mx", f"T={t}", fn, lambda: ref.moe_mx(x, idx, wt, *w, 10.0), 3e-2)
                run, _, how = _graph_or_eager(fn, device, graph)
                return _case("moe_mx split-K variant", f"T={t} {name}", run, t * flops_per_token,
                             _moe_bytes(dims, idx), note=f"{how}; {note}")
            yield f"variant moe T={t} {name}", build
        n, k = (dims.hidden, dims.hidden) if smoke else (5120, 8192)
        for m in decode:
            def build(m=m, knobs=knobs, name=name, n=n, k=k):
                g = torch.Generator(device=device).manual_seed(m + n)
                w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
                x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
                dec = "fp8" if name.startswith("fp8") else "scaled"
                fn = knobs.wrap(lambda: linear_mx(x, w, ws, 32, path="splitk", decode=dec))
                note = _checked("linear_mx", "wo_b", fn, lambda: ref.linear_mx(x, w, ws, 32), 1e-2)
                run, _, how = _graph_or_eager(fn, device, graph)
                return _case("linear_mx split-K variant", f"wo_b M={m} {name}", run, 2 * m * n * k,
                             m * k * 2 + n * k + ws.numel() + m * n * 2, note=f"{how}; {note}")
            yield f"variant linear M={m} {name}", build
