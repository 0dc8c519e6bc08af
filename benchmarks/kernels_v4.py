#!/usr/bin/env python3
"""Check and time RedKnot's Triton kernels (``hardware=sm90-port``) against the reference ops.

    PYTHONUNBUFFERED=1 python3 benchmarks/kernels_v4.py --out DIR        # on an H200, < 6 minutes
    python benchmarks/kernels_v4.py --smoke                              # CPU dry run (Triton interpreter, toy sizes)

Phase 1 (correctness): every kernel against its reference on fresh random inputs over edge-case
shapes (context < window, lengths not a multiple of the ratio, fewer visible entries than top-k,
exact score ties, key splits), output buffers poisoned first; tolerances per dtype.
Phase 2 (speed): each op at V4 dimensions, prefill chunks and decode steps at contexts 8K → 440K;
median time (``triton.testing.do_bench``), achieved TFLOP/s and TB/s, fraction of the roofline
(max(FLOPs / matrix peak, bytes / copy bandwidth) over the time; the H200 ceilings of the project's cost
model, ``redknot.models.deepseek_v4.cost``; FLOPs counted by its conventions), and
the speedup over the reference op where the reference is run. A failing case is a FAIL row; the run
goes on. Results: ``DIR/kernels.json``, ``DIR/kernels.csv``, ``DIR/kernels.txt`` (``$OUT`` if set).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

try:  # the project's cost model holds the measured H200 ceilings
    from redknot.models.deepseek_v4.cost import H200
    PEAKS = {"bf16": H200.bf16_flops, "fp8": H200.fp8_flops}
    BANDWIDTH = H200.hbm_bytes_per_s
except ImportError:
    PEAKS = {"bf16": 796e12, "fp8": 1451e12}  # H200 bf16 / fp8 matrix products, measured
    BANDWIDTH = 4.17e12  # H200 device-to-device copy, bytes read + written per second
PEAKS["fp32"] = 51e12  # FMA (non-tensor) fp32, the datasheet's 67 TFLOP/s derated like bf16's 990 -> 796
FULL_CONTEXTS = [8192, 32768, 131072, 450560]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: Triton interpreter, toy dimensions")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for the full results (default $OUT)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new timed cases after this")
    ap.add_argument("--check-budget-s", type=float, default=140.0, help="stop starting new checks after this")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--only", default="", help="comma list of ops to time (default all)")
    ap.add_argument("--checks", default="", help="comma list of checks to run, in this order (default all: "
                    "sparse_attention,indexer_topk,moe,linear,rms_norm+rope,mhc)")
    ap.add_argument("--contexts", type=int, nargs="*", default=FULL_CONTEXTS, help="contexts of the timed cases")
    ap.add_argument("--ref-max-context", type=int, default=32768, help="time the reference up to this context")
    ap.add_argument("--attention-variants", default="prefill", choices=["prefill", "none"],
                    help="after each attention prefill row, one row per transposed-kernel launch shape of the "
                         "prefill tuner (T[block_n/warps/d_split/heads/stages/pf]; on a GPU also the Gluon "
                         "kernel's, WG[block_n/stages]), each checked against the "
                         "earlier kernel's 64/32/8w/2-stage shape, whose time is its 'ref ms'; every candidate's "
                         "tuning time is printed under '# timed sparse_attention_prefill'")
    ap.add_argument("--indexer-variants", default="prefill", choices=["prefill", "none"],
                    help="after each 'indexer prefill' row, one row per pipelined prefill shape of the indexer "
                         "tuner (X[block_t/block_n/warps/stages]), each with the paged heads-on-N shape (the tuner's "
                         "first candidate) as its 'ref ms'; 64 sampled rows checked against float64 scores")
    return ap.parse_args(argv)


class Runner:
    def __init__(self, args, torch, device):
        self.args, self.torch, self.device = args, torch, device
        self.t0 = time.perf_counter()
        self.rows, self.checks, self.skipped_checks = [], [], []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def time_ms(self, fn, heavy: bool = False) -> float:
        torch = self.torch
        if self.device.type != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench
        if heavy:  # the reference: a few runs are enough and each can take long
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            return sorted(times)[1]
        return float(do_bench(fn, warmup=10, rep=60, return_mode="median"))

    def run_checks(self, checks, dims_list) -> None:
        torch = self.torch
        for dims_name, dims, dtypes in dims_list:
            for name, fn in checks.items():
                for dt in dtypes:
                    if self.elapsed() > self.args.check_budget_s:
                        self.log(f"check {name:<18} {dims_name:<5} {str(dt):<15} SKIP (check budget spent)")
                        self.skipped_checks.append(f"{name} {dims_name} {dt}")
                        continue
                    try:
                        res = fn(dims, self.device, dt)
                    except Exception as exc:  # a crash is a failed check, not the end of the run
                        from redknot.kernels.triton.checks import CheckResult
                        res = [CheckResult(name, f"{dims_name}: crashed", str(dt), False, float("inf"), 0.0,
                                           f"{type(exc).__name__}: {str(exc)[:200]}")]
                        traceback.print_exc()
                    for r in res:
                        r.case = f"{dims_name}: {r.case}"
                        self.checks.append(r)
                        if not r.ok:
                            print(r.line(), flush=True)
                    n_ok = sum(r.ok for r in res)
                    self.log(f"check {name:<18} {dims_name:<5} {str(dt):<15} {n_ok}/{len(res)} pass")
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()

    def timed(self, build, desc: str) -> None:
        """Build one case, time Triton (and the reference), compare outputs, record a row."""
        from kernel_cases import compare
        torch = self.torch
        if self.elapsed() > self.args.budget_s:
            self.rows.append(dict(op=desc, label="skipped (time budget)", status="SKIP"))
            self.log(f"SKIP {desc}: time budget spent")
            return
        row = dict(op=desc, status="FAIL")
        try:
            case = build()
            row.update(op=case.op, label=case.label, context=case.context, tokens=case.tokens)
            got = case.triton()  # first call: compilation and launch-shape tuning happen here
            t_ms = self.time_ms(case.triton)
            row.update(ms=t_ms, tflops=case.flops / t_ms / 1e9, tbps=case.bytes / t_ms / 1e9,
                       roof=max(case.flops / PEAKS[case.peak], case.bytes / BANDWIDTH) / (t_ms / 1e3))
            row["status"] = "ok"
            if case.reference is not None:
                want = case.reference()
                ok, err, note = compare(case, got, want)
                row.update(check="PASS" if ok else "FAIL", err=err, note=note)
                row["status"] = "ok" if ok else "FAIL"
                del want
                ref_ms = self.time_ms(case.reference, heavy=True)
                row.update(ref_ms=ref_ms, speedup=ref_ms / t_ms)
            del got, case
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
            traceback.print_exc()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.rows.append(row)
        self.log(format_row(row))


def format_row(r: dict) -> str:
    if r.get("status") == "SKIP":
        return f"{r['op']:<17} {'SKIP (time budget)'}"
    if "ms" not in r:
        return f"{r.get('op', ''):<17} {r.get('label', ''):<26} FAIL {r.get('error', '')}"
    ref = f"{r['ref_ms']:9.3f} {r['speedup']:7.1f}x" if "ref_ms" in r else f"{'—':>9} {'—':>8}"
    chk = r.get("check", "—")
    return (f"{r['op']:<17} {r['label']:<26} {r['context']:>7} {r['tokens']:>6} {r['ms']:9.3f} "
            f"{r['tflops']:8.1f} {r['tbps']:7.2f} {100 * r['roof']:6.1f}% {ref} {chk:>5} {r['status']}")


HEADER = (f"{'op':<17} {'case':<26} {'context':>7} {'tokens':>6} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>7} "
          f"{'roof':>7} {'ref ms':>9} {'speedup':>8} {'check':>5} status")


def timed_plan(runner: Runner, d, smoke: bool):
    """(builder, description) pairs, most important first."""
    import kernel_cases as kc
    dev, ref_max = runner.device, runner.args.ref_max_context
    contexts = [64, 200] if smoke else runner.args.contexts
    chunk = 8 if smoke else 4096
    batches = [1, 3] if smoke else [1, 32]
    only = {s for s in runner.args.only.split(",") if s}
    plan = []
    from redknot.kernels.triton import attention, indexer
    variants = [] if runner.args.attention_variants == "none" else \
        [c for c in attention.ATTN_PREFILL_TUNER.candidates if isinstance(c, attention.PrefillTConfig)
         or (isinstance(c, attention.PrefillWGConfig) and str(dev).startswith("cuda"))]  # Gluon: GPU only
    if smoke:  # interpreter-sized transposed shapes (the toy dims have 4 heads)
        variants = [attention.PrefillTConfig(16, 4, 4, 16), attention.PrefillTConfig(16, 4, 2, 16, prefetch=True)]
    ix_variants = [] if runner.args.indexer_variants == "none" else \
        [c for c in indexer.INDEXER_TUNER.candidates if isinstance(c, indexer.IndexerXConfig)]
    if smoke and ix_variants:  # an interpreter-sized pipelined shape (short steps)
        ix_variants = [indexer.IndexerXConfig(2, 16, 4, 3)]
    for ctx in contexts:
        for mode in ("csa", "hca", "swa"):
            plan.append(("sparse_attention", lambda m=mode, c=ctx: kc.attention_case(d, dev, m, c, chunk, 1, c <= ref_max),
                         f"attention {mode} prefill {ctx}"))
            for cfg in variants:
                plan.append(("sparse_attention", lambda m=mode, c=ctx, cfg=cfg: kc.attention_variant_case(
                    d, dev, m, c, chunk, 1, cfg, attention.ATTN_TUNER.candidates[0]),
                    f"attention {mode} prefill {ctx} {cfg}"))
        plan.append(("indexer_topk", lambda c=ctx: kc.indexer_case(d, dev, c, chunk, 1, c <= ref_max),
                     f"indexer prefill {ctx}"))
        for cfg in ix_variants:   # the CPU's nominal 8 SMs make 16 tokens the smallest prefill-sized step
            plan.append(("indexer_topk", lambda c=ctx, cfg=cfg: kc.indexer_variant_case(
                d, dev, c, max(chunk, 16), 1, cfg, indexer.INDEXER_TUNER.candidates[0]), f"indexer prefill {ctx} {cfg}"))
    for ctx in dict.fromkeys((contexts[0], contexts[-2] if smoke else 131072, contexts[-1])):
        for b in batches:
            for mode in ("csa", "hca"):
                plan.append(("sparse_attention", lambda m=mode, c=ctx, b=b: kc.attention_case(
                    d, dev, m, c, 1, b, c <= 4 * ref_max), f"attention {mode} decode b{b} {ctx}"))
            plan.append(("indexer_topk", lambda c=ctx, b=b: kc.indexer_case(d, dev, c, 1, b, c <= 4 * ref_max),
                         f"indexer decode b{b} {ctx}"))
    moe_cache: dict = {}
    experts = 8 if smoke else 256
    for weights in ("bf16", "fp8"):
        for t in ((1, 3, 40) if smoke else (1, 32, 8192)):
            plan.append(("moe", lambda w=weights, t=t: kc.moe_case(d, dev, t, experts, w, True, moe_cache)
                         if not smoke else _toy_moe(kc, d, dev, t, w, moe_cache), f"moe {weights} T={t}"))
    shapes = [(256, 128)] if smoke else [(32768, 1024), (4096, 8192), (512, 4096)]
    for n, k in shapes:
        for kind in ("bf16", "fp8-w8a16", "fp8-w8a8"):
            for t in ((3,) if smoke else (32, 8192)):
                plan.append(("linear", lambda n=n, k=k, kind=kind, t=t: kc.linear_case(dev, t, n, k, kind, True),
                             f"linear {kind} {n}x{k} T={t}"))
    small = list(kc.small_op_cases(dev, 5 if smoke else 8192, True))
    for case in small:
        plan.append((case.op, lambda c=case: c, f"{case.op}"))
    return [(build, desc) for op, build, desc in plan if not only or op in only]


def _toy_moe(kc, d, dev, t, weights, cache):
    """The V4-width MoE case shrunk for the interpreter: same code path, tiny expert matrices."""
    import torch
    from redknot.kernels import ref_moe
    from redknot.kernels.ref_quant import quantize_fp8_block
    from redknot.kernels.triton import ops
    e, dm, inter, k = 8, 256, 128, 2
    w = [torch.randn(e, inter, dm), torch.randn(e, dm, inter), torch.randn(e, inter, dm)]
    if weights == "fp8":
        qs = [[quantize_fp8_block(x[i]) for i in range(e)] for x in w]
        w = [torch.stack([q for q, _ in lst]) for lst in qs]
        s = [torch.stack([sc for _, sc in lst]) for lst in qs]
    else:
        w, s = [x.bfloat16() for x in w], [None] * 3
    x = torch.randn(t, dm).bfloat16()
    ids = torch.rand(t, e).topk(k, dim=1).indices
    wts = torch.rand(t, k)
    args = (x, ids, wts, w[0], w[1], w[2], 10.0, s[0], s[1], s[2])
    return kc.Case("moe", f"{weights} experts={e} (toy)", 0, t, lambda: ops.moe_op(*args),
                   lambda: ref_moe.moe(*args), t * k * 6.0 * dm * inter, 3.0 * e * dm * inter, tol=2e-2)


def save(out_dir, runner: Runner, table: str, extra: dict) -> None:
    if not out_dir:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    checks = [vars(c) for c in runner.checks]
    (out / "kernels.json").write_text(json.dumps(dict(rows=runner.rows, checks=checks, **extra), indent=1,
                                                 default=str))
    cols = ["op", "label", "context", "tokens", "ms", "tflops", "tbps", "roof", "ref_ms", "speedup", "check", "err",
            "status", "error"]
    lines = [",".join(cols)] + [",".join(str(r.get(c, "")).replace(",", ";") for c in cols) for r in runner.rows]
    (out / "kernels.csv").write_text("\n".join(lines) + "\n")
    (out / "kernels.txt").write_text(table)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    from redknot.kernels.triton.checks import ALL_CHECKS, REAL, TOY
    from redknot.kernels.triton import attention, fp8, indexer
    from redknot.kernels.triton._common import ConfigTuner
    runner = Runner(args, torch, device)
    env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
               torch=torch.__version__, triton=__import__("triton").__version__, smoke=args.smoke)
    runner.log(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}")
    if not args.skip_checks:
        # Tiny problems: no launch-shape tuning (the tuned shapes are compared with the reference in phase 2).
        ConfigTuner.enabled = False
        dims_list = [("toy", TOY, [torch.float32])] if args.smoke else \
            [("v4", REAL, [torch.bfloat16]), ("toy", TOY, [torch.float32])]
        wanted = [c for c in args.checks.split(",") if c] or list(ALL_CHECKS)
        unknown = set(wanted) - set(ALL_CHECKS)
        if unknown:
            raise SystemExit(f"--checks: unknown {sorted(unknown)}; known: {sorted(ALL_CHECKS)}")
        runner.run_checks({k: ALL_CHECKS[k] for k in wanted}, dims_list)  # in the order asked
        ConfigTuner.enabled = True
    dims = TOY if args.smoke else REAL
    runner.log("timing: " + HEADER)
    for build, desc in timed_plan(runner, dims, args.smoke):
        runner.timed(build, desc)
    failed_checks = [c for c in runner.checks if not c.ok]
    failed_rows = [r for r in runner.rows if r.get("status") == "FAIL"]
    tuned = {t.name: {str(k): str(v) for k, v in t.choices.items()}
             for t in (attention.ATTN_TUNER, attention.ATTN_DECODE_TUNER, attention.ATTN_PREFILL_TUNER,
                       indexer.INDEXER_TUNER, fp8.GEMM_TUNER)}
    tuned_ms = {f"{t.name} {k}": ", ".join([f"{c}: {ms:.3f} ms" for c, ms in v]
                                           + [f"{c}: failed ({why})" for c, why in t.failures.get(k, [])])
                for t in (attention.ATTN_PREFILL_TUNER, indexer.INDEXER_TUNER) for k, v in t.timings.items()}
    lines = [f"# {env}", f"# checks: {len(runner.checks) - len(failed_checks)}/{len(runner.checks)} pass"
             + (f"; not run (budget): {runner.skipped_checks}" if runner.skipped_checks else "")]
    lines += ["#   " + c.line() for c in failed_checks]
    lines += [HEADER] + [format_row(r) for r in runner.rows]
    lines += [f"# tuned {name}: {choice}" for name, choice in tuned.items() if choice]
    lines += [f"# timed {name}: {times}" for name, times in tuned_ms.items()]
    lines += [f"# total {runner.elapsed():.0f}s; {len(failed_rows)} failing timed rows"]
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    save(args.out, runner, table, dict(env=env, tuned=tuned))
    return 1 if failed_checks or failed_rows else 0


if __name__ == "__main__":
    sys.exit(main())
