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


def write_plots(run_dir: Path, records: List[dict], results: dict) -> List[Path]:
    """``ttft_vs_context.png`` (one point per ok request) and ``score_per_dataset.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(run_dir) / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in results["datasets"]:
        points = [(r["prompt_tokens"], r["ttft_s"]) for r in records
                  if r["dataset"] == name and r["status"] == "ok" and r.get("ttft_s") is not None]
        if points:
            ax.scatter(*zip(*points), label=name, s=18, alpha=0.8)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s, engine clock)")
    ax.set_title(f"TTFT vs context — suite {results.get('suite', '')}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(out_dir / "ttft_vs_context.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    paths.append(out_dir / "score_per_dataset.png")
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


def print_summary(console: Console, results: dict) -> None:
    console.print(summary_table(results))
    peak = results["peak_memory_bytes"]
    rates = (f"prefill {_fmt(results['prefill_tok_s'], 1)} tok/s, decode {_fmt(results['decode_tok_s'], 1)} tok/s, "
             f"acceptance length {_fmt(results['accept_len'], 2)}, "
             f"peak memory {'-' if peak is None else f'{peak / 2 ** 30:.2f} GiB'}")
    console.print(rates)
    if results["partial"]:
        console.print(f"[yellow]partial: {results['completed']}/{results['total']} cases completed "
                      f"(statuses {results['status_counts']}); rerun the same command to resume[/yellow]")
