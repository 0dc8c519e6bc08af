"""Timed cases of the fused MoE decode streams (``moe_stream.StreamPlan``) next to the split-K streams, and of
the dense FP8 decode streams by decode, for ``kernels_v41.py --only gemm`` / ``--only stream``.

Every MoE row replays a CUDA graph of the whole ``moe_mx`` call (routing, GEMMs, epilogues, combine), checked
against ``ref_v41`` on the same inputs first and its graph output compared with an eager call. The
``ladder`` rows run one fused plan with its MMA removed (``mode=2``: decode + sum) and with decode and MMA
removed (``mode=1``: bytes summed): same grid, same loads, so the three rungs say whether the loads, the
decode or the MMA bound the stream. Their outputs are meaningless and unchecked.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Tuple

import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41 as ref
from redknot.kernels.triton.checks_mx import V41Dims
from redknot.kernels.triton import gemm_mx
from redknot.kernels.triton.gemm_mx import linear_mx
from kernels_v41_cases import _case, _checked, _graph_or_eager, _moe_bytes, _moe_case_inputs, _sizes, moe_memo

STREAM_KEY = "stream"  # Case.key prefix of these rows (the report's table picks them up)


def _unrolled():
    from redknot.kernels.triton.moe_stream import StreamPlan
    # the three ``DECODE_TUNER`` holds, then 512 s3 (bench only: 90 KB of shared memory, 2 programs per SM, one
    # 32 KB W1 | W3 iteration in flight each; s2 keeps one weight buffer, its loads waited in their iteration)
    return [StreamPlan("fp8hd4", 64, 256, 4, 3), StreamPlan("fp8hd4", 64, 256, 4, 4), StreamPlan("fp8hd4", 64, 512, 4, 2),
            StreamPlan("fp8hd4", 64, 512, 4, 3)]


UNROLLED = _unrolled()


def _plans(smoke: bool, extra: bool = False):
    from redknot.kernels.triton.moe_stream import StreamPlan
    if smoke:
        return [("fused regs 32x64", StreamPlan("regs", 32, 64)), ("fused scaled 32x64", StreamPlan("scaled", 32, 64)),
                ("fused fp8 32x64", StreamPlan("fp8", 32, 64))]
    # H200 run of the first fused plans (bf16 decodes only): regs 64x128 and its split8 best (1.43x split-K at
    # T=32), dot_scaled / 32x256 / 128x128 slower; a bytes-only ladder at 57 % of the floor, decode-only at 29 %
    # (ptxas for sm_90a, W1 | W3 kernels: fp8 64x128 138 registers, 64x256 176, 32x256 108, 128x256 w8 255)
    # fp8h (``moe_stream_fp8h``, K in halves order; not yet timed when added): right after the fp8 plan it
    # replaces, so a budget cut loses older variants first. sm_90a SASS per 4-group loop step and warp: W2 64
    # columns 269 instructions (fp8: 512), two 64-column blocks 435 for twice the bytes; W1 | W3 434 (fp8: 803)
    # / 769.
    # fp8hd / fp8hd4: 8- / 4-row tiles, one MMA per 4 groups against block-diagonal activations (W1 | W3 332 /
    # 293, W2 209 / 189).
    # fp8hd4 with block_k 256 / 512 (``diag_unroll``: 2 / up to 4 four-group steps per loop iteration, 128 / 256
    # contiguous bytes of each weight row per pipeline stage; not yet timed when added): right after the 64x128
    # plan they extend.
    plans = [StreamPlan("fp8", 64, 128, 4, 3), StreamPlan("fp8hd4", 64, 128, 4, 3),
             *UNROLLED, StreamPlan("fp8hd4", 64, 128, 4, 3, w2_block_n=128), StreamPlan("fp8hd4", 128, 128, 4, 3),
             StreamPlan("fp8hd", 64, 128, 4, 3), StreamPlan("fp8hd", 128, 128, 4, 3),
             StreamPlan("fp8hd4", 64, 128, 4, 4), StreamPlan("fp8hd", 64, 128, 4, 4), StreamPlan("fp8h", 64, 128, 4, 3),
             StreamPlan("fp8h", 64, 128, 4, 3, w2_block_n=128), StreamPlan("fp8h", 128, 128, 4, 3),
             StreamPlan("fp8h", 64, 128, 4, 4), StreamPlan("fp8", 32, 128, 4, 3), StreamPlan("fp8", 64, 256, 4, 3),
             StreamPlan("fp8", 32, 256, 4, 3), StreamPlan("fp8", 32, 128, 2, 3),
             StreamPlan("fp8", 64, 128, 4, 4, min_steps=8), StreamPlan("regs", 64, 128, 4, 3),
             StreamPlan("regs", 64, 128, 4, 4, min_steps=8)]
    if extra:  # launch-shape neighbours (``--stream-variants all``)
        plans += [StreamPlan("fp8h", 128, 128, 4, 4), StreamPlan("fp8h", 64, 128, 4, 3, inline=True),
                  StreamPlan("fp8h", 64, 128, 4, 3, min_steps=8), StreamPlan("fp8", 64, 128, 4, 3, inline=True),
                  StreamPlan("fp8", 64, 256, 4, 4),
                  StreamPlan("fp8", 128, 256, 8, 3), StreamPlan("fp8", 32, 128, 4, 5), StreamPlan("fp8", 64, 512, 4, 3),
                  StreamPlan("fp8", 32, 256, 4, 3, min_steps=8), StreamPlan("scaled", 64, 128, 4, 3),
                  StreamPlan("regs", 128, 128, 8, 3)]
    return [(f"fused {p.decode} {p.block_n}x{p.block_k} w{p.num_warps} s{p.num_stages}"
             + (f" split{p.min_steps}" if p.min_steps else "") + (" inline" if p.inline else "")
             + (f" W2 n{p.w2_block_n}" if p.w2_block_n else ""), p) for p in plans]


# The CUDA-core GEMV streams of ``gemv_mx`` (batches of at most ``gemv_mx.MAX_ROWS``), by tuner name.
MOE_GEMV = [("moe gemv 16x256", "moe_gemv"), ("moe gemv 16x128", "moe_gemv_n16"), ("moe gemv 32x128", "moe_gemv_k128"),
            ("moe gemv direct 32x128 2 slices", "moe_gemv_d"), ("moe gemv direct 32x128 1 slice", "moe_gemv_d1"),
            ("moe gemv direct 64x128 4 slices", "moe_gemv_d64"), ("moe gemv direct 64x128 2 slices", "moe_gemv_d64_2"),
            ("moe gemv direct 32x128 1 slice, SwiGLU and combine fused (3 launches)", "moe_gemv_f"),
            ("moe gemv direct fused, W2 64x64", "moe_gemv_f_w64"),
            ("moe gemv direct fused, 2 steps in flight", "moe_gemv_f_p2")]
LINEAR_GEMV = ["gemv", "gemv_n16", "gemv_k128"]


def stream_cases(dims: V41Dims, device, smoke: bool, extra: bool = False,
                 moe_only: bool = False, gemv_only: bool = False, dense: bool = True,
                 unroll_only: bool = False) -> Iterator[Tuple[str, Callable]]:
    """MoE decode batches (T=1, 32): the split-K ``scaled`` / ``registers`` streams and every fused plan; the
    ladder; the dense linears by decode; MoE at T=128 (ordered so that a budget cut loses the least).
    ``moe_only``: the MoE rows of split-K ``scaled``, the FP8 fused plans and the tuned choice at T=32 / 128 / 1,
    nothing else. ``gemv_only``: batches of 1 and 4 only: MoE (split-K ``scaled``, the FP8 fused plans the
    tuner holds, the GEMV streams, ``DECODE_TUNER``'s choice, then the small-token class's) and the dense
    linears (tensor-core decodes, GEMV streams, both tuned choices); ``dense`` False: without the dense linears.
    ``unroll_only`` (with ``moe_only``): of the fused plans only fp8hd4 64x128 and its block_k 256 / 512 forms
    (``UNROLLED``). Graph replays where there is a GPU."""
    from redknot.kernels.triton.moe_stream import StreamPlan, moe_stream
    _, decode = _sizes(dims, smoke)
    graph = device.type == "cuda"
    how_run = "graph" if graph else "eager"
    weights, want = moe_memo(dims, device)

    variants = [("split-K scaled", "scaled"), ("split-K registers", "registers")] + _plans(smoke, extra) + \
        MOE_GEMV + [("tuned (DECODE_TUNER)", None), ("tuned (small-token class)", "small")]
    if gemv_only:
        from redknot.kernels.triton import moe_mx
        held = [c for c in moe_mx.DECODE_TUNER.candidates if isinstance(c, StreamPlan) and c.decode != "regs"]
        keep = [("split-K scaled", "scaled")] + [(n, p) for n, p in _plans(smoke, extra) if p in held or smoke]
        small = [1, 4] if not smoke else [1, 3]
        yield from _moe_rows(small, keep + MOE_GEMV + variants[-2:], dims, device, graph, weights, want)
        if dense:
            yield from _linear_rows(dims, device, smoke, graph, rows=small)
        return
    if moe_only:
        variants = [(n, p) for n, p in variants if p in ("scaled", None) or isinstance(p, StreamPlan)
                    and p.decode.startswith("fp8") and not p.min_steps and p.block_n >= 64]
        if unroll_only:
            base = StreamPlan("fp8hd4", 64, 128, 4, 3)
            variants = [(n, p) for n, p in variants if not isinstance(p, StreamPlan) or p == base or p in UNROLLED]
        yield from _moe_rows(decode[1:] + decode[:1], variants, dims, device, graph, weights, want)  # T=1 last
        return
    yield from _moe_rows(decode[:2], variants, dims, device, graph, weights, want)
    # the ladder: the bf16 decode without its MMA, then bytes only at several tile shapes (bytes per weight row
    # per K step: 64 / 128 / 256; does a longer contiguous read per row raise the stream's rate?)
    rungs = [(2, StreamPlan("regs", 32, 64) if smoke else StreamPlan("regs", 64, 128, 4, 3))]
    rungs += [(1, p) for p in ([StreamPlan("regs", 32, 64)] if smoke else [
        StreamPlan("regs", 64, 128, 4, 3), StreamPlan("regs", 64, 256, 4, 3), StreamPlan("regs", 32, 512, 4, 3),
        StreamPlan("regs", 128, 256, 8, 3)])]
    for t in decode[:2]:
        for mode, ladder in rungs:
            name = (f"ladder: {'decode + sum, no MMA' if mode == 2 else 'bytes only'} "
                    f"{ladder.block_n}x{ladder.block_k} w{ladder.num_warps}")

            def build(t=t, mode=mode, name=name, ladder=ladder):
                x, idx, wt = _moe_case_inputs(dims, device, t, t)
                fn = lambda: moe_stream(x, idx, wt, *weights(), 10.0, ladder, mode=mode)  # noqa: E731
                run, _, how = _graph_or_eager(fn, device, graph)
                return _case("moe_mx stream", f"T={t} {how_run} {name}", run, 0.0, _moe_bytes(dims, idx),
                             note="output unchecked (diagnostic)", key=f"{STREAM_KEY} moe T={t}", variant=name)
            yield f"stream moe T={t} {name}", build
    yield from _linear_rows(dims, device, smoke, graph)
    yield from _moe_rows(decode[2:], variants, dims, device, graph, weights, want)


def _moe_rows(tokens, variants, dims, device, graph, weights, want):
    from redknot.kernels.triton import moe_mx as fast_moe
    how_run = "graph" if graph else "eager"
    flops_per_token = 2 * dims.topk_experts * 3 * dims.hidden * dims.moe_inter
    from redknot.kernels.triton import gemv_mx
    for t in tokens:
        for name, dec in variants:
            small = dec == "small"  # the call's own choice: the small-token class at <= MAX_ROWS tokens
            if (small or (isinstance(dec, str) and dec.startswith("moe_gemv"))) and t > gemv_mx.MAX_ROWS:
                continue

            def build(t=t, name=name, dec=dec, small=small):
                x, idx, wt = _moe_case_inputs(dims, device, t, t)
                key = (tuple(weights()[0].shape), tuple(weights()[4].shape))
                run_dec = None if small else dec
                if dec is None:  # DECODE_TUNER's choice itself (at <= MAX_ROWS tokens a call asks the small class)
                    run_dec = fast_moe.DECODE_TUNER.pick(key, fast_moe._tuning_run(x, idx.shape[1], (*weights(), 10.0)),
                                                         x.device)
                fn = lambda: fast_moe.moe_splitk(x, idx, wt, *weights(), 10.0, decode=run_dec)  # noqa: E731
                note = _checked("moe_mx", f"T={t}", fn, lambda: want(t, x, idx, wt), 3e-2)
                run, _, how = _graph_or_eager(fn, device, graph)
                if dec is None:
                    note = f"{fast_moe.DECODE_TUNER.choices.get(key, 'untimed')}; {note}"
                if small:
                    note = (f"{fast_moe.SMALL_TUNER.choices.get(key, 'untimed')} "
                            f"(timings {fast_moe.SMALL_TUNER.timings.get(key, '-')}); {note}")
                return _case("moe_mx stream", f"T={t} {how_run} {name}", run, t * flops_per_token,
                             _moe_bytes(dims, idx), note=f"{how}; {note}", key=f"{STREAM_KEY} moe T={t}",
                             variant=name)
            yield f"stream moe T={t} {name}", build


def _linear_rows(dims, device, smoke, graph, rows=None):
    from redknot.kernels.triton import gemv_mx
    _, decode = _sizes(dims, smoke)
    how_run = "graph" if graph else "eager"
    shapes = [("toy", dims.hidden, dims.hidden)] if smoke else [("wo_b", 5120, 8192), ("wq_b", 32768, 1280)]
    for sname, n, k in shapes:
        for m in rows or decode:
            decs = ["registers", "registers_wide", "fp8", "fp8_n32", "scaled", None]
            if m <= gemv_mx.MAX_ROWS:  # the GEMV streams and the small-row class's own choice
                decs += LINEAR_GEMV + ["small"]
            for dec in decs:
                def build(sname=sname, n=n, k=k, m=m, dec=dec):
                    g = torch.Generator(device=device).manual_seed(m + n)
                    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
                    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
                    small = dec == "small"
                    run_dec = None if small else dec
                    if dec is None:  # LINEAR_DECODE_TUNER's choice itself (<= MAX_ROWS rows ask the small class)
                        run_dec = gemm_mx._stream_decode(x, w, ws.view(torch.uint8), 32,
                                                         torch.empty(m, n, dtype=x.dtype, device=device))
                    fn = lambda: linear_mx(x, w, ws, 32, path="splitk", decode=run_dec)  # noqa: E731
                    note = _checked("linear_mx", sname, fn, lambda: ref.linear_mx(x, w, ws, 32), 1e-2)
                    run, _, how = _graph_or_eager(fn, device, graph)
                    name = "tuned (small-row class)" if small else dec or "tuned (LINEAR_DECODE_TUNER)"
                    if dec is None:
                        note = f"{gemm_mx.LINEAR_DECODE_TUNER.choices.get((tuple(w.shape), 32), 'untimed')}; {note}"
                    if small:
                        tkey = (tuple(w.shape), 32)
                        note = (f"{gemm_mx.LINEAR_SMALL_TUNER.choices.get(tkey, 'untimed')} (timings "
                                f"{gemm_mx.LINEAR_SMALL_TUNER.timings.get(tkey, '-')}); {note}")
                    return _case("linear_mx stream", f"{sname} M={m} {how_run} {name}", run, 2 * m * n * k,
                                 m * k * 2 + n * k + ws.numel() + m * n * 2, note=f"{how}; {note}",
                                 key=f"{STREAM_KEY} linear {sname} M={m}", variant=name)
                yield f"stream linear {sname} M={m} {dec}", build


def stream_lines(rows) -> List[str]:
    """One table per case key: every variant's ms and % of floor, and its speed-up over the first one."""
    groups = {}
    for r in rows:
        if r.key.startswith(STREAM_KEY + " "):
            groups.setdefault(r.key[len(STREAM_KEY) + 1:], []).append(r)
    if not groups:
        return []
    from redknot.kernels.triton import stream_guard
    lines = ["", "## Decode streams by variant (graph replays; fused MoE streams vs split-K)", "",
             "Variants refused on this device by their first-use check or build (their rows ran the split-K "
             f"``registers`` stream instead): {stream_guard.DECODE_ERRORS or 'none'}.", "",
             "| case | variant | ms | % of floor | vs first | note |", "|---|---|---|---|---|---|"]
    for key, rs in groups.items():
        base = rs[0].ms if rs[0].status == "ok" else 0.0
        for r in rs:
            if r.status != "ok":
                lines.append(f"| {key} | {r.variant} | {r.status} | | | |")
                continue
            up = f"{base / r.ms:.2f}x" if base and r.ms else ""
            lines.append(f"| {key} | {r.variant} | {r.ms:.4f} | {100 * r.roof:.1f} | {up} | {r.note} |")
    return lines


# The decode step's GEMV launches (``step_proj_v41.gemv_partials``: one launch over one or two FP8 weights that
# read the same rows) at V4.1 sizes: (label, the weights' N, K).
STEP_GEMV_LAUNCHES = [("wq_a | wkv", (1280, 512), 5120), ("wq_b + indexer wq_b", (32768, 4096), 1280),
                      ("wq_b", (32768,), 1280), ("wo_b", (5120,), 8192), ("Engram wkv", (25600,), 6144)]
# The step GEMV shapes by name (``STEP_SMALL_TUNER``'s): each on the (column block, slice) grid, on the flat grid
# with the same slices (``_flat``, the same bits) and with the slices cut against the resident programs (``_wave``).
STEP_GEMV_NAMES = [n + f for n in ("gemv_n16", "qgemv_n16", "qgemv_k128", "pgemv_k128") for f in ("", "_flat", "_wave")]


def step_gemv_rows(device, smoke: bool, rows: int = 1) -> Iterator[Tuple[str, Callable]]:
    """The step GEMV launches at ``rows`` rows by name, each the launch alone (its partials, plus the ``qdq_bf16``
    launch of a ``qgemv*`` name) replayed in a CUDA graph, its slice sums checked against ``ref_v41.linear_mx``
    first; the programs and K slices of each in the note."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton import step_proj_v41 as sp
    launches = [("toy", (96, 64), 1024)] if smoke else STEP_GEMV_LAUNCHES
    graph = device.type == "cuda"
    for label, ns, k in launches:
        for name in STEP_GEMV_NAMES:
            def build(label=label, ns=ns, k=k, name=name):
                g = torch.Generator(device=device).manual_seed(k + ns[0])
                ws = [mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32) for n in ns]
                ws = [(w, s.view(torch.uint8)) for w, s in ws]
                x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
                note = _checked("step gemv", f"{label} {name}",
                                lambda: torch.cat([p.sum(0) for p in sp.gemv_partials(x, ws, 32, name)], 1),
                                lambda: torch.cat([ref.linear_mx(x, w, s, 32).float() for w, s in ws], 1), 1e-2)
                run, _, how = _graph_or_eager(lambda: sp.gemv_partials(x, ws, 32, name)[0], device, graph)
                plan = gemv_mx.PLANS[sp.plan_name(name)]
                parts = sp.gemv_partials(x, ws, 32, name)
                nbs = [-(-n // plan.block_n) for n in ns]
                real = sum(nb * p.shape[0] for nb, p in zip(nbs, parts))
                grid = real if sp.grid_form(name) else sum(nbs) * max(p.shape[0] for p in parts)
                note = f"slices {[p.shape[0] for p in parts]}, {grid} programs ({real} working); {how}; {note}"
                nk = sum(n * k for n in ns)
                return _case("step gemv", f"{label} M={rows} {'graph' if graph else 'eager'} {name}", run,
                             2 * rows * nk, nk + nk // 1024 + rows * k * 2 + rows * sum(ns) * 4, note=note,
                             key=f"{STREAM_KEY} step gemv {label} M={rows}", variant=name)
            yield f"step gemv {label} M={rows} {name}", build
