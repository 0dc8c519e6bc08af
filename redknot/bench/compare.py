"""``mode=compare``: a baseline and a candidate config on the same frozen inputs, interleaved per case.

Both arms get the suite's frozen inputs (checked before any engine starts, a release suite
against ``RELEASE_SUITES.json``). With ``compare.interleave=per_case`` both engines are loaded
and each case runs on both arms before the next case (which arm goes first alternates, so
neither always runs on a machine the other just warmed); with ``per_arm`` one engine at a time
runs every case. Each case runs as in ``mode=run`` (hot TTFT repetitions when the suite asks).

Results: ``<run dir>/<arm>/records.jsonl`` and ``results.json`` per arm, ``summary.json``
(machine-readable: per-case TTFT of each arm, speed-up, scores, outputs; the accuracy delta
and the quality gate) and ``comparison.md`` (the same for people, with the complete outputs
side by side). MLflow: this run is the parent, each arm a child run tagged with the pair.
The quality gate fails the comparison (exit 1) when the candidate's short-answer accuracy is
more than ``compare.max_accuracy_drop`` points below the baseline's; every file is written
either way.
"""
from __future__ import annotations

import gc
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from rich.console import Console

from redknot.bench import report
from redknot.bench.aggregate import aggregate, tracked_metrics
from redknot.bench.benchmark import EngineStartError, RunSetup, config_hash, git_sha
from redknot.bench.cases import CaseExecutor, RecordContext, build_record
from redknot.bench.notes import run_notes
from redknot.bench.comparison import comparison_markdown, gate, pair_rows, print_comparison
from redknot.bench.preflight import Prepared, prepare_run
from redknot.bench.records import RECORDS_FILE, RecordWriter, read_records
from redknot.bench.runner import CaseJob, Runner
from redknot.config.schema import CompareInterleave

SUMMARY_FILE = "summary.json"
COMPARISON_FILE = "comparison.md"


@dataclass
class Arm:
    """One side of the comparison: its config, directory, child run and (while loaded) engine."""
    name: str
    role: str  # "baseline" | "candidate"
    cfg: Any
    run_dir: Path
    key: str = ""
    tracker: Any = None
    engine: Any = None
    executor: Optional[CaseExecutor] = None
    writer: Optional[RecordWriter] = None
    records: List[dict] = field(default_factory=list)
    results: Dict[str, Any] = field(default_factory=dict)


class Comparison:
    """The body of ``mode=compare`` (see the module docstring)."""

    def __init__(self, ctx, tracker, setup: RunSetup, console: Optional[Console] = None):
        self.ctx, self.cfg, self.tracker, self.setup = ctx, ctx.cfg, tracker, setup
        self.console = console or Console()
        self.run_dir = Path(ctx.run_dir)
        names = list(ctx.arms)
        if len(names) != 2:
            raise ValueError("mode=compare needs the two arm configs the resolver builds (ctx.arms)")
        self.arms = [Arm(names[0], "baseline", ctx.arms[names[0]], self.run_dir / names[0]),
                     Arm(names[1], "candidate", ctx.arms[names[1]], self.run_dir / names[1])]

    # ------------------------------------------------------------------ engines

    def _start(self, arm: Arm) -> None:
        try:
            arm.engine = self.setup.make_engine(arm.cfg)
        except Exception as err:  # the engine's own message names the cause
            raise EngineStartError(f"the {arm.name} engine did not start: {type(err).__name__}: {err}") from err
        suite = self.cfg.suite
        params = self.setup.make_params(arm.cfg)
        arm.executor = CaseExecutor(arm.engine, params, suite, suite.request_timeout_s)
        warm = self._prepared.jobs[:suite.warmup_requests]
        if warm:
            Runner(arm.engine, params, 1, 1, suite.request_timeout_s).warmup(warm)

    def _stop(self, arm: Arm) -> None:
        close = getattr(arm.engine, "close", None)
        if close is not None:
            close()
        arm.engine = arm.executor = None
        gc.collect()

    # ------------------------------------------------------------------ run

    def _open_arms(self, prepared: Prepared) -> None:
        peer = {self.arms[0].name: self.arms[1].name, self.arms[1].name: self.arms[0].name}
        for arm in self.arms:
            arm.run_dir.mkdir(parents=True, exist_ok=True)
            arm.key = config_hash(arm.cfg, prepared.inputs.address)
            arm.tracker = self.tracker.child(f"{self.ctx.cfg.tracking.run_name or 'compare'}-{arm.name}", {
                "compare.arm": arm.name, "compare.role": arm.role, "compare.peer": peer[arm.name],
                "compare.parent_run_id": getattr(self.tracker, "run_id", None) or "",
                "compare.overrides": " ".join(getattr(self.cfg.compare, arm.role)),
                "bench.config_hash": arm.key, "bench.inputs_address": prepared.inputs.address})
            from redknot.tracking.run import config_params

            arm.tracker.log_params(config_params(arm.cfg))
            arm.writer = RecordWriter(arm.run_dir / RECORDS_FILE)

    def _run_case(self, arm: Arm, job: CaseJob, context: RecordContext) -> None:
        outcome, ttfts = arm.executor.run(job)
        record = build_record(outcome, context, ttfts)
        arm.writer.write(record)
        if record.ttft_s is not None:
            arm.tracker.log_metrics({"request.ttft_s": record.ttft_s})

    def _contexts(self, prepared: Prepared) -> Dict[str, RecordContext]:
        sha = git_sha()
        return {arm.name: RecordContext(self.cfg.suite.name, arm.key, prepared.inputs.address, sha, arm.name)
                for arm in self.arms}

    def _run(self, prepared: Prepared) -> None:
        contexts = self._contexts(prepared)
        jobs = prepared.jobs
        if self.cfg.compare.interleave == CompareInterleave.per_arm:
            for arm in self.arms:
                self._start(arm)
                for i, job in enumerate(jobs, start=1):
                    self._run_case(arm, job, contexts[arm.name])
                    self.console.print(f"{arm.name}: {job.entry.case_id} ({i}/{len(jobs)})", markup=False)
                self._stop(arm)
            return
        for arm in self.arms:
            self._start(arm)
        for i, job in enumerate(jobs):
            order = self.arms if i % 2 == 0 else list(reversed(self.arms))
            for arm in order:
                self._run_case(arm, job, contexts[arm.name])
            self.console.print(f"case {job.entry.case_id} ({i + 1}/{len(jobs)}): "
                               f"{' then '.join(a.name for a in order)}", markup=False)
        for arm in self.arms:
            self._stop(arm)

    def execute(self) -> int:
        self._prepared = prepared = prepare_run(self.cfg, self.console)
        self._open_arms(prepared)
        self.tracker.set_tags({"compare.baseline": self.arms[0].name, "compare.candidate": self.arms[1].name,
                               "compare.baseline_run_id": getattr(self.arms[0].tracker, "run_id", None) or "",
                               "compare.candidate_run_id": getattr(self.arms[1].tracker, "run_id", None) or "",
                               "bench.inputs_address": prepared.inputs.address})
        started = False
        try:
            self._run(prepared)
            started = True
        finally:
            for arm in self.arms:
                if arm.writer is not None:
                    arm.writer.close()
            code = self._report(prepared, started)
        return code

    # ------------------------------------------------------------------ report

    def _arm_results(self, arm: Arm, prepared: Prepared) -> None:
        arm.records, _ = read_records(arm.run_dir / RECORDS_FILE)
        arm.results = aggregate(arm.records, prepared.inputs.cases)
        arm.results.update({"suite": self.cfg.suite.name, "arm": arm.name, "role": arm.role,
                            "config_hash": arm.key, "inputs_address": prepared.inputs.address,
                            "overrides": list(getattr(self.cfg.compare, arm.role))})
        report.write_results(arm.run_dir, arm.results)
        report.write_summary_csv(arm.run_dir, arm.results)
        arm.tracker.log_metrics(tracked_metrics(arm.results))

    def _report(self, prepared: Prepared, started: bool) -> int:
        for arm in self.arms:
            self._arm_results(arm, prepared)
        base, cand = self.arms
        rows = pair_rows(prepared.inputs.cases, base.records, cand.records)
        verdict = gate(base.results, cand.results, self.cfg.compare.max_accuracy_drop)
        complete = not base.results["partial"] and not cand.results["partial"]
        summary = {
            "suite": self.cfg.suite.name, "inputs_address": prepared.inputs.address,
            "release_manifest": str(prepared.release_manifest) if prepared.release_manifest else None,
            "interleave": self.cfg.compare.interleave.value, "complete": complete, "engines_started": started,
            "gate": verdict, "cases": rows,
            "arms": {arm.role: {"name": arm.name, "overrides": list(getattr(self.cfg.compare, arm.role)),
                                "dir": str(arm.run_dir), "config_hash": arm.key,
                                "mlflow_run_id": getattr(arm.tracker, "run_id", None),
                                "accuracy": arm.results["overall_score"], "completed": arm.results["completed"],
                                "total": arm.results["total"], "ttft_s": arm.results["ttft_s"],
                                "ttft_hot_s": arm.results["ttft_hot_s"]} for arm in self.arms},
        }
        (self.run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        (self.run_dir / COMPARISON_FILE).write_text(comparison_markdown(summary), encoding="utf-8")
        print_comparison(self.console, summary)
        for note in run_notes(self.ctx, base.results)[:2]:  # what the numbers mean (weights, device)
            self.console.print(f"note: {note}", style="yellow", markup=False)
        self._track(summary)
        for arm in self.arms:
            ok = complete and arm.results["completed"] == arm.results["total"]
            arm.tracker.set_tags({"redknot.exit_code": 0 if ok else 1})
            arm.tracker.finish("FINISHED" if ok else "FAILED")
        return 0 if complete and verdict["passed"] else 1

    def _track(self, summary: dict) -> None:
        verdict = summary["gate"]
        metrics = {"compare.accuracy_delta": verdict.get("accuracy_delta"),
                   "compare.speedup_p50": verdict.get("speedup_p50"),
                   "compare.gate_passed": float(verdict["passed"])}
        self.tracker.log_metrics({k: float(v) for k, v in metrics.items() if v is not None})
        self.tracker.set_tags({"compare.gate": "passed" if verdict["passed"] else "failed",
                               "compare.gate_rule": verdict["rule"]})
        self.tracker.log_artifact(self.run_dir / SUMMARY_FILE, "compare")
        self.tracker.log_artifact(self.run_dir / COMPARISON_FILE, "compare")
