"""One benchmark run: frozen inputs → engine → scored records → report, resumable.

Resume: runs are keyed by a *config hash* (model, hardware, features, engine
and suite sections plus the frozen-input address). ``<cache_dir>/runs/<hash>.json``
points at the latest run directory of that config; when that run did not finish
every case, a new run copies its final records and runs only the rest, and its
MLflow run is linked to the one it resumes (``bench.resumed_from_run_id``). A run
that finished is not resumed: running the same config again measures again,
except inside a sweep that resumes an interrupted one, where a finished job is
reported from its records without starting an engine.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from redknot.bench import report
from redknot.bench.aggregate import aggregate, tracked_metrics
from redknot.bench.notes import run_notes
from redknot.bench.cases import CaseExecutor, RecordContext, build_record, is_hot
from redknot.bench.preflight import Prepared, prepare_run
from redknot.bench.records import (FINAL_STATUSES, RECORDS_FILE, RecordWriter, RequestRecord, finished_case_ids,
                                   read_records)
from redknot.bench.frozen_inputs import FrozenInputs
from redknot.bench.runner import CaseJob, CaseOutcome, Runner
from redknot.bench.scoring import score_prediction
from redknot.config.sweep_files import SWEEP_RESUME_FILE

RUN_META = "bench_run.json"
MANIFEST_COPY = "inputs_manifest.json"


def _plain(obj: Any) -> Any:
    # Config enums are str enums: JSON writes their values; anything else non-JSON as its str().
    return json.loads(json.dumps(asdict(obj), default=str))


def config_hash(cfg, inputs_address: str) -> str:
    """sha256 over everything that changes results (paths of caches excluded)."""
    engine = _plain(cfg.engine)
    engine.pop("cache_dir", None)
    blob = {"model": _plain(cfg.model), "hardware": _plain(cfg.hardware), "features": _plain(cfg.features),
            "engine": engine, "suite": _plain(cfg.suite), "seed": cfg.seed, "inputs": inputs_address}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:20]


def git_sha() -> str:
    from redknot.tracking.facts import git_facts

    facts = git_facts()
    return facts["git.sha"] + ("+dirty" if facts.get("git.dirty") == "true" else "")


class EngineStartError(RuntimeError):
    """The engine could not be built (wrong device, missing kernel package, bad checkpoint); no case ran."""


@dataclass
class RunSetup:
    """What a benchmark run needs besides the config: how to build the engine and its sampling params."""
    make_engine: Callable[[Any], Any]
    make_params: Callable[[Any], Callable[[int], Any]]


class ResumeIndex:
    """``<cache_dir>/runs/<config hash>.json`` → the latest run directory of that config."""

    def __init__(self, cache_dir: Path):
        self.root = Path(cache_dir) / "runs"

    def previous(self, key: str) -> Optional[Path]:
        path = self.root / f"{key}.json"
        try:
            run_dir = Path(json.loads(path.read_text())["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no pointer, or a damaged one: nothing to resume
        return run_dir if (run_dir / RECORDS_FILE).is_file() else None

    def point(self, key: str, run_dir: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / f"{key}.json").write_text(json.dumps({"run_dir": str(run_dir)}) + "\n")


class BenchmarkRun:
    """The body of ``mode=run`` (see the module docstring)."""

    def __init__(self, ctx, tracker, setup: RunSetup, console: Optional[Console] = None):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.tracker = tracker
        self.setup = setup
        self.console = console or Console()
        self.run_dir = Path(ctx.run_dir)
        self.cache_dir = Path(self.cfg.output.cache_dir)
        self.engine_started = False
        self.resumed_from: Optional[dict] = None

    # ------------------------------------------------------------------ setup

    def _reuse_finished(self) -> bool:
        """Inside a sweep that resumes an interrupted one, a finished job is reported, not measured again."""
        sweep_dir = getattr(self.ctx, "sweep_dir", None)
        return sweep_dir is not None and (Path(sweep_dir) / SWEEP_RESUME_FILE).is_file()

    def _resume(self, key: str, inputs: FrozenInputs) -> List[dict]:
        index = ResumeIndex(self.cache_dir)
        previous = index.previous(key)
        index.point(key, self.run_dir)
        if previous is None or previous.resolve() == self.run_dir.resolve():
            return read_records(self.run_dir / RECORDS_FILE)[0]
        records, _ = read_records(previous / RECORDS_FILE)
        done = finished_case_ids(records) & {c.case_id for c in inputs.cases}
        if len(done) >= len(inputs.cases) and not self._reuse_finished():
            return []
        carried = [r for r in records if r.get("status") in FINAL_STATUSES and r.get("case_id") in done]
        with RecordWriter(self.run_dir / RECORDS_FILE) as writer:
            for record in carried:
                writer.write(RequestRecord(**record))
        self.resumed_from = _previous_meta(previous)
        self.console.print(f"resuming {previous}: {len(done)}/{len(inputs.cases)} cases already finished")
        return carried

    def _link_resumed(self) -> None:
        previous = self.resumed_from or {}
        tags = {"bench.resumed_from_dir": previous.get("run_dir")}
        run_id = previous.get("mlflow_run_id")
        if run_id:
            tags["bench.resumed_from_run_id"] = run_id
            mark = getattr(self.tracker, "close_stale", None)
            if mark is not None:
                mark(run_id, f"resumed by run {self.tracker.run_id} in {self.run_dir}")
        self.tracker.set_tags({k: v for k, v in tags.items() if v})

    def _write_meta(self, key: str, prepared: Prepared) -> None:
        inputs = prepared.inputs
        meta = {"config_hash": key, "inputs_address": inputs.address, "inputs_dir": str(inputs.directory),
                "suite": _plain(self.cfg.suite), "model": _plain(self.cfg.model), "git_sha": git_sha(),
                "started_unix": time.time(), "run_dir": str(self.run_dir),
                "mlflow_run_id": getattr(self.tracker, "run_id", None),
                "release_manifest": str(prepared.release_manifest) if prepared.release_manifest else None}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / RUN_META).write_text(json.dumps(meta, indent=2) + "\n")
        shutil.copyfile(inputs.directory / "manifest.json", self.run_dir / MANIFEST_COPY)

    # ------------------------------------------------------------------ run

    def execute(self) -> int:
        prepared = prepare_run(self.cfg, self.console)  # inputs checked and read before any engine starts
        inputs = prepared.inputs
        key = config_hash(self.cfg, inputs.address)
        self._write_meta(key, prepared)
        self.tracker.set_tags({"bench.config_hash": key, "bench.inputs_address": inputs.address})
        done = finished_case_ids(self._resume(key, inputs))
        if self.resumed_from is not None:
            self._link_resumed()
        jobs = [job for job in prepared.jobs if job.entry.case_id not in done]
        try:
            if jobs:
                self._run_jobs(prepared, jobs, key)
        finally:
            code = self._report(inputs, key)
        return code

    def _start_engine(self):
        try:
            engine = self.setup.make_engine(self.cfg)
        except Exception as err:  # the engine's own message names the cause; keep it whole
            raise EngineStartError(f"the engine did not start: {type(err).__name__}: {err}") from err
        self.engine_started = True
        return engine

    def _run_jobs(self, prepared: Prepared, todo: List[CaseJob], key: str) -> None:
        engine = self._start_engine()
        suite = self.cfg.suite
        params = self.setup.make_params(self.cfg)
        runner = Runner(engine, params, suite.admission_batch_size, self.cfg.features.parallel.dp,
                        suite.request_timeout_s)
        warm = prepared.jobs[:suite.warmup_requests]
        if warm:
            self.console.print(f"warm-up: {len(warm)} request(s), not recorded")
            runner.warmup(warm)
        context = RecordContext(suite.name, key, prepared.inputs.address, git_sha())
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[last]}"))
        with RecordWriter(self.run_dir / RECORDS_FILE) as writer, \
                Progress(*columns, console=self.console) as progress:
            task = progress.add_task(f"suite {suite.name}", total=len(todo), last="")
            count = [0]

            def on_outcome(outcome: CaseOutcome, ttfts: Optional[List[float]] = None) -> None:
                record = build_record(outcome, context, ttfts)
                writer.write(record)
                count[0] += 1
                if record.ttft_s is not None:
                    self.tracker.log_metrics({"request.ttft_s": record.ttft_s}, step=count[0])
                last = f"{record.case_id} {record.status}" + (f" ttft {record.ttft_s:.3f}s" if record.ttft_s else "")
                progress.update(task, advance=1, last=last)

            if is_hot(suite):
                executor = CaseExecutor(engine, params, suite, suite.request_timeout_s)
                for job in todo:
                    on_outcome(*executor.run(job))
            else:
                runner.run(todo, on_outcome)
        self._log_engine_counters(engine)

    def _log_engine_counters(self, engine) -> None:
        """Speculative-decoding counters (acceptance per position, draft/verify step times) and the CUDA-graph
        state (``engine.cuda_graphs`` tag: on with its batch sizes, or off and why), warm-up included."""
        stats = engine.stats()
        spec = getattr(stats, "spec", None)
        if spec is not None:
            self.tracker.log_metrics(spec.as_metrics())
        graphs = getattr(stats, "cuda_graphs", None)
        if graphs is not None:
            self.tracker.set_tags({"engine.cuda_graphs": graphs})
            self.tracker.log_metrics({"engine.cuda_graph_steps": float(stats.num_cuda_graph_steps)})

    def _report(self, inputs: FrozenInputs, key: str) -> int:
        records, problems = read_records(self.run_dir / RECORDS_FILE)
        for problem in problems:
            self.console.print(f"[red]{problem}[/red]")
        results = aggregate(records, inputs.cases)
        results.update({"suite": self.cfg.suite.name, "context_tokens": self.cfg.suite.context_tokens,
                        "inputs_address": inputs.address, "config_hash": key,
                        "engine_started": self.engine_started or bool(records),
                        "suite_changes": dict(getattr(self.ctx, "suite_changes", {}) or {}),
                        "peak_host_memory_bytes": report.peak_host_memory_bytes()})
        report.write_results(self.run_dir, results)
        report.write_summary_csv(self.run_dir, results)
        report.write_plots(self.run_dir, records, results)
        report.print_summary(self.console, results, run_notes(self.ctx, results, records), records)
        self.tracker.log_metrics(tracked_metrics(results))
        self.tracker.set_tags({"bench.partial": str(results["partial"]).lower()})
        if not self.cfg.tracking.log_run_dir:
            self.tracker.log_artifacts(self.run_dir, "run_dir")
        return 0 if not results["partial"] else 1


def _previous_meta(run_dir: Path) -> dict:
    try:
        meta = json.loads((run_dir / RUN_META).read_text())
    except (OSError, ValueError):
        meta = {}
    meta.setdefault("run_dir", str(run_dir))
    return meta
