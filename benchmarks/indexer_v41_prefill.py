#!/usr/bin/env python3
"""The V4.1 indexer in prefill chunks, per launch shape and path, checked against each other and timed.

    PYTHONUNBUFFERED=1 python benchmarks/indexer_v41_prefill.py --out DIR     # on an H200, about 1-2 minutes
    PYTHONUNBUFFERED=1 python benchmarks/indexer_v41_prefill.py --stream-only --out DIR   # the top-k shapes only
    python benchmarks/indexer_v41_prefill.py --smoke --out DIR                # CPU: Triton interpreter, toy sizes

A prefill chunk of ``--tokens`` queries at the end of a context of N compressed entries (query i sees
N - T + i + 1 of them; V4.1 indexer widths: 32 heads of 128, top-512, 2048 candidate blocks of 8;
the reference numerics' bf16 score arithmetic) runs:

* the streamed top-k (layers 2/8/14/20 without candidates) with every launch shape of its tuner
  (``indexer_mx.STREAM_TUNER``: tokens per program, register or ``tl.dot_scaled`` key decode, or the keys
  expanded once to bf16 and streamed through a pipelined loop); a summary puts the fastest shape of the
  earlier decodes (old) against the fastest ``expanded`` shape (new), with % of the FP8 floor;
* the candidate source (layer 20): the fused pass (top-k and block maxima in one stream) against the two
  passes it replaced (the streamed top-k, then ``indexer_candidates_mx``'s block-max pass);
* a re-indexing layer (24/28/32/36) inside 2048 candidate blocks: the stream over each token's candidate
  list against the written scores + ``torch.topk``.

Every variant's selection equals the first variant's of its group (the scores are exact, ties go to the
lower entry): a mismatch is a FAIL row. Times are CUDA-event medians after a warm-up call; TFLOP/s count
2·Hi·Di per (query, scored entry); the fraction is of the cost model's indexer floor (FP8 1451 TFLOP/s)
and of the bf16 MMA peak (796 TFLOP/s) the kernels run at. Results: ``DIR/indexer_v41_prefill.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

FP8_FLOPS, BF16_FLOPS = 1451e12, 796e12


def _timed(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Median seconds of ``reps`` calls after one warm-up call (compile, tuning)."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def inputs(t: int, n: int, heads: int, dim: int, device, seed: int):
    import torch

    from redknot.kernels import mx_formats as mx

    g = torch.Generator(device=device).manual_seed(seed)
    q = mx.act_quant_ref(torch.randn(t, heads, dim, generator=g, device=device).bfloat16(), "fp4")
    w = torch.randn(t, heads, generator=g, device=device) * heads ** -0.5
    keys = mx.pack_index_keys(torch.randn(n, dim, generator=g, device=device))
    vis = (n - t + 1 + torch.arange(t, device=device)).clamp(min=0).to(torch.int32)
    return q, w, keys, vis


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/indexer_v41_prefill"))
    ap.add_argument("--smoke", action="store_true", help="CPU: Triton interpreter, toy sizes")
    ap.add_argument("--tokens", type=int, default=8192, help="queries per chunk")
    ap.add_argument("--entries", default="65536,262144", help="compressed entries of the context (comma list)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting cases after this many seconds")
    ap.add_argument("--decodes", default="", help="only the stream shapes of these key decodes (comma list, e.g. "
                                                  "'expanded'; default: every shape of the tuner)")
    ap.add_argument("--stream-only", action="store_true",
                    help="only the streamed top-k shapes and their old / new summary (no source or re-index groups)")
    ap.add_argument("--select-only", action="store_true",
                    help="only the candidate source's block selection from its block maxima (radix / torch)")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from redknot.kernels.triton import indexer_mx

    cuda = torch.cuda.is_available() and not a.smoke
    device = torch.device("cuda" if cuda else "cpu")
    heads, dim, topk, nb, bs = (32, 128, 512, 2048, 8) if not a.smoke else (4, 64, 16, 6, 8)
    t = a.tokens if not a.smoke else 6
    entries = [int(x) for x in a.entries.split(",") if x] if not a.smoke else [300]
    reps = a.reps if not a.smoke else 1
    t0 = time.perf_counter()
    rows: List[dict] = []

    summary: list = []

    def old_new(group: str):
        """The fastest earlier decode (registers / scaled) against the fastest expanded shape of a group."""
        timed = [r for r in rows if r["group"] == group and "ms" in r]
        old = [r for r in timed if "decode expanded" not in r["variant"]]
        new = [r for r in timed if "decode expanded" in r["variant"]]
        if not old or not new:
            return
        o, nw = min(old, key=lambda r: r["ms"]), min(new, key=lambda r: r["ms"])
        summary.append({"group": group, "old": o, "new": nw, "speedup": o["ms"] / nw["ms"]})
        print(f"{group} | old {o['ms']:.2f} ms ({100 * o['fraction_fp8_floor']:.1f} % of FP8 floor) -> new "
              f"{nw['ms']:.2f} ms ({100 * nw['fraction_fp8_floor']:.1f} %): {o['ms'] / nw['ms']:.2f}x; "
              f"selections {'same' if o['same_as_first'] and nw['same_as_first'] else 'DIFFERENT'}")

    def case(group: str, label: str, fn, scored: float, ref=None, read_bytes: float = 0.0):
        if time.perf_counter() - t0 > a.budget_s:
            rows.append({"group": group, "variant": label, "skipped": "budget"})
            print(f"{group} | {label}: skipped (budget)")
            return None
        try:
            out = fn()
            s = _timed(fn, reps, cuda)
        except Exception as exc:   # a launch shape the compiler rejects is a row, not the end of the run
            rows.append({"group": group, "variant": label, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            print(f"{group} | {label}: ERROR {exc}")
            return None
        same = True
        if ref is not None:
            same = all(torch.equal(x, y) for x, y in zip(out if isinstance(out, tuple) else (out,),
                                                         ref if isinstance(ref, tuple) else (ref,)))
        flops = 2 * heads * dim * scored   # 0 for a selection (no scoring): its rows give ms and GB/s
        row = {"group": group, "variant": label, "ms": s * 1e3, "tflops": flops / s / 1e12,
               "fraction_fp8_floor": flops / FP8_FLOPS / s, "fraction_bf16_peak": flops / BF16_FLOPS / s,
               "same_as_first": same}
        if not scored:
            row["gbps"] = read_bytes / s / 1e9
        rows.append(row)
        rate = (f"{row['gbps']:.0f} GB/s of block maxima read" if not scored else
                f"{row['tflops']:.1f} TFLOP/s ({100 * row['fraction_bf16_peak']:.1f} % of bf16 peak)")
        print(f"{group} | {label}: {s * 1e3:.2f} ms, {rate}, {'same' if same else 'DIFFERENT'}")
        return out

    for n in entries:
        if a.select_only:
            # the candidate source's block maxima [T, N/bs] (fp32, -inf past a row's visible blocks), the newest
            # visible block pinned by the selection itself (in place: again +inf on every call); every form's ids
            # equal the first's
            g = torch.Generator(device=device).manual_seed(n)
            nblk = -(-n // bs)
            vis = (n - t + 1 + torch.arange(t, device=device)).clamp(min=0).to(torch.int32)
            bmax = torch.randn(t, nblk, generator=g, device=device)
            bmax = bmax.masked_fill(torch.arange(nblk, device=device)[None] >= (vis[:, None] + bs - 1) // bs,
                                    float("-inf"))
            group = f"block selection ({nb} of {nblk} blocks), {t} queries, {n} entries"
            first = None
            for how in indexer_mx.BLOCK_SELECTS:
                got = case(group, how, lambda how=how, x=bmax, v=vis: indexer_mx._pin_and_select(x, v, nb, bs, how),
                           0.0, first, read_bytes=4.0 * t * nblk)
                first = got if first is None else first
            continue
        q, w, keys, vis = inputs(t, n, heads, dim, device, seed=n)
        scored = float(vis.long().sum())
        group = f"stream top-k, {t} queries, {n} entries"
        first = None
        decodes = [d for d in a.decodes.split(",") if d]
        for cfg in indexer_mx.STREAM_TUNER.candidates:
            if decodes and cfg.decode not in decodes:
                continue
            stages = f", stages {cfg.num_stages}" if getattr(cfg, "num_stages", 0) else ""
            stages += f", head sum {cfg.head_sum}" if getattr(cfg, "head_sum", "") else ""
            stages += f", cut {cfg.cut}" if getattr(cfg, "cut", "") else ""
            stages += f", max_regs {cfg.max_regs}" if getattr(cfg, "max_regs", 0) else ""
            got = case(group, f"block_t {cfg.block_t}, block_n {cfg.block_n}, warps {cfg.num_warps}, "
                              f"decode {cfg.decode}{', prefetch' if getattr(cfg, 'prefetch', False) else ''}{stages}",
                       lambda cfg=cfg: indexer_mx.stream_topk(q, w, keys, vis, topk, True, config=cfg), scored, first)
            first = got if first is None else first
        old_new(group)
        if a.stream_only:
            continue
        group = f"candidate source (top-k + {nb} blocks), {t} queries, {n} entries"
        two = case(group, "two passes: streamed top-k, then the block-max pass",
                   lambda: (indexer_mx.indexer_topk_mx(q, w, keys, vis, topk, bf16_scores=True),
                            indexer_mx.indexer_candidates_mx(q, w, keys, vis, nb, bs, True)), 2 * scored)
        fused = case(group, "one pass: the stream writes the block maxima",
                     lambda: indexer_mx.indexer_source_mx(q, w, keys, vis, topk, nb, bs, True), scored, two)
        blocks = (fused or two or (None, None))[1]
        if blocks is None:
            continue
        group = f"re-index inside {nb} candidate blocks, {t} queries, {n} entries"
        ncand = float((blocks >= 0).sum()) * bs
        ref = case(group, "written scores + torch.topk",
                   lambda: indexer_mx.indexer_topk_mx(q, w, keys, vis, topk, blocks, bs, True, cand_path="scores"),
                   ncand)
        case(group, "stream over the candidate list",
             lambda: indexer_mx.indexer_topk_mx(q, w, keys, vis, topk, blocks, bs, True, cand_path="stream"),
             ncand, ref)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "tokens": t,
              "entries": entries, "rows": rows, "tuned": {str(k): str(v) for k, v in
                                                          indexer_mx.STREAM_TUNER.choices.items()},
              "seconds": time.perf_counter() - t0,
              "old_new": [{"group": x["group"], "old": x["old"]["variant"], "old_ms": x["old"]["ms"],
                           "new": x["new"]["variant"], "new_ms": x["new"]["ms"], "speedup": x["speedup"]}
                          for x in summary]}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "indexer_v41_prefill.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = [f"# V4.1 indexer, prefill chunks ({report['device']})", "",
             "| case | variant | ms | TFLOP/s | % of FP8 floor | % of bf16 peak | selection |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['group']} | {r['variant']} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        if "gbps" in r:
            lines.append(f"| {r['group']} | {r['variant']} | {r['ms']:.2f} | ({r['gbps']:.0f} GB/s read) | | | "
                         f"{'same' if r['same_as_first'] else 'FAIL: different'} |")
            continue
        lines.append(f"| {r['group']} | {r['variant']} | {r['ms']:.2f} | {r['tflops']:.1f} | "
                     f"{100 * r['fraction_fp8_floor']:.1f} | {100 * r['fraction_bf16_peak']:.1f} | "
                     f"{'same' if r['same_as_first'] else 'FAIL: different'} |")
    if summary:
        lines += ["", "## Streamed top-k: fastest earlier decode (old) vs fastest expanded shape (new)", "",
                  ("| case | old | old ms | old % of FP8 floor | new | new ms | new % of FP8 floor | speed-up | "
                   "selections |"), "|---|---|---|---|---|---|---|---|---|"]
        for x in summary:
            o, nw = x["old"], x["new"]
            lines.append(f"| {x['group']} | {o['variant']} | {o['ms']:.2f} | {100 * o['fraction_fp8_floor']:.1f} | "
                         f"{nw['variant']} | {nw['ms']:.2f} | {100 * nw['fraction_fp8_floor']:.1f} | "
                         f"{x['speedup']:.2f}x | {'same' if o['same_as_first'] and nw['same_as_first'] else 'FAIL'} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "indexer_v41_prefill.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0 if all(r.get("same_as_first", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
