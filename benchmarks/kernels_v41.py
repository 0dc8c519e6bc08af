#!/usr/bin/env python3
"""Check and time the V4.1 shipped-format kernels (``hardware=sm90-port``) at real V4.1 dimensions.

    PYTHONUNBUFFERED=1 python benchmarks/kernels_v41.py --out DIR     # on an H200, about 4-6 minutes
    PYTHONUNBUFFERED=1 python benchmarks/kernels_v41.py --only gemm --out DIR   # weight-stream GEMMs, before/after
    PYTHONUNBUFFERED=1 python benchmarks/kernels_v41.py --only stream --out DIR # decode streams by variant
    PYTHONUNBUFFERED=1 python benchmarks/kernels_v41.py --only prefill --out DIR  # MoE prefill plans, 8192 tokens
    PYTHONUNBUFFERED=1 python benchmarks/kernels_v41.py --only attention --contexts 8192 --out DIR  # sparse attention
    python benchmarks/kernels_v41.py --smoke --out DIR                # CPU: Triton interpreter, toy sizes

Phase 1 (correctness): every op against its PyTorch reference (``redknot.kernels.ref_v41``) on fresh
random inputs at V4.1 dimensions (hidden 5120, 384 experts top-6, expert FFN 2304, 512-d latent caches,
32 index heads of 128, top-512, 2048 candidate blocks of 8); ``redknot/kernels/triton/checks_mx.py``.
Phase 2 (speed): prefill chunks and decode batches, compressed contexts 8K / 128K / 1M entries for
attention and indexer; CUDA-event timing (warm-up, median of the repetitions); achieved TFLOP/s and TB/s
and the fraction of the roofline floor. Phase 3: the Engram gather from HBM and from pinned host memory
against the measured host-to-device copy bandwidth. A failing case is a FAIL row; the run goes on.
``--only gemm``: only the before / after table of the weight-stream GEMMs (MoE and dense linears at
decode sizes, eager and in CUDA graphs, with the split-K kernels' earlier weight decode and the current
one; the MoE prefill plan), each row checked against its reference first, then the decode streams by
variant (``--only stream`` runs only those: the fused MoE streams of ``moe_stream`` next to the split-K
ones, a load / decode / MMA ladder, the dense FP8 streams by decode; ``kernels_v41_stream_cases.py``).

Roofline (the method of the project's cost model): an op's floor is ``max(FLOPs / peak, bytes / HBM)``
with the H200 ceilings measured on the machine, FP8 1451 TFLOP/s (bf16 796 for the bf16-MMA ops) and
4.17 TB/s; FLOPs count 2 per multiply-add, bytes count every byte an op must read or write once (stored
formats at their stored size). ``fraction = floor / measured``. Results: ``DIR/kernels_v41.md`` and
``DIR/kernels_v41.json`` (``$OUT`` if --out is not given).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

PEAK_FLOPS = {"fp8": 1451e12, "bf16": 796e12}  # H200, measured (fp8 torch._scaled_mm, bf16 matmul 8192³)
HBM_BYTES_PER_S = 4.17e12                       # H200 device-to-device copy (read + write), measured


def roofline_fraction(flops: float, nbytes: float, seconds: float, peak: str) -> float:
    """Fraction of the floor max(flops / peak, bytes / bandwidth) that a measured time reaches."""
    floor = max(flops / PEAK_FLOPS[peak] if flops else 0.0, nbytes / HBM_BYTES_PER_S)
    return floor / seconds if seconds > 0 else 0.0


@dataclass
class Case:
    op: str
    label: str
    run: Callable[[], object]
    flops: float
    nbytes: float
    peak: str = "fp8"
    note: str = ""
    key: str = ""      # rows with one key and variants "before" / "after" form a comparison pair
    variant: str = ""


@dataclass
class Row:
    op: str
    label: str
    status: str
    ms: float = 0.0
    tflops: float = 0.0
    tbps: float = 0.0
    roof: float = 0.0
    peak: str = ""
    note: str = ""
    key: str = ""
    variant: str = ""


@dataclass
class Run:
    args: argparse.Namespace
    device: object
    t0: float = field(default_factory=time.perf_counter)
    rows: List[Row] = field(default_factory=list)
    checks: List[dict] = field(default_factory=list)
    transfer: List[dict] = field(default_factory=list)

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", flush=True)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.args.budget_s


def time_ms(fn, device, reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (CUDA events per repetition; wall clock on CPU)."""
    import torch
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed(run: Run, build: Callable[[], Case], desc: str) -> None:
    import torch
    if run.over_budget():
        run.rows.append(Row(desc, "", "SKIP (time budget)"))
        run.log(f"SKIP {desc}")
        return
    try:
        case = build()
        ms = time_ms(case.run, run.device, run.args.reps, warmup=0 if run.args.smoke else 3)  # smoke: one run
        row = Row(case.op, case.label, "ok", ms, case.flops / ms / 1e9, case.nbytes / ms / 1e9,
                  roofline_fraction(case.flops, case.nbytes, ms / 1e3, case.peak), case.peak, case.note, case.key,
                  case.variant)
        run.log(f"{case.op:<22} {case.label:<34} {ms:9.3f} ms {row.tflops:8.1f} TF/s {row.tbps:7.3f} TB/s "
                f"{100 * row.roof:5.1f}% of floor")
    except Exception as exc:  # a crash is a failed row, not the end of the run
        traceback.print_exc()
        row = Row(desc, "", f"FAIL {type(exc).__name__}: {str(exc)[:160]}")
        run.log(f"FAIL {desc}")
    run.rows.append(row)
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def run_checks(run: Run, dims) -> None:
    import torch
    from redknot.kernels.triton.checks_mx import ALL_MX_CHECKS
    for name, check in ALL_MX_CHECKS.items():
        try:
            rows = check(dims, run.device, seed=11)
        except Exception as exc:
            traceback.print_exc()
            rows = []
            run.checks.append(dict(name=name, ok=False, err=float("inf"), tol=0.0,
                                   detail=f"{type(exc).__name__}: {exc}"))
        for r in rows:
            run.checks.append(dict(name=r.name, ok=r.ok, err=r.err, tol=r.tol, detail=r.detail))
            run.log(r.line())
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def _prefill_case_kept(desc: str, decodes) -> bool:
    """Whether the --only prefill case ``desc`` stays under --prefill-decodes ``decodes``: the grouped plan, the
    routing and the combine always; an FP8 plan's rows (whole, W1+W3, W2) when its decode is listed; the measured
    choice never."""
    words = desc.split()
    if "scaled" in words:  # the library-GEMM plans (``kernels_v41_scaled_cases``): whole and by part
        return "scaled" in decodes
    if "plan" in words:
        return words[words.index("plan") + 1] in decodes
    if words[:3] in (["prefill", "part", "W1+W3"], ["prefill", "part", "W2"]):
        return words[3] in decodes
    return desc != "compare moe prefill after"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: Triton interpreter, toy dimensions")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the results (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop starting timed cases after this many seconds (keeps a run under ~6 minutes)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case (median)")
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 131072, 1048576],
                    help="compressed entries visible to attention / indexer cases")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--only", choices=("all", "gemm", "stream", "prefill", "attention"), default="all",
                    help="gemm: only the before/after table of the weight-stream GEMMs (no phase-1 checks); "
                         "prefill: only the MoE prefill plans at 8192 tokens (grouped, the measured choice, "
                         "each FP8 tensor-core plan, then those plans by part); "
                         "stream: only the decode streams by variant (fused MoE streams, split-K, dense decodes); "
                         "attention: only sparse_attention_mx (the --contexts cases, then the prefill launch shapes "
                         "of the earlier and the transposed kernel at the first context), no phase-1 checks")
    ap.add_argument("--stream-variants", choices=("core", "all", "moe", "gemv", "moe_gemv", "moe_unroll",
                                                  "step_gemv"),
                    default="core",
                    help="the fused MoE stream plans timed by --only stream / gemm: core, or all (launch-shape "
                         "neighbours too), or moe (only the MoE rows of split-K scaled, the FP8 fused plans of "
                         "at least 64 columns in one K slice and the tuned choice, at T=1 / 32 / 128), or gemv "
                         "(only batches of 1 and 4: the gemv_mx CUDA-core streams next to the tensor-core "
                         "streams and both tuned choices, MoE and the dense wo_b / wq_b), or moe_gemv (gemv's "
                         "MoE rows only: the routed experts at 1 and 4 tokens), or moe_unroll (moe's rows with "
                         "only fp8hd4 64x128 and its block_k 256 / 512 forms of the fused plans), or step_gemv "
                         "(only the decode step's GEMV launches at one row by step_proj_v41 name, also after "
                         "gemv's rows)")
    ap.add_argument("--prefill-decodes", default="",
                    help="with --only prefill: only the FP8 plans of these decodes (comma-separated, e.g. "
                         "fp8ht,fp8f), whole and by part, next to the grouped plan, the routing and the combine "
                         "(the measured-choice row, which tunes every candidate, is left out); 'scaled': the "
                         "library-GEMM plans (moe_prefill_scaled) whole and by part at --scaled-tokens")
    ap.add_argument("--scaled-tokens", default="8192,32768",
                    help="with --only prefill: token counts of the library-GEMM plan rows (comma-separated)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.reps = 1
    import torch
    from redknot.kernels.triton.checks_mx import REAL_V41, TOY_V41
    from kernels_v41_cases import (decode_compare_cases, engram_transfer, prefill_compare_cases,
                                   prefill_part_cases, stream_variant_cases, timed_cases)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU dry run", file=sys.stderr)
        return 2
    dims = TOY_V41 if args.smoke else REAL_V41
    run = Run(args, device)
    run.log(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu (interpreter)'}; "
            f"dims {'toy' if args.smoke else 'V4.1'}")
    if args.only == "prefill":
        from kernels_v41_cases import moe_memo
        from kernels_v41_scaled_cases import scaled_cases
        decodes = {d for d in args.prefill_decodes.split(",") if d}
        memo = moe_memo(dims, device)  # one set of expert weights for every case
        tokens = [16, 32] if args.smoke else [int(t) for t in args.scaled_tokens.split(",") if t]
        for desc, build in list(prefill_compare_cases(dims, device, args.smoke, *memo)) + list(
                prefill_part_cases(dims, device, args.smoke, memo[0])) + list(
                scaled_cases(dims, device, args.smoke, tokens, *memo)):
            if decodes and not _prefill_case_kept(desc, decodes):
                continue
            timed(run, build, desc)
        return write_results(run)
    if args.only == "attention":
        from kernels_v41_attention_cases import attention_variant_cases
        from kernels_v41_cases import attention_cases
        contexts = [64] if args.smoke else args.contexts
        for desc, build in list(attention_cases(dims, device, contexts, args.smoke)) + list(
                attention_variant_cases(dims, device, contexts[0], args.smoke)):
            timed(run, build, desc)
        return write_results(run)
    if args.only in ("gemm", "stream"):
        from kernels_v41_stream_cases import step_gemv_rows, stream_cases
        cases = [] if args.stream_variants == "step_gemv" else list(stream_cases(
            dims, device, args.smoke, args.stream_variants == "all", args.stream_variants in ("moe", "moe_unroll"),
            args.stream_variants in ("gemv", "moe_gemv"), dense=args.stream_variants != "moe_gemv",
            unroll_only=args.stream_variants == "moe_unroll"))
        if args.stream_variants in ("gemv", "step_gemv"):  # the step GEMV launches by name (step_proj_v41)
            cases += list(step_gemv_rows(device, args.smoke))
        if args.only == "gemm":
            cases = list(decode_compare_cases(dims, device, args.smoke)) + cases + list(
                stream_variant_cases(dims, device, args.smoke))
        for desc, build in cases:
            timed(run, build, desc)
        return write_results(run)
    if not args.skip_checks:
        run_checks(run, dims)
    contexts = [64] if args.smoke else args.contexts
    for desc, build in timed_cases(dims, device, contexts, args.smoke):
        timed(run, build, desc)
    try:
        run.transfer = engram_transfer(dims, device, args.smoke, run.log)
    except Exception as exc:
        traceback.print_exc()
        run.transfer = [dict(case="engram transfer", status=f"FAIL {type(exc).__name__}: {exc}")]
    return write_results(run)


def tuned_choices() -> List[str]:
    """Every problem class the tuners measured, with the launch shape they kept."""
    from redknot.kernels.triton.attention_mx import ATTN_MX_PREFILL_TUNER, ATTN_MX_TUNER
    from redknot.kernels.triton.gemm_mx import LINEAR_DECODE_TUNER, MX_GEMM_TUNER
    from redknot.kernels.triton.indexer_mx import INDEX_MX_TUNER
    from redknot.kernels.triton.moe_mx import DECODE_TUNER, PREFILL_TUNER
    out = []
    for tuner in (MX_GEMM_TUNER, PREFILL_TUNER, DECODE_TUNER, LINEAR_DECODE_TUNER, ATTN_MX_TUNER, ATTN_MX_PREFILL_TUNER,
                  INDEX_MX_TUNER):
        for key, cfg in tuner.choices.items():
            times = sorted(tuner.timings.get(key, []), key=lambda r: r[1])
            runner = ("; then " + ", ".join(f"{c} {ms:.4f} ms" for c, ms in times[1:])) if len(times) > 1 else ""
            best = f" {times[0][1]:.4f} ms" if times else ""
            timed = f" (timed as {tuner.timed_as[key]})" if key in tuner.timed_as else ""
            out.append(f"{tuner.name} {key}: {cfg}{best}{runner}{timed}")
    return out


def comparison_lines(rows: List[Row]) -> List[str]:
    """The before / after table: rows paired by ``key`` (ms and % of floor of each, speed-up)."""
    from redknot.kernels.triton import stream_guard
    pairs = {}
    for r in rows:
        if r.key and not r.key.startswith("stream "):  # the variant tables (``stream_lines``) list those
            pairs.setdefault(r.key, {})[r.variant] = r
    if not pairs:
        return []
    lines = ["", "## Weight-stream GEMMs: before / after", "",
             "before: split-K with the weight decoded by hand in registers (``decode=registers``), MoE prefill "
             "by the ``grouped`` plan; after: the current defaults (the prefill plan measured "
             "fastest; the weight decode chosen by ``moe_mx.DECODE_TUNER`` / ``gemm_mx.LINEAR_DECODE_TUNER``, "
             f"see each note). Decodes refused on this device (build or self-check): "
             f"{stream_guard.DECODE_ERRORS or 'none'}.", "",
             "| case | before ms | before % of floor | after ms | after % of floor | speed-up | after note |",
             "|---|---|---|---|---|---|---|"]
    for key, pair in pairs.items():
        b, a = pair.get("before"), pair.get("after")
        cell = lambda r: (f"{r.ms:.4f} | {100 * r.roof:.1f}" if r and r.status == "ok"  # noqa: E731
                          else f"{r.status if r else 'missing'} | ")
        up = f"{b.ms / a.ms:.2f}x" if a and b and a.status == b.status == "ok" and a.ms > 0 else ""
        lines.append(f"| {key} | {cell(b)} | {cell(a)} | {up} | {a.note if a else ''} |")
    return lines


def write_results(run: Run) -> int:
    failed_checks = [c for c in run.checks if not c["ok"]]
    failed_rows = [r for r in run.rows if r.status.startswith("FAIL")]
    lines = ["# V4.1 shipped-format kernels", "",
             f"Roofline: FP8 {PEAK_FLOPS['fp8'] / 1e12:.0f} TFLOP/s, bf16 {PEAK_FLOPS['bf16'] / 1e12:.0f} TFLOP/s, "
             f"HBM {HBM_BYTES_PER_S / 1e12:.2f} TB/s; fraction = max(FLOPs/peak, bytes/HBM) / time.", "",
             "## Checks against the references", "", "| check | result | error | tolerance |", "|---|---|---|---|"]
    lines += [f"| {c['name']} | {'PASS' if c['ok'] else 'FAIL'} | {c['err']:.3g} | {c['tol']:g} |" for c in run.checks]
    lines += ["", "## Timings", "", "| op | case | ms | TFLOP/s | TB/s | % of floor | peak | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in run.rows:
        if r.status != "ok":
            lines.append(f"| {r.op} | {r.label} | {r.status} | | | | | |")
        else:
            lines.append(f"| {r.op} | {r.label} | {r.ms:.4f} | {r.tflops:.1f} | {r.tbps:.3f} | {100 * r.roof:.1f} | "
                         f"{r.peak} | {r.note} |")
    lines += comparison_lines(run.rows)
    from kernels_v41_stream_cases import stream_lines
    lines += stream_lines(run.rows)
    lines += ["", "## Engram gather: HBM vs pinned host", "", "| case | ms | GB/s | note |", "|---|---|---|---|"]
    for t in run.transfer:
        lines.append(f"| {t.get('case')} | {t.get('ms', 0):.4f} | {t.get('gbps', 0):.1f} | "
                     f"{t.get('note', t.get('status', ''))} |")
    chosen = tuned_choices()
    lines += ["", "## Launch shapes chosen by measurement", ""] + [f"- {c}" for c in chosen]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if run.args.out:
        out = Path(run.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels_v41.md").write_text(text)
        (out / "kernels_v41.json").write_text(json.dumps(dict(
            checks=run.checks, rows=[r.__dict__ for r in run.rows], transfer=run.transfer, tuned=chosen,
            peaks=PEAK_FLOPS, hbm_bytes_per_s=HBM_BYTES_PER_S, smoke=run.args.smoke), indent=1))
        run.log(f"wrote {out / 'kernels_v41.md'} and {out / 'kernels_v41.json'}")
    run.log(f"done: {len(failed_checks)} failed checks, {len(failed_rows)} failed timed cases")
    return 1 if failed_checks or failed_rows else 0


if __name__ == "__main__":
    sys.exit(main())
