"""Time ``linear_mx``'s prefill candidates (``linear_prefill_mx.PREFILL_TUNER``) on the V4.1 cut's prefill linears.

    python benchmarks/linear_prefill_v41.py --out DIR               # on a GPU, about 60 s
    python benchmarks/linear_prefill_v41.py --smoke --out DIR       # CPU: Triton interpreter, toy sizes

Per weight shape of an 8192-row prefill chunk of the cut (``e2e_v41``: 5 layers' wq_a, wkv, wq_b, wo_b, shared
W1 / W3 / W2, 3 indexer wq_b, the Engram layer's wkv: 39 calls) and for each candidate (``dequant``: QDQ + the
weight decoded to bf16 + ``torch.mm``; ``fp8_rowwise``: rowwise operands + ``torch._scaled_mm``), the median ms,
TFLOP/s, the share of the FP8 (1451 TFLOP/s) and bf16 (796) peaks, and the norm-wise error against the reference
``linear_mx`` (fp32 on the decoded operands); the ``fp8_rowwise`` parts (activations, weight, GEMM) timed alone;
then the chunk's sum over its 39 calls per candidate and for the faster per shape, and what the tuner picks
through the registry op; then the attention's grouped ``wo_a`` (``GROUPED_TUNER``: einsum, bmm_out, mm_cols).
Results: ``DIR/linear_prefill_v41.md``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

FP8_PEAK, BF16_PEAK = 1451e12, 796e12
# (name, N, K, calls per 8192-row chunk of the cut)
SHAPES = (("wq_a", 1280, 5120, 5), ("wkv", 512, 5120, 5), ("wq_b", 32768, 1280, 5), ("wo_b", 5120, 8192, 5),
          ("shared w1/w3", 2304, 5120, 10), ("shared w2", 5120, 2304, 5), ("indexer wq_b", 4096, 1280, 3),
          ("engram wkv", 25600, 6144, 1))
SMOKE = (("toy a", 64, 256, 2), ("toy b", 96, 128, 1))


def _bench(fn, device) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=5, rep=30, return_mode="median"))


def _shape(name, n, k, calls, rows, device, g, lines, parts, total):
    """One weight shape: each candidate's row, the fp8_rowwise parts, the tuner's pick -> (best ms, pick)."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels import ref_v41
    from redknot.kernels.triton import linear_prefill_mx as lp
    from redknot.kernels.triton import ops_mx

    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * k ** -0.5, 32)
    ws = ws.view(torch.uint8)
    x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
    want = ref_v41.linear_mx(x, w, ws, 32)
    flops = 2.0 * rows * n * k

    def tflops(ms: float) -> float:
        return flops / (ms * 1e-3) if ms > 0 else float("nan")

    ms = {}
    for c in lp.PREFILL_TUNER.candidates:
        y = torch.empty(rows, n, dtype=torch.bfloat16, device=device)
        try:
            err = lp._rel(lp.linear_prefill(x, w, ws, 32, y, c), want)
            ms[c] = _bench(lambda c=c, y=y: lp.linear_prefill(x, w, ws, 32, y, c), device)
        except Exception as exc:   # noqa: BLE001  (a candidate this torch / GPU cannot run)
            lines.append(f"| {name} | {n} x {k} | {calls} | {c} | failed: {str(exc).splitlines()[0][:80]} | | | | |")
            continue
        tf = tflops(ms[c])
        total[c] += calls * ms[c]
        lines.append(f"| {name} | {n} x {k} | {calls} | {c} | {ms[c]:.4f} | {tf / 1e12:.0f} | "
                     f"{100 * tf / FP8_PEAK:.1f} | {100 * tf / BF16_PEAK:.1f} | {err:.2e} |")
    if "fp8_rowwise" in ms:
        aq, sa = lp.act_rowwise(x)
        bq, sb = lp.weight_rowwise(w, ws, 32)
        qa = _bench(lambda: lp.act_rowwise(x), device)
        qw = _bench(lambda: lp.weight_rowwise(w, ws, 32), device)
        mm = _bench(lambda: torch._scaled_mm(aq, bq.t(), scale_a=sa[:, None], scale_b=sb[None, :],
                                             out_dtype=torch.bfloat16, use_fast_accum=False), device)
        tf = tflops(mm)
        parts.append(f"| {name} | {qa:.4f} | {qw:.4f} | {mm:.4f} | {tf / 1e12:.0f} | {100 * tf / FP8_PEAK:.1f} |")
    y = ops_mx.linear_mx(x, w, ws)       # the registry op: the tuner's first use of the class
    key = ((n, k), 32, lp.row_class(rows))
    pick = (f"{name}: {lp.PREFILL_TUNER.choices.get(key, lp.PREFILL_TUNER.candidates[0])} "
            f"(gate error {lp._GATED.get(key, float('nan')):.2e}, op error {lp._rel(y, want):.2e})")
    return calls * min(ms.values()) if ms else 0.0, pick


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else outputs/linear_prefill_v41)")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    a = ap.parse_args(argv)
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from redknot.kernels.triton import linear_prefill_mx as lp

    device = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    rows = 160 if a.smoke else a.rows
    out = Path(a.out or os.environ.get("OUT") or "outputs/linear_prefill_v41")
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(0)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [f"# linear_mx prefill candidates, {rows} rows ({gpu})", "",
             "| linear | N x K | calls | candidate | ms | TFLOP/s | % FP8 peak | % bf16 peak | err vs ref |",
             "|---|---|---|---|---|---|---|---|---|"]
    parts, total = [], {c: 0.0 for c in lp.PREFILL_TUNER.candidates}
    best_total, picked = 0.0, []
    for name, n, k, calls in (SMOKE if a.smoke else SHAPES):
        best, pick = _shape(name, n, k, calls, rows, device, g, lines, parts, total)
        best_total += best
        picked.append(pick)
    g8, r, k = (2, 48, 96) if a.smoke else (8, 1024, 4096)     # the grouped wo_a: 8 groups of 1024 x 4096
    o3 = torch.randn(rows, g8, k, generator=g, device=device).to(torch.bfloat16)
    wo_a = (torch.randn(g8, r, k, generator=g, device=device) * k ** -0.5).to(torch.bfloat16)
    want = lp.grouped_wo_a(o3, wo_a, "einsum")
    grouped = []
    for c in lp.GROUPED_TUNER.candidates:
        got = lp.grouped_wo_a(o3, wo_a, c)
        ms = _bench(lambda c=c: lp.grouped_wo_a(o3, wo_a, c), device)
        tf = 2.0 * rows * g8 * r * k / (ms * 1e-3) if ms > 0 else float("nan")
        grouped.append(f"{c} {ms:.4f} ms ({tf / 1e12:.0f} TFLOP/s, {100 * tf / BF16_PEAK:.1f} % bf16 peak, "
                       f"max diff to einsum {float((got.float() - want.float()).abs().max()):.3g})")
    lp.grouped_wo_a(o3, wo_a)                # the tuner's first use
    chosen = lp.GROUPED_TUNER.choices.get(((g8, r, k), o3.dtype, lp.row_class(rows)), "einsum (untimed)")
    lines += ["", f"Grouped wo_a ({g8} x [{r}, {k}], 5 calls a chunk): " + "; ".join(grouped) + f"; tuner: {chosen}"]
    lines += ["", "fp8_rowwise parts (ms): activations, weight, the GEMM alone (TFLOP/s, % FP8 peak)", "",
              "| linear | act_rowwise | weight_rowwise | _scaled_mm | TFLOP/s | % FP8 peak |",
              "|---|---|---|---|---|---|", *parts, "",
              "Chunk (sum over the calls): " + ", ".join(f"{c} {v:.3f} ms" for c, v in total.items())
              + f", faster per shape {best_total:.3f} ms", "", "Tuner (registry op): " + "; ".join(picked)]
    text = "\n".join(lines) + "\n"
    (out / "linear_prefill_v41.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
