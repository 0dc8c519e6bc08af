"""The run report: console summary table, ``results.json``, ``summary.csv`` and PNG plots.

Everything is written into the run directory; the caller mirrors it to MLflow
through the tracker (metrics from :func:`redknot.bench.aggregate.tracked_metrics`).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table

RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.csv"
PLOTS_DIR = "plots"
SUMMARY_COLUMNS = ("dataset", "metric", "score", "exact_match", "completed", "total", "partial",
                   "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_results(run_dir: Path, results: dict) -> Path:
    path = Path(run_dir) / RESULTS_FILE
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _summary_rows(results: dict) -> List[Dict[str, object]]:
    rows = []
    for name, block in results["datasets"].items():
        ttft = block["ttft_s"]
        rows.append({"dataset": name, "metric": block["metric"], "score": block["score"],
                     "exact_match": block.get("exact_match"), "completed": block["completed"],
                     "total": block["total"], "partial": block["partial"], "ttft_mean_s": ttft["mean"],
                     "ttft_p50_s": ttft["p50"], "ttft_p90_s": ttft["p90"], "ttft_p99_s": ttft["p99"]})
    ttft = results["ttft_s"]
    rows.append({"dataset": "overall", "metric": "mean of datasets", "score": results["overall_score"],
                 "exact_match": None, "completed": results["completed"], "total": results["total"],
                 "partial": results["partial"], "ttft_mean_s": ttft["mean"], "ttft_p50_s": ttft["p50"],
                 "ttft_p90_s": ttft["p90"], "ttft_p99_s": ttft["p99"]})
    return rows


def write_summary_csv(run_dir: Path, results: dict) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=SUMMARY_COLUMNS)
        writer.writeheader()
        for row in _summary_rows(results):
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return path


def _scatter_ttft_vs_context(ax, records: List[dict], results: dict) -> None:
    for name in results["datasets"]:
        points = [(r["prompt_tokens"], r["ttft_s"]) for r in records
                  if r["dataset"] == name and r["status"] == "ok" and r.get("ttft_s") is not None]
        if points:
            ax.scatter(*zip(*points), label=name, s=18, alpha=0.8)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s, engine clock)")
    ax.set_title(f"TTFT vs context — suite {results.get('suite', '')}")


def _ttft_per_case(ax, records: List[dict], results: dict) -> None:
    """One box (hot TTFT: every measured repetition) or bar per case, in run order."""
    ok = [r for r in records if r["status"] == "ok" and r.get("ttft_s") is not None]
    names = [r["case_id"] for r in ok]
    if any(r.get("ttft_repeats_s") for r in ok):
        ax.boxplot([r.get("ttft_repeats_s") or [r["ttft_s"]] for r in ok], showfliers=True)
        ax.set_xticks(range(1, len(names) + 1), names)
        kind = "hot TTFT per case (measured repetitions)"
    else:
        ax.bar(range(len(names)), [r["ttft_s"] for r in ok], color="#4477aa")
        ax.set_xticks(range(len(names)), names)
        kind = "TTFT per case"
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    ax.set_ylabel("TTFT (s, engine clock)")
    ax.set_title(f"{kind} — suite {results.get('suite', '')}")


def _score_bars(ax, results: dict) -> None:
    names = list(results["datasets"])
    scores = [results["datasets"][n]["score"] or 0.0 for n in names]
    bars = ax.bar(names, scores, color="#4477aa")
    for bar, name in zip(bars, names):
        block = results["datasets"][name]
        ax.annotate(f"{block['completed']}/{block['total']}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("score (0-100)")
    ax.set_ylim(0, 105)
    ax.set_title("score per dataset (label: completed/total)")
    ax.tick_params(axis="x", rotation=30)


def plots_with_information(records: List[dict], results: dict) -> Dict[str, str]:
    """``{plot file: why it is left out}`` for plots that would show nothing."""
    ok = [r for r in records if r["status"] == "ok" and r.get("ttft_s") is not None]
    skipped = {}
    if len({r["prompt_tokens"] for r in ok}) < 2:
        skipped["ttft_vs_context.png"] = "every prompt has the same length (see ttft_per_case.png)"
    if not ok:
        skipped["ttft_per_case.png"] = "no case finished with a TTFT"
    scores = [b["score"] for b in results["datasets"].values() if b["score"] is not None]
    if not any(scores):
        skipped["score_per_dataset.png"] = "every dataset score is 0 or missing"
    return skipped


def write_plots(run_dir: Path, records: List[dict], results: dict) -> List[Path]:
    """The plots that carry information (see :func:`plots_with_information`): ``ttft_vs_context.png``
    (prompts of several lengths), ``ttft_per_case.png`` and ``score_per_dataset.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(run_dir) / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    skipped = plots_with_information(records, results)
    drawers = {"ttft_vs_context.png": lambda ax: _scatter_ttft_vs_context(ax, records, results),
               "ttft_per_case.png": lambda ax: _ttft_per_case(ax, records, results),
               "score_per_dataset.png": lambda ax: _score_bars(ax, results)}
    paths = []
    for name, draw in drawers.items():
        if name in skipped:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        draw(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        paths.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def summary_table(results: dict) -> Table:
    partial = results["partial"]
    title = (f"suite {results.get('suite', '')}: {results['completed']}/{results['total']} cases"
             + (" — PARTIAL" if partial else ""))
    table = Table(title=title)
    for column in ("dataset", "metric", "score", "EM", "done", "TTFT mean s", "p50", "p90", "p99"):
        table.add_column(column, justify="left" if column in ("dataset", "metric") else "right")
    for row in _summary_rows(results):
        table.add_row(row["dataset"], row["metric"], _fmt(row["score"], 2), _fmt(row["exact_match"], 2),
                      f"{row['completed']}/{row['total']}", _fmt(row["ttft_mean_s"]), _fmt(row["ttft_p50_s"]),
                      _fmt(row["ttft_p90_s"]), _fmt(row["ttft_p99_s"]))
    return table


def peak_host_memory_bytes() -> Optional[int]:
    """This process's peak resident memory (Linux reports kilobytes), or None where unknown."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _gib(value: Optional[int]) -> str:
    return f"{value / 2 ** 30:.2f} GiB" if value >= 2 ** 30 else f"{value / 2 ** 20:.1f} MiB"


def rates_line(results: dict) -> str:
    accept = (_fmt(results["accept_len"], 2) if results.get("accept_len") is not None
              else "n/a (nothing drafted)" if not results.get("draft_proposed") else "-")
    peak = results.get("peak_memory_bytes")
    device = _gib(peak) if peak else "n/a (the device keeps no counter, e.g. CPU)"
    host = results.get("peak_host_memory_bytes")
    return (f"prefill {_fmt(results['prefill_tok_s'], 1)} tok/s, decode {_fmt(results['decode_tok_s'], 1)} tok/s, "
            f"acceptance length {accept}, peak device memory {device}"
            + (f", peak host memory {_gib(host)} (process RSS)" if host else ""))


def hot_table(records: List[dict], results: dict) -> Optional[Table]:
    """Per-case hot TTFT (p50/p95 of the measured repetitions), or None when the run was not hot."""
    rows = [r for r in records if r.get("ttft_repeats_s")]
    if not rows:
        return None
    hot = results.get("ttft_hot_s") or {}
    table = Table(title=f"hot TTFT per case (s, engine clock): suite p50 {_fmt(hot.get('p50'))}, "
                        f"p95 {_fmt(hot.get('p95'))} over {hot.get('count', 0)} measurements")
    for column in ("case", "role", "measured", "p50", "p95", "min", "max"):
        table.add_column(column, justify="left" if column in ("case", "role") else "right")
    for r in rows:
        values = r["ttft_repeats_s"]
        table.add_row(r["case_id"], r.get("role", "short"), str(len(values)), _fmt(r.get("ttft_s")),
                      _fmt(r.get("ttft_p95_s")), _fmt(min(values)), _fmt(max(values)))
    return table


def presentation_table(results: dict) -> Optional[Table]:
    cases = results.get("presentation") or []
    if not cases:
        return None
    table = Table(title="presentation cases (long answers; not in the accuracy aggregate)")
    for column in ("case", "status", "TTFT s", "output", "reference"):
        table.add_column(column, overflow="fold")
    for case in cases:
        table.add_row(case["case_id"], case["status"], _fmt(case.get("ttft_s")), case.get("prediction") or "",
                      " | ".join(case["answers"]))
    return table


def print_summary(console: Console, results: dict, notes: Optional[List[str]] = None,
                  records: Optional[List[dict]] = None) -> None:
    console.print(summary_table(results))
    console.print(rates_line(results))
    for table in (hot_table(records or [], results), presentation_table(results)):
        if table is not None:
            console.print(table)
    for note in notes or []:
        console.print(f"note: {note}", style="yellow", markup=False)
    if not results.get("engine_started", True):
        console.print("[red]the engine did not start, so no case ran (see the error below)[/red]")
    elif results["partial"]:
        console.print(f"[yellow]partial: {results['completed']}/{results['total']} cases completed "
                      f"(statuses {results['status_counts']}); rerun the same command to resume[/yellow]")
