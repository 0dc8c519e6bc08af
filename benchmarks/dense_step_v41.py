#!/usr/bin/env python3
"""Time the V4.1 decode step's dense FP8 linears at batch 32 / 128 by ``linear_mx`` decode, ``wo_a``, and the step
attention by launch shape.

    PYTHONUNBUFFERED=1 python3 benchmarks/dense_step_v41.py --out DIR          # on a GPU, about 1-2 minutes
    python3 benchmarks/dense_step_v41.py --smoke --out DIR                     # CPU: Triton interpreter, toy sizes

Per weight shape of the step (``wq_a``, ``wkv``, ``wq_b``, ``wo_b``, the shared expert's ``w1`` / ``w3`` and ``w2``,
the indexer's ``wq_b``, Engram's ``wkv``) and row count, every ``gemm_mx.LINEAR_DECODE_TUNER`` candidate (the
earlier ones and the ``FUSED_DECODES``: the slice sum in the stream launch, fewer slices, 64-row tiles) as a
CUDA-graph replay (median of ``--reps``; the graph calls it on up to 8 copies of the weight, at least 256 MB in all,
so that each call reads its weight from HBM, not from L2; the time divided by the copies), each checked once against
``ref_v41.linear_mx``
(relative error) and, for a fused name, against its own launch shape's two launches (bit for bit), with the
fraction of the bandwidth floor (weight + activation + output bytes at ``--hbm-tbs``). Then per row count the step's
sum (each shape times its launches per step in the 5-layer cut) with each shape's fastest earlier candidate, its
fastest candidate of all, and the tuner's own choice for the shape and the rows' class (``_stream_decode``: timed at
32 rows for 5-64 rows, at ``gemm_mx.LINEAR_WIDE_TUNE_ROWS`` for the wide class from ``gemm_mx.WIDE_ROWS_MIN`` rows).

``wo_a`` (8 groups of [1024, 4096], the attention output's per-group projection) is timed as the model's bf16
einsum (the weight decoded once, 67 MB a layer), as each ``wo_a_v41`` stream shape of its stored FP8 bytes (33.5 MB;
relative error against the einsum) and as ``wo_a_v41.wo_a``, the tuner's choice per row class.

The step attention (64 heads of 512, 128 window rows + 512 compressed entries, 8K context) runs first with every
``attention_mx.ATTN_MX_TUNER`` launch shape and the tuner's choice, then the step indexer's scores (32 heads of 128
over FP4 keys, ratio 1 and 2) with every ``STEP_INDEX_TUNER`` shape (``--only attention`` for just those two).

Results: ``DIR/dense_step_v41.md`` and ``.json``. Not a test: numbers only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from graph_timing import graph_ms  # noqa: E402

# (name, N, K, launches per step of the 5-layer V4.1 cut: 5 layers, 3 index sources, 1 Engram layer)
SHAPES = [("wq_a", 1280, 5120, 5), ("wkv", 512, 5120, 5), ("wq_b", 32768, 1280, 5), ("wo_b", 5120, 8192, 5),
          ("shared w1 | w3", 2304, 5120, 10), ("shared w2", 5120, 2304, 5), ("indexer wq_b", 4096, 1280, 3),
          ("Engram wkv", 25600, 6144, 1)]
SMOKE_SHAPES = [("toy a", 96, 2048, 2), ("toy b", 160, 1024, 1)]
WO_A = (8, 1024, 4096, 5)   # groups, rank, group width, launches per step
SMOKE_WO_A = (2, 64, 256, 1)


# Weight copies a timed replay walks through (each call reads its own copy), so that a replay's weights come from
# HBM, not from the previous replay's L2 (50 MB on an H100): at least this many bytes of copies, at most COPIES_MAX.
COPIES_BYTES = 256 << 20
COPIES_MAX = 8


def copies_for(nbytes: int, device) -> int:
    return 1 if device.type != "cuda" else max(1, min(COPIES_MAX, -(-COPIES_BYTES // max(nbytes, 1))))


def _time_ms(fn, device, reps: int, calls=None) -> float:
    """Median ms of one call: a CUDA graph of ``fn()`` (or of every function in ``calls``, one after another; the
    time divided by their number) replayed ``reps`` times on a GPU, one plain call on a CPU."""
    return graph_ms(calls or [fn], device, reps)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def linear_rows(shapes, rows_list, decodes, device, reps: int, hbm: float, deadline: float):
    import torch

    from redknot.kernels import mx_formats as mx
    from redknot.kernels import ref_v41
    from redknot.kernels.triton import gemm_mx, stream_guard

    out = []
    for name, n, k, per_step in shapes:
        g = torch.Generator(device=device).manual_seed(n + k)
        w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
        extra = [(w.clone(), ws.clone()) for _ in range(copies_for(n * k, device) - 1)]   # HBM, not L2
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
            want = ref_v41.linear_mx(x, w, ws, 32)
            nbytes = n * k + ws.numel() + rows * k * 2 + rows * n * 2
            for dec in decodes:
                row = {"shape": name, "N": n, "K": k, "rows": rows, "decode": dec, "per_step": per_step}
                if time.monotonic() > deadline:
                    row["status"] = "skipped (budget)"
                    out.append(row)
                    continue
                try:
                    def fn(x=x, w=w, ws=ws, dec=dec):
                        return gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=dec)
                    got = fn()
                    row["rel_err"] = _rel(got, want)
                    fused = gemm_mx.fused_name(dec)[1]
                    if fused:
                        two = gemm_mx._dense_stream(x, w, ws.view(torch.uint8), 32, torch.empty_like(got), dec,
                                                    unfused=True)
                        row["same_bits_as_two_launches"] = bool(torch.equal(got, two))
                    calls = [fn] + [lambda x=x, w=w2, ws=ws2, dec=dec: gemm_mx.linear_mx(x, w, ws, 32, path="splitk",
                                                                                       decode=dec)
                                    for w2, ws2 in extra]
                    ms = _time_ms(fn, device, reps, calls)
                    row.update(ms=ms, floor_pct=100.0 * nbytes / hbm / (ms * 1e-3), status="ok", copies=len(calls))
                except Exception as exc:   # noqa: BLE001  (a candidate that does not build here: reported)
                    row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                out.append(row)
                print(json.dumps(row), flush=True)
        del extra
        for r in sorted({gemm_mx.tune_rows(m) for m in rows_list}):   # the tuner's classes the row counts ask
            row = {"shape": name, "N": n, "K": k, "rows": "tuner", "tuner_rows": r, "per_step": per_step,
                   "decode_errors": {str(a): b for a, b in stream_guard.DECODE_ERRORS.items()}}
            try:
                if time.monotonic() > deadline:
                    raise TimeoutError("skipped (budget)")
                x = torch.randn(r, k, generator=g, device=device).to(torch.bfloat16)
                row["choice"] = gemm_mx._stream_decode(x, w, ws.view(torch.uint8), 32,
                                                       torch.empty(r, n, dtype=x.dtype, device=device))
                key = gemm_mx.decode_key(w.shape, 32, r)
                row["tuner_timings"] = [(str(c), t) for c, t in gemm_mx.LINEAR_DECODE_TUNER.timings.get(key, [])]
            except Exception as exc:   # noqa: BLE001
                row["choice"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            out.append(row)
            print(json.dumps(row), flush=True)
        del w, ws
    return out


def wo_a_rows(dims, rows_list, device, reps: int, hbm: float, deadline: float = float("inf")):
    """``wo_a``: the model's bf16 einsum, each ``wo_a_v41`` stream shape of the stored FP8 bytes (checked against the
    einsum), and ``wo_a_v41.wo_a`` (the tuner's choice per row class)."""
    import torch

    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import wo_a_v41

    groups, rank, width, per_step = dims
    g = torch.Generator(device=device).manual_seed(7)
    w, ws = mx.quant_fp8_blocks(torch.randn(groups * rank, width, generator=g, device=device) * 0.02, 32)
    wb = mx.dequant_fp8_blocks(w, ws, 32).to(torch.bfloat16).view(groups, rank, width)
    n = copies_for(groups * rank * width * 2, device)
    sets = [(w, ws, wb)] + [(w.clone(), ws.clone(), wb.clone()) for _ in range(n - 1)]   # HBM, not L2
    out = []
    for rows in rows_list:
        o2 = torch.randn(rows, groups * width, generator=g, device=device).to(torch.bfloat16)
        want = wo_a_v41.einsum(o2, wb)
        cases = [("einsum bf16 (model)", 2, [lambda o2=o2, wb=c[2]: wo_a_v41.einsum(o2, wb) for c in sets])]
        for name in wo_a_v41.WO_A_TUNER.candidates[1:]:
            cases.append((f"FP8 stream {name}", 1, [lambda o2=o2, name=name, c=c: wo_a_v41.grouped_stream(
                o2, c[0], c[1], groups, name) for c in sets]))
        cases.append(("wo_a_v41.wo_a (tuner's choice)", 1, [lambda o2=o2, c=c: wo_a_v41.wo_a(
            o2, c[0], c[1], groups, lambda: c[2]) for c in sets]))
        for label, wbytes, calls in cases:
            row = {"shape": "wo_a", "rows": rows, "variant": label, "per_step": per_step, "copies": len(calls)}
            fn = calls[0]
            if time.monotonic() > deadline:
                row["status"] = "skipped (budget)"
                out.append(row)
                continue
            try:
                row["rel_err"] = _rel(fn(), want)
                ms = _time_ms(fn, device, reps, calls)
                nbytes = wbytes * groups * rank * width + rows * groups * width * 2 + rows * groups * rank * 2
                row.update(ms=ms, floor_pct=100.0 * nbytes / hbm / (ms * 1e-3), status="ok")
                if label.startswith("wo_a_v41"):
                    key = (tuple(w.shape), groups, min(1 << (rows - 1).bit_length(), wo_a_v41.MAX_ROWS))
                    row["variant"] += f": {wo_a_v41.WO_A_TUNER.choices.get(key, 'untimed')}"
            except Exception as exc:   # noqa: BLE001
                row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def attention_rows(rows_list, device, reps: int, hbm: float, smoke: bool, deadline: float):
    """The step attention (``step_attention_mx``: 64 heads of 512 over a 128-row window ring and 512 compressed
    entries at 8K) with every ``ATTN_MX_TUNER`` candidate, and the tuner's choice, per row count (one request per
    row, as ``step_kernels_v41``); each checked against ``step_attention_reference`` (max abs error / max abs)."""
    import torch

    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton.attention_mx import ATTN_MX_TUNER
    from redknot.kernels.triton.step_attention_mx import (
        step_attention_mx,
        step_attention_reference,
    )

    h, d, win, k, bs, ctx = (4, 64, 16, 8, 16, 100) if smoke else (64, 512, 128, 512, 256, 8192)
    out = []
    for batch in rows_list:
        g = torch.Generator(device=device).manual_seed(batch)
        pos = torch.tensor([ctx + 3 * i for i in range(batch)], device=device)
        back = torch.zeros(batch, dtype=torch.long, device=device)
        slot = torch.arange(batch, device=device)
        ring = mx.pack_window_rows(torch.randn(batch * win, d, generator=g, device=device))
        new = mx.pack_window_rows(torch.randn(batch, d, generator=g, device=device))
        n_ent = ctx + 3 * batch + 1
        comp = mx.pack_compressed_entries(torch.randn(-(-n_ent // bs) * bs, d, generator=g, device=device))
        q = (torch.randn(batch, h, d, generator=g, device=device) * 0.2).to(torch.bfloat16)
        sinks = torch.randn(h, generator=g, device=device)
        cidx = torch.sort(torch.randint(0, n_ent, (batch, k), generator=g, device=device), 1).values
        args = (q, ring, win, new, slot, pos, back, win, sinks, d ** -0.5, comp, cidx)
        want = step_attention_reference(*args).float()
        nbytes = batch * (win * mx.window_row_bytes(d) + k * mx.compressed_entry_bytes(d) + 2 * h * d * 2)
        for cfg in [*ATTN_MX_TUNER.candidates, None]:
            row = {"shape": "step attention", "rows": batch, "variant": "tuned" if cfg is None else str(cfg)}
            if time.monotonic() > deadline:
                row["status"] = "skipped (budget)"
                out.append(row)
                continue
            try:
                def fn(cfg=cfg, args=args):
                    return step_attention_mx(*args, config=cfg)
                got = fn().float()
                row["rel_err"] = float((got - want).abs().max() / want.abs().max())
                ms = _time_ms(fn, device, reps)
                row.update(ms=ms, floor_pct=100.0 * nbytes / hbm / (ms * 1e-3), status="ok")
                if cfg is None:
                    row["variant"] = "tuned: " + str(next(iter(c for key, c in ATTN_MX_TUNER.choices.items()
                                                               if key[0] == min(1 << (batch - 1).bit_length(), 4096)
                                                               and key[1:3] == (h, d)), "untimed"))
            except Exception as exc:   # noqa: BLE001
                row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def index_rows(rows_list, device, reps: int, hbm: float, smoke: bool, deadline: float):
    """The step indexer's scores (``step_index_scores``: 32 heads of 128 over each row's own FP4 index keys, 8K
    context, ratio 1 and 2, fp32 scores) with every ``STEP_INDEX_TUNER`` launch shape and the tuner's choice; a strided
    shape (``loop`` > 1) is compared bit for bit with the one-block shape of its block width, every shape against
    ``step_index_scores_reference`` (max relative error over the finite scores)."""
    import dataclasses

    import torch

    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton.step_indexer_mx import (
        STEP_INDEX_TUNER,
        step_index_scores,
        step_index_scores_reference,
    )

    hi, di, bs, ctx = (4, 64, 16, 100) if smoke else (32, 128, 256, 8192)
    out = []
    for ratio in (1, 2):
        for batch in rows_list:
            g = torch.Generator(device=device).manual_seed(batch + ratio)
            pages = -(-(ctx + 3 * batch + 1) // bs)
            per = bs // ratio
            keys = torch.randint(0, 256, (batch * pages * per, mx.index_key_bytes(di)), generator=g,
                                 dtype=torch.uint8, device=device)
            keys[:, di // 2:] = torch.randint(118, 128, (keys.shape[0], di // 32), generator=g, dtype=torch.uint8,
                                              device=device)
            table = (torch.arange(batch)[:, None] * pages + torch.arange(pages)[None, :]).to(device, torch.int32)
            q = mx.act_quant_ref(torch.randn(batch, hi, di, generator=g, device=device), "fp4", mx.MX_GROUP, "ue8m0")
            w = torch.randn(batch, hi, generator=g, device=device) * (di ** -0.5 * hi ** -0.5)
            vis = (torch.tensor([ctx + 3 * i for i in range(batch)], device=device) + 1) // ratio
            args = (q, w, keys, table, vis, ratio, bs)
            want = step_index_scores_reference(*args)
            fin = torch.isfinite(want)
            nbytes = int(vis.sum()) * mx.index_key_bytes(di) + want.numel() * 4
            for cfg in [*STEP_INDEX_TUNER.candidates, None]:
                row = {"shape": f"index scores r{ratio}", "rows": batch, "variant": "tuned" if cfg is None else str(cfg)}
                if time.monotonic() > deadline:
                    row["status"] = "skipped (budget)"
                    out.append(row)
                    continue
                try:
                    def fn(cfg=cfg, args=args):
                        return step_index_scores(*args, config=cfg)
                    got = fn()
                    row["inf_equal"] = bool(torch.equal(torch.isinf(got), torch.isinf(want)))
                    row["rel_err"] = float(((got[fin] - want[fin]).abs() / want[fin].abs().clamp(min=1e-6)).max())
                    if cfg is not None and (cfg.loop > 1 or cfg.page):
                        one = step_index_scores(*args, config=dataclasses.replace(cfg, loop=1, page=False))
                        row["same_bits_as_one_block"] = bool(torch.equal(got, one))
                    ms = _time_ms(fn, device, reps)
                    row.update(ms=ms, floor_pct=100.0 * nbytes / hbm / (ms * 1e-3), status="ok")
                    if cfg is None:
                        key = (min(1 << (batch - 1).bit_length(), 4096), hi, di, 1 << (want.shape[1] - 1).bit_length(),
                               False, False)
                        row["variant"] = f"tuned: {STEP_INDEX_TUNER.choices.get(key, 'untimed')}"
                except Exception as exc:   # noqa: BLE001
                    row["status"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                out.append(row)
                print(json.dumps(row), flush=True)
    return out


def summary(rows, rows_list, earlier) -> list:
    lines = ["", "## Step sums (ms per step: each shape's time x its launches per step)", "",
             "| rows | fastest earlier candidate | fastest of all | tuner's choice (for the rows' class) |",
             "|---|---|---|---|"]
    by = {}
    for r in rows:
        if r.get("status") == "ok" and "decode" in r:
            by.setdefault((r["rows"], r["shape"]), []).append(r)
    from redknot.kernels.triton import gemm_mx

    choice = {(r["shape"], r["tuner_rows"]): r.get("choice") for r in rows if r.get("rows") == "tuner"}
    for m in rows_list:
        cls = gemm_mx.tune_rows(m)
        old = new = tuned = 0.0
        for (mm, shape), rs in by.items():
            if mm != m:
                continue
            per = rs[0]["per_step"]
            olds = [r["ms"] for r in rs if r["decode"] in earlier]
            old += per * (min(olds) if olds else float("nan"))
            new += per * min(r["ms"] for r in rs)
            pick = [r["ms"] for r in rs if r["decode"] == choice.get((shape, cls))]
            tuned += per * (pick[0] if pick else float("nan"))
        lines.append(f"| {m} | {old:.4f} | {new:.4f} | {tuned:.4f} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: Triton interpreter, toy sizes")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/dense_step_v41"))
    ap.add_argument("--rows", type=int, nargs="*", default=[32, 128])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm-tbs", type=float, default=0.0,
                    help="HBM TB/s for the floor (default: 4.17 on an H200, else 3.35, the H100's)")
    ap.add_argument("--decodes", nargs="*", default=None,
                    help="default: every LINEAR_DECODE_TUNER candidate but scaled and fp8_n32 (never the H100's "
                         "choice at these shapes and the slowest: H100 run 3's tuning); 'all': every candidate")
    ap.add_argument("--shapes", nargs="*", default=None, help="shape names (default: all)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="cases past this many seconds are skipped (default 110; none with --smoke, a correctness "
                         "run whose interpreter time depends on the machine's load)")
    ap.add_argument("--no-wo-a", action="store_true")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--only", choices=("all", "linear", "attention"), default="all",
                    help="linear: the dense linears and wo_a only; attention: the step attention and the indexer's "
                         "scores only")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.reps, a.rows = 1, [5, 33]
    if a.budget_s is None:
        a.budget_s = float("inf") if a.smoke else 110.0
    import torch

    from redknot.kernels.triton import gemm_mx

    start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    if a.shapes:
        shapes = [s for s in shapes if s[0] in a.shapes]
    cands = list(gemm_mx.LINEAR_DECODE_TUNER.candidates)
    decodes = cands if a.decodes == ["all"] else a.decodes or [c for c in cands if c not in ("scaled", "fp8_n32")]
    earlier = [c for c in cands if c not in gemm_mx.FUSED_DECODES]
    if not a.hbm_tbs:
        a.hbm_tbs = 4.17 if device.type == "cuda" and "H200" in torch.cuda.get_device_name() else 3.35
    hbm = a.hbm_tbs * 1e12
    rows = []
    if a.only in ("all", "attention") and not a.no_attention:   # first: a handful of cases, the budget's least risk
        rows += attention_rows(a.rows, device, a.reps, hbm, a.smoke, start + a.budget_s)
        rows += index_rows(a.rows, device, a.reps, hbm, a.smoke, start + a.budget_s)
    if a.only in ("all", "linear"):   # wo_a first: few cases
        if not a.no_wo_a:
            rows += wo_a_rows(SMOKE_WO_A if a.smoke else WO_A, a.rows, device, a.reps, hbm, start + a.budget_s)
        rows += linear_rows(shapes, a.rows, decodes, device, a.reps, hbm, start + a.budget_s)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    lines = [f"# V4.1 step dense linears by decode ({gpu}, floor at {a.hbm_tbs} TB/s, {time.monotonic() - start:.0f} s)",
             "",
             "| shape | rows | decode | ms | % of floor | rel err | fused == two launches |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("rows") == "tuner":
            lines.append(f"| {r['shape']} | tuner ({r['tuner_rows']} rows) | {r.get('choice')} | | | | |")
        elif r.get("status") == "ok":
            lines.append(f"| {r['shape']} | {r['rows']} | {r.get('decode', r.get('variant'))} | {r['ms']:.4f} | "
                         f"{r['floor_pct']:.1f} | {r.get('rel_err', float('nan')):.2e} | "
                         f"{r.get('same_bits_as_two_launches', '')} |")
        else:
            lines.append(f"| {r['shape']} | {r['rows']} | {r.get('decode', r.get('variant'))} | {r['status']} | | | |")
    lines += summary(rows, a.rows, earlier)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dense_step_v41.json").write_text(json.dumps(rows, indent=1))
    (out / "dense_step_v41.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
