"""Aggregates computed from records and the manifest: scores per dataset, latency statistics, coverage.

Scores are averaged over ``ok`` records only; ``completed``/``total`` say how
many of the manifest's cases that is, and ``partial`` is true whenever a case
has no ``ok`` record (not run yet, or failed). The overall score is the mean of
the dataset scores, as LongBench reports it. Presentation (long-answer) cases
count for coverage but never for a score: they are listed under
``presentation``. Hot TTFT (``suite.measured_repeats``): ``ttft_hot_s`` pools
every measured repetition of every case (p50/p95).
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np

from redknot.bench.records import latest_by_case
from redknot.bench.scoring import dataset_score
from redknot.bench.suite import CaseEntry

LATENCY_PERCENTILES = (50, 90, 95, 99)


def latency_stats(values: Sequence[float]) -> Dict[str, Optional[float]]:
    """mean and p50/p90/p99 (linear interpolation), None when there are no values."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in LATENCY_PERCENTILES}, "count": 0}
    array = np.asarray(values, dtype=np.float64)
    out = {"mean": float(array.mean())}
    out.update({f"p{p}": float(np.percentile(array, p)) for p in LATENCY_PERCENTILES})
    out["count"] = len(values)
    return out


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None


def _dataset_block(name: str, cases: List[CaseEntry], latest: Dict[str, dict]) -> dict:
    records = [latest[c.case_id] for c in cases if c.case_id in latest]
    ok = [r for r in records if r["status"] == "ok"]
    metric = cases[0].metric
    block = {
        "metric": metric,
        "score": dataset_score([r["score"] for r in ok]) if ok else None,
        "completed": len(ok),
        "total": len(cases),
        "partial": len(ok) < len(cases),
        "status_counts": dict(Counter(r["status"] for r in records)),
        "ttft_s": latency_stats([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
    }
    if metric == "qa_f1":
        block["exact_match"] = dataset_score([r["scores"].get("exact_match", 0.0) for r in ok]) if ok else None
    return block


def _presentation(cases: Sequence[CaseEntry], latest: Dict[str, dict]) -> List[dict]:
    out = []
    for case in cases:
        record = latest.get(case.case_id, {})
        out.append({"case_id": case.case_id, "dataset": case.dataset, "question": case.question,
                    "answers": list(case.answers), "status": record.get("status", "not run"),
                    "prediction": record.get("prediction_raw"), "completion_tokens": record.get("completion_tokens"),
                    "ttft_s": record.get("ttft_s"), "ttft_p95_s": record.get("ttft_p95_s"),
                    "reference_score": record.get("score")})
    return out


def aggregate(records: Iterable[dict], cases: Sequence[CaseEntry]) -> dict:
    """The results of a run (see the module docstring); records of cases not in ``cases`` are ignored."""
    wanted = {c.case_id for c in cases}
    latest = {cid: r for cid, r in latest_by_case(records).items() if cid in wanted}
    by_dataset: Dict[str, List[CaseEntry]] = {}
    for case in cases:
        if getattr(case, "role", "short") != "presentation":
            by_dataset.setdefault(case.dataset, []).append(case)
    datasets = {name: _dataset_block(name, group, latest) for name, group in by_dataset.items()}
    ok = [r for r in latest.values() if r["status"] == "ok"]
    scored = [d["score"] for d in datasets.values() if d["score"] is not None]
    proposed = sum(r.get("draft_proposed", 0) for r in ok)
    accepted = sum(r.get("draft_accepted", 0) for r in ok)
    peaks = [r["peak_memory_bytes"] for r in latest.values() if r.get("peak_memory_bytes") is not None]
    repeats = [t for r in ok for t in r.get("ttft_repeats_s") or ()]
    return {
        "total": len(cases),
        "completed": len(ok),
        "recorded": len(latest),
        "coverage": len(ok) / len(cases) if cases else 0.0,
        "partial": len(ok) < len(cases),
        "status_counts": dict(Counter(r["status"] for r in latest.values())),
        "overall_score": round(float(np.mean(scored)), 2) if scored else None,
        "datasets": datasets,
        "ttft_s": latency_stats([r["ttft_s"] for r in ok if r.get("ttft_s") is not None]),
        "e2e_s": latency_stats([r["e2e_s"] for r in ok if r.get("e2e_s") is not None]),
        "prefill_tok_s": _mean(r.get("prefill_tok_s") for r in ok),
        "decode_tok_s": _mean(r.get("decode_tok_s") for r in ok),
        "accept_len": _mean(r.get("accept_len") for r in ok),
        "draft_acceptance_rate": accepted / proposed if proposed else None,
        "peak_memory_bytes": max(peaks) if peaks else None,
        "draft_proposed": proposed,
        "ttft_hot_s": latency_stats(repeats),
        "presentation": _presentation([c for c in cases if getattr(c, "role", "short") == "presentation"], latest),
    }


def tracked_metrics(results: dict) -> Dict[str, float]:
    """The aggregates as flat MLflow metrics (only the values that exist)."""
    out: Dict[str, Optional[float]] = {
        "coverage": results["coverage"], "completed": results["completed"], "total": results["total"],
        "partial": float(results["partial"]), "score.overall": results["overall_score"],
        "prefill_tok_s.mean": results["prefill_tok_s"], "decode_tok_s.mean": results["decode_tok_s"],
        "accept_len.mean": results["accept_len"], "draft_acceptance_rate": results["draft_acceptance_rate"],
        "peak_memory_bytes": results["peak_memory_bytes"],
    }
    for stat in ("mean", "p50", "p90", "p95", "p99"):
        out[f"ttft_s.{stat}"] = results["ttft_s"][stat]
        out[f"e2e_s.{stat}"] = results["e2e_s"][stat]
    hot = results.get("ttft_hot_s") or {}
    if hot.get("count"):
        out["ttft_hot_s.p50"], out["ttft_hot_s.p95"] = hot["p50"], hot["p95"]
    for name, block in results["datasets"].items():
        out[f"score.{name}"] = block["score"]
        out[f"completed.{name}"] = block["completed"]
        if "exact_match" in block:
            out[f"exact_match.{name}"] = block["exact_match"]
        out[f"ttft_s.mean.{name}"] = block["ttft_s"]["mean"]
    return {k: float(v) for k, v in out.items() if v is not None}
