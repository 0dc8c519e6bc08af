"""The report of ``benchmarks/e2e_v41.py``: ``e2e_v41.json`` and ``e2e_v41.md`` under ``--out`` (the markdown
also printed)."""
from __future__ import annotations

import functools
import json
import os

from step_profile_v41 import format_views

print = functools.partial(print, flush=True)  # progress unbuffered


def write(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "e2e_v41.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = ["# DeepSeek-V4.1 real-dimension cut", "", f"device: {report['device']}; cut: {report['cut']}",
             f"ops: {report['ops']}", f"decode: {report['decode_mode']}", "", "## Parity (block by block)", "",
             ("| numerics | ok | routed | worst rel err | state bytes differing | top-k rows: equal / equal up to ties "
              "/ different of all (worst shortfall) | candidate-block rows: the same |"),
             "|---|---|---|---|---|---|---|"]
    for p in report["parity"]:
        worst = max((v for k, v in p["errors"].items() if k.endswith("rel")), default=0.0)
        lines.append(f"| {p['numerics']} | {p['ok']} | {', '.join(p['routed_ops'])} | {worst:.3g} | "
                     f"{p['state_bytes_differing']}/{p['state_bytes_compared']} | "
                     + " | ".join(f"{v['equal']} / {v['equal_up_to_ties']} / {v['different']} of {v['rows']} "
                                  f"({v['worst_shortfall_rel']:.2g})" for v in p["selections"].values()) + " |")
    for p in report["parity"]:
        lines += ["", f"{p['numerics']}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(p["errors"].items()))]
    lines += ["", "## Prefill", "", ("| context | s (projected from the previous context's chunk fit) | tok/s | "
                                      "% of floor | peak GiB (above weights) | global cache "
                                      "B/token (V4.1-Flash scaled) | chunk s: first / last | chunk fit a s + b s/token |"),
              "|---|---|---|---|---|---|---|---|"]
    for r in report["prefill"]:
        if "skipped" in r:
            lines.append(f"| {r['context']} | skipped: {r['skipped']} | | | | | | |")
            continue
        cb, cs, fit = r.get("cache_bytes", {}), r.get("chunk_seconds") or [[0, 0.0]], r.get("chunk_fit", {})
        flash = cb.get("v41_flash_bytes_per_token")
        flash = "n/a" if flash is None else f"{flash:.1f}"
        pj = "" if r.get("projected_s") is None else f" ({r['projected_s']:.2f})"
        lines.append(f"| {r['context']} | {r['seconds']:.3f}{pj} | {r['tokens_per_s']:.0f} | "
                     f"{100 * r['fraction_of_floor']:.1f} | {r['peak_gib']:.1f} "
                     f"({r.get('peak_above_weights_gib', 0.0):.1f}) | {r['global_cache_bytes_per_token']:.1f} "
                     f"({flash}) | {cs[0][1]:.3f} / {cs[-1][1]:.3f} | "
                     f"{fit.get('a_s', 0.0):.4f} + {fit.get('b_s_per_token', 0.0):.3g} |")
    lines += ["", ("expected global cache bytes/token for this cut: "
                   f"{report['expected_global_cache_bytes_per_token']:.1f} (V4.1-Flash: 890)"), "", "## Decode (eager)", "",
              "| context | batch | ms/step | floor ms | % of floor |", "|---|---|---|---|---|"]
    for r in report["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['context']} | {r['batch']} | skipped | | |")
            continue
        if r["ms_per_step"] is None:
            lines.append(f"| {r['context']} | {r['batch']} (synthetic state) | graph only | {r['floor_ms']:.3f} | |")
        else:
            lines.append(f"| {r['context']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['floor_ms']:.3f} | "
                         f"{100 * r['fraction_of_floor']:.1f} |")
        if "graph_ms_per_step" in r:
            lines.append(f"| {r['context']} | {r['batch']} (graph, rel err {r['graph_rel_err']:.1e}) | "
                         f"{r['graph_ms_per_step']:.2f} | {r['floor_ms']:.3f} | "
                         f"{100 * r['floor_ms'] / r['graph_ms_per_step']:.1f} |")
        elif "graph" in r:
            lines.append(f"| {r['context']} | {r['batch']} (graph) | {r['graph']} | | |")
    for r in report["decode"]:
        if r.get("step_views"):
            lines += format_views(r["step_views"], f"tensor step, decode b{r['batch']} at {r['context']}")
    for name, rows in report["op_shares"].items():
        lines += ["", f"## Registry ops: {name}", "", "| op | share | ms | calls |", "|---|---|---|---|"]
        lines += [f"| {r['op']} | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['calls']} |" for r in rows]
    for name, rows in report.get("region_groups", {}).items():
        lines += ["", f"## Regions (grouped): {name}", "", "| group | share | ms |", "|---|---|---|"]
        lines += [f"| {r['group']} | {100 * r['share']:.1f} % | {r['ms']:.3f} |" for r in rows]
    for name, rows in report.get("regions", {}).items():
        lines += ["", f"## Regions (self time): {name}", "", "| region | share | ms | calls |", "|---|---|---|---|"]
        lines += [f"| {r['region']} | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['calls']} |" for r in rows]
    for name, ab in report.get("prefill_rows_ab", {}).items():
        lines += ["", (f"{name}: {ab['unfused_ms']:.2f} ms without the prefill row fusions, {ab['fused_ms']:.2f} ms "
                       f"with them; saving of each (all on but that one, less all on): "
                       + ", ".join(f"{k} {v:.2f} ms" for k, v in ab["saving_ms"].items()))]
    for name, rows in report["profile"].items():
        lines += ["", f"## Time shares: {name}", "", "| kernel / op | share | ms | calls |", "|---|---|---|---|"]
        lines += [f"| `{r['op']}` | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['calls']}"
                  + (f" ({', '.join(f'{ms:.2f}' for ms in r['launch_ms'])} ms)" if r.get("launch_ms") else "") + " |"
                  for r in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "e2e_v41.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
