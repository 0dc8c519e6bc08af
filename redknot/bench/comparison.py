"""The paired comparison's numbers and pages: per-case pairs, the quality gate, ``comparison.md``."""
from __future__ import annotations

from typing import List, Optional, Sequence

from rich.console import Console
from rich.table import Table

from redknot.bench.records import latest_by_case
from redknot.bench.suite import CaseEntry


def _side(record: Optional[dict]) -> dict:
    record = record or {}
    return {"status": record.get("status", "not run"), "ttft_s": record.get("ttft_s"),
            "ttft_p95_s": record.get("ttft_p95_s"), "ttft_repeats_s": record.get("ttft_repeats_s") or [],
            "score": record.get("score"), "prediction": record.get("prediction_raw"),
            "completion_tokens": record.get("completion_tokens"), "error": record.get("error")}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def pair_rows(cases: Sequence[CaseEntry], baseline: List[dict], candidate: List[dict]) -> List[dict]:
    """One row per case, in run order: both sides, the TTFT speed-up (baseline / candidate) and whether
    the outputs are identical."""
    base, cand = latest_by_case(baseline), latest_by_case(candidate)
    rows = []
    for case in cases:
        b, c = _side(base.get(case.case_id)), _side(cand.get(case.case_id))
        rows.append({"case_id": case.case_id, "dataset": case.dataset, "role": case.role,
                     "question": case.question, "answers": list(case.answers), "baseline": b, "candidate": c,
                     "speedup": _ratio(b["ttft_s"], c["ttft_s"]),
                     "same_output": b["prediction"] is not None and b["prediction"] == c["prediction"]})
    return rows


def _suite_ttft(results: dict) -> Optional[float]:
    hot = results.get("ttft_hot_s") or {}
    return hot.get("p50") if hot.get("count") else results["ttft_s"]["p50"]


def gate(baseline: dict, candidate: dict, max_drop: float) -> dict:
    """The quality gate: the candidate's short-answer accuracy may be at most ``max_drop`` points lower."""
    rule = f"candidate accuracy >= baseline accuracy - {max_drop:g} points (short-answer cases)"
    a, b = baseline.get("overall_score"), candidate.get("overall_score")
    verdict = {"rule": rule, "max_accuracy_drop": max_drop, "baseline_accuracy": a, "candidate_accuracy": b,
               "speedup_p50": _ratio(_suite_ttft(baseline), _suite_ttft(candidate))}
    if a is None or b is None:
        return {**verdict, "passed": False, "accuracy_delta": None,
                "reason": "an arm has no accuracy (no short-answer case finished)"}
    delta = round(b - a, 2)
    passed = delta >= -max_drop - 1e-9
    reason = (f"accuracy delta {delta:+.2f} points" + ("" if passed else f" is below -{max_drop:g}"))
    return {**verdict, "passed": passed, "accuracy_delta": delta, "reason": reason}


def _fmt(value: Optional[float], pattern: str = "{:.3f}") -> str:
    return "-" if value is None else pattern.format(value)


def comparison_markdown(summary: dict) -> str:
    base, cand = summary["arms"]["baseline"], summary["arms"]["candidate"]
    verdict = summary["gate"]
    lines = [f"# Paired comparison on suite {summary['suite']}", "",
             f"- baseline `{base['name']}`: {' '.join(base['overrides']) or '(the run config)'}",
             f"- candidate `{cand['name']}`: {' '.join(cand['overrides']) or '(the run config)'}",
             f"- same frozen inputs `{summary['inputs_address']}`, interleaved {summary['interleave']}"
             + (f"; release manifest `{summary['release_manifest']}`" if summary.get("release_manifest") else ""),
             f"- accuracy (short-answer cases): {_fmt(verdict['baseline_accuracy'], '{:.2f}')} → "
             f"{_fmt(verdict['candidate_accuracy'], '{:.2f}')} "
             f"(delta {_fmt(verdict.get('accuracy_delta'), '{:+.2f}')})",
             f"- TTFT p50 speed-up (baseline / candidate): {_fmt(verdict.get('speedup_p50'), '{:.3f}x')}",
             f"- quality gate: **{'PASSED' if verdict['passed'] else 'FAILED'}** — {verdict['rule']}; "
             f"{verdict['reason']}",
             f"- complete: {summary['complete']}", "", "## Per case", "",
             "| case | role | TTFT baseline s (p50/p95) | TTFT candidate s (p50/p95) | speed-up | score b/c "
             "| same output |",
             "|---|---|---|---|---|---|---|"]
    for row in summary["cases"]:
        b, c = row["baseline"], row["candidate"]
        lines.append(f"| {row['case_id']} | {row['role']} | {_fmt(b['ttft_s'])} / {_fmt(b['ttft_p95_s'])} | "
                     f"{_fmt(c['ttft_s'])} / {_fmt(c['ttft_p95_s'])} | {_fmt(row['speedup'], '{:.3f}x')} | "
                     f"{_fmt(b['score'], '{:.2f}')} / {_fmt(c['score'], '{:.2f}')} | "
                     f"{'yes' if row['same_output'] else 'no'} |")
    lines += ["", "## Outputs side by side", ""]
    for row in summary["cases"]:
        lines += [f"### {row['case_id']} ({row['role']})", "", f"Question: {row['question']}", "",
                  f"Reference: {' | '.join(row['answers'])}", "", "| baseline | candidate |", "|---|---|",
                  f"| {_cell(row['baseline'])} | {_cell(row['candidate'])} |", ""]
    return "\n".join(lines)


def _cell(side: dict) -> str:
    text = side["prediction"] if side["prediction"] is not None else f"({side['status']}: {side.get('error')})"
    return text.replace("|", "\\|").replace("\n", "<br>") or "(empty)"


def print_comparison(console: Console, summary: dict) -> None:
    base, cand = summary["arms"]["baseline"], summary["arms"]["candidate"]
    table = Table(title=f"{base['name']} vs {cand['name']} on suite {summary['suite']} (TTFT p50 s, engine clock)")
    for column in ("case", "role", base["name"], cand["name"], "speed-up", "score b/c", "same output"):
        table.add_column(column, justify="left" if column in ("case", "role") else "right")
    for row in summary["cases"]:
        b, c = row["baseline"], row["candidate"]
        table.add_row(row["case_id"], row["role"], _fmt(b["ttft_s"]), _fmt(c["ttft_s"]),
                      _fmt(row["speedup"], "{:.3f}x"), f"{_fmt(b['score'], '{:.2f}')} / {_fmt(c['score'], '{:.2f}')}",
                      "yes" if row["same_output"] else "no")
    console.print(table)
    verdict = summary["gate"]
    style = "green" if verdict["passed"] else "red"
    console.print(f"accuracy {_fmt(verdict['baseline_accuracy'], '{:.2f}')} -> "
                  f"{_fmt(verdict['candidate_accuracy'], '{:.2f}')}; TTFT p50 speed-up "
                  f"{_fmt(verdict.get('speedup_p50'), '{:.3f}x')}; quality gate "
                  f"{'PASSED' if verdict['passed'] else 'FAILED'} ({verdict['reason']})", style=style, markup=False)
    if not summary["complete"]:
        console.print("not every case finished on both arms (see each arm's records.jsonl)", style="yellow")
