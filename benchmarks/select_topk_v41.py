#!/usr/bin/env python3
"""Time the indexer's top-k selection: ``select_topk`` (a top-k over packed 64-bit tie keys, then a sort of
the ids) against ``radix_topk`` (radix select, ids compacted in entry order), exactly equal results.

    PYTHONUNBUFFERED=1 python benchmarks/select_topk_v41.py --out DIR     # on an H200, about 1-2 minutes
    python benchmarks/select_topk_v41.py --quick --out DIR                # the default configuration only, < 1 minute
    python benchmarks/select_topk_v41.py --smoke --out DIR                # CPU: Triton interpreter, toy sizes
    python benchmarks/select_topk_v41.py --b1 --out DIR                   # the b1 decode step's selections, < 1 min

Rows of n fp32 scores (bf16-rounded, so exact ties occur as in the reference numerics; the last fifth
-inf: entries a row cannot see), k = 512, T rows. Each call is captured in a CUDA graph and replayed
(median of repetitions, CUDA events); every radix launch configuration listed is checked for exact
equality with ``select_topk`` before it is timed. Also the candidate source's block selection, 2048 blocks of 8 over a
ratio-1 row: ``candidate_entries`` (PyTorch around ``select_topk``) against ``radix_candidates``.
Results: ``DIR/select_topk_v41.md`` and ``.json``.

``--b1``: only the four selections of the batch-1 decode step of ``benchmarks/e2e_v41.py`` at context 8192
(``--b1-n``: the entries its block tables address at ratio 1, 8448; ratio 2 has half): the ratio-2 top-512,
the ratio-1 candidate blocks (2048 of 8) and top-512, the top-512 inside the candidate blocks, each under
every launch configuration the tuner chooses among (``radix_select.CANDIDATES``: the 8-bit histogram default
and the counting forms), checked equal to the PyTorch reference first. The line to read: ``b1 step sum``,
the four selections' graph-replay ms under the default and under the fastest configuration of each
(what the tuner then runs). Results: ``DIR/select_topk_b1.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_kernels_v41 import _time_ms  # noqa: E402  (graph-replay timing, one copy)

SIZES = [(4096, 1), (4096, 32), (4096, 128), (8192, 1), (65536, 1), (65536, 32), (65536, 128),
         (262144, 1), (262144, 32), (262144, 128), (524288, 1)]
SMOKE_SIZES = [(300, 2), (700, 2)]


def _configs(smoke: bool):
    from redknot.kernels.triton.radix_select import DEFAULT_CONFIG, RadixSelectConfig

    if smoke:
        return [DEFAULT_CONFIG, RadixSelectConfig(256, 256, 1)]
    return [DEFAULT_CONFIG, RadixSelectConfig(16384, 4096, 16), RadixSelectConfig(4096, 2048, 16),
            RadixSelectConfig(8192, 4096, 8), RadixSelectConfig(8192, 4096, 32), RadixSelectConfig(step_bits=1),
            RadixSelectConfig(step_bits=2), RadixSelectConfig(16384, 4096, 16, step_bits=1)]


def case(n: int, t: int, k: int, device, reps: int, configs) -> dict:
    import torch

    from redknot.kernels.triton.radix_select import radix_topk
    from redknot.kernels.triton.step_indexer_mx import select_topk

    g = torch.Generator(device=device).manual_seed(n + t)
    sc = (torch.randn(t, n, generator=g, device=device) * 0.1).to(torch.bfloat16).float()
    sc[:, n - n // 5:] = float("-inf")
    want = select_topk(sc, k)
    row = {"n": n, "rows": t, "k": k, "select_topk_ms": _time_ms(lambda: select_topk(sc, k), device, reps)}
    for c in configs:
        tag = _tag(c)
        try:
            got = radix_topk(sc, k, config=c)
            row[f"{tag}_equal"] = bool(torch.equal(got, want))
            row[f"{tag}_ms"] = _time_ms(lambda: radix_topk(sc, k, config=c), device, reps)
        except Exception as exc:   # a launch shape this toolchain does not build: reported, the rest still timed
            row[f"{tag}_equal"] = False
            row[f"{tag}_ms"] = float("nan")
            row[f"{tag}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def candidate_case(n: int, t: int, device, reps: int, blocks: int, size: int) -> dict:
    """The candidate blocks: ``candidate_entries`` (pad, block max, pin, select_topk, expand) against
    ``radix_candidates`` (the same entry lists, plus the block map, in one or two launches)."""
    import torch

    from redknot.kernels.triton.radix_select import radix_candidates
    from redknot.kernels.triton.step_indexer_mx import candidate_entries

    g = torch.Generator(device=device).manual_seed(7 * n + t)
    sc = (torch.randn(t, n, generator=g, device=device) * 0.1).to(torch.bfloat16).float()
    vis = torch.full((t,), n - n // 5, device=device)
    sc[:, n - n // 5:] = float("-inf")
    want = candidate_entries(sc, vis, blocks, size)
    got = radix_candidates(sc, vis, blocks, size)[0]
    return {"n": n, "rows": t, "blocks": blocks, "block": size, "equal": bool(torch.equal(got, want)),
            "select_topk_ms": _time_ms(lambda: candidate_entries(sc, vis, blocks, size), device, reps),
            "radix_ms": _time_ms(lambda: radix_candidates(sc, vis, blocks, size), device, reps)}


def _tag(c) -> str:
    return f"radix_r{c.resident_max}_b{c.block}_p{c.per_thread}" + (f"_s{c.step_bits}" if c.step_bits else "")


def b1_cases(n: int, device, reps: int) -> list:
    """The b1 decode step's selections at ``n`` addressed entries (ratio 1; ratio 2: n / 2), every tuner
    candidate timed (graph replays) after an equality check against the PyTorch reference."""
    import torch

    from redknot.kernels.triton.radix_select import (
        CANDIDATES,
        radix_candidates,
        radix_topk,
    )
    from redknot.kernels.triton.step_select import candidates_reference, topk_reference

    g = torch.Generator(device=device).manual_seed(n)

    def scores(m: int, visible: int):
        sc = (torch.randn(1, m, generator=g, device=device) * 0.1).to(torch.bfloat16).float()
        sc[:, visible:] = float("-inf")
        return sc

    vis1 = n - 256 if n > 512 else n
    s2, s1, s4 = scores(n // 2, vis1 // 2), scores(n, vis1), scores(n, vis1)
    vis = torch.tensor([vis1], device=device)
    cand = candidates_reference(s1, vis, 2048, 8)[1]
    k = 512 if n > 512 else 8
    sel = (("topk ratio 2", lambda c: radix_topk(s2, k, config=c), lambda: topk_reference(s2, k)),
           ("candidates 2048 x 8", lambda c: radix_candidates(s1, vis, 2048, 8, config=c),
            lambda: candidates_reference(s1, vis, 2048, 8)),
           ("topk ratio 1", lambda c: radix_topk(s1, k, config=c), lambda: topk_reference(s1, k)),
           ("topk in candidate blocks", lambda c: radix_topk(s4, k, block_mask=cand, mask_block=8, config=c),
            lambda: topk_reference(s4, k, block_mask=cand, mask_block=8)))
    rows = []
    for name, fn, ref in sel:
        want = ref()
        row = {"selection": name, "n": s2.shape[1] if "ratio 2" in name else n}
        for c in CANDIDATES:
            got = fn(c)
            equal = all(torch.equal(a, b) for a, b in zip(got if isinstance(got, tuple) else (got,),
                                                           want if isinstance(want, tuple) else (want,)))
            row[f"{_tag(c)}_equal"] = bool(equal)
            row[f"{_tag(c)}_ms"] = _time_ms(lambda c=c, fn=fn: fn(c), device, reps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _b1_table(rows, n: int, device) -> str:
    from redknot.kernels.triton.radix_select import CANDIDATES

    tags = [_tag(c) for c in CANDIDATES]
    lines = [f"# b1 decode step selections, {n} entries at ratio 1 ({device})", "",
             "| selection | n | " + " | ".join(f"{t} ms (equal)" for t in tags) + " |",
             "|---|---|" + "---|" * len(tags)]
    for r in rows:
        lines.append(f"| {r['selection']} | {r['n']} | "
                     + " | ".join(f"{r[f'{t}_ms']:.4f} ({'yes' if r[f'{t}_equal'] else 'NO'})" for t in tags) + " |")
    base = sum(r[f"{tags[0]}_ms"] for r in rows)
    best = sum(min(r[f"{t}_ms"] for t in tags if r[f"{t}_equal"]) for r in rows)
    lines += ["", (f"b1 step sum: default {base:.4f} ms, fastest per selection {best:.4f} ms "
                   f"({base / best:.2f}x)")]
    return "\n".join(lines) + "\n"


def _table(rows, cands, configs) -> str:
    tags = [_tag(c) for c in configs]
    lines = [f"# Top-k selection (k = {rows[0]['k'] if rows else 0}): select_topk vs radix_topk", "",
             "| n | rows | select_topk ms | " + " | ".join(f"{t} ms (equal)" for t in tags) + " | best speed-up |",
             "|---|---|---|" + "---|" * len(tags) + "---|"]
    for r in rows:
        best = min((r[f"{t}_ms"] for t in tags if r[f"{t}_ms"] == r[f"{t}_ms"]), default=float("nan"))
        cells = " | ".join(f"{r[f'{t}_ms']:.4f} ({'yes' if r[f'{t}_equal'] else 'NO'})" for t in tags)
        lines.append(f"| {r['n']} | {r['rows']} | {r['select_topk_ms']:.4f} | {cells} | "
                     f"{r['select_topk_ms'] / best:.1f}x |")
    lines += ["", "## Candidate blocks (candidate_entries)", "",
              "| n | rows | blocks x size | equal | candidate_entries ms | radix_candidates ms |", "|---|---|---|---|---|---|"]
    for c in cands:
        lines.append(f"| {c['n']} | {c['rows']} | {c['blocks']} x {c['block']} | {'yes' if c['equal'] else 'NO'} | "
                     f"{c['select_topk_ms']:.4f} | {c['radix_ms']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else outputs/select_topk_v41)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="the default launch configuration only (fewer compiles)")
    ap.add_argument("--b1", action="store_true", help="only the b1 decode step's selections, every tuner candidate")
    ap.add_argument("--b1-n", type=int, default=8448, help="entries addressed at ratio 1 (e2e_v41 at context 8192)")
    args = ap.parse_args()
    import os

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from redknot.kernels.triton.step_select import SELECT_ERRORS

    out = Path(args.out or os.environ.get("OUT") or ROOT / "outputs" / "select_topk_v41")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.b1:
        n = 60 if args.smoke else args.b1_n
        rows = b1_cases(n, device, args.reps)
        text = _b1_table(rows, n, torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
        (out / "select_topk_b1.md").write_text(text)
        (out / "select_topk_b1.json").write_text(json.dumps({"device": str(device), "rows": rows}, indent=1))
        print(text)
        return 0 if all(v for r in rows for key, v in r.items() if key.endswith("_equal")) else 1
    configs = _configs(args.smoke)[:1 if args.quick else None]
    k = 8 if args.smoke else 512
    rows = []
    for n, t in (SMOKE_SIZES if args.smoke else SIZES):
        rows.append(case(n, t, k, device, args.reps, configs))
        print(json.dumps(rows[-1]), flush=True)
    cand_sizes = [(60, 2)] if args.smoke else [(8192, 1), (8192, 128), (131072, 1), (131072, 32), (1 << 20, 1)]
    cands = []
    for n, t in cand_sizes:
        cands.append(candidate_case(n, t, device, args.reps, 3 if args.smoke else 2048, 4 if args.smoke else 8))
        print(json.dumps(cands[-1]), flush=True)
    text = _table(rows, cands, configs)
    if SELECT_ERRORS:
        text += f"\nSELECT_ERRORS: {SELECT_ERRORS}\n"
    (out / "select_topk_v41.md").write_text(text)
    (out / "select_topk_v41.json").write_text(json.dumps({"device": str(device), "rows": rows,
                                                          "candidates": cands, "errors": SELECT_ERRORS}, indent=1))
    print(text)
    ok = all(all(v for key, v in r.items() if key.endswith("_equal")) for r in rows) and all(c["equal"] for c in cands)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
