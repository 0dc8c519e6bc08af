"""One benchmark run: frozen inputs → engine → scored records → report, resumable.

Resume: runs are keyed by a *config hash* (model, hardware, features, engine
and suite sections plus the frozen-input address). ``<cache_dir>/runs/<hash>.json``
points at the latest run directory of that config; when that run did not finish
every case, a new run copies its final records and runs only the rest. A run
that finished is never resumed: running the same config again measures again.
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
from redknot.bench.freeze import FreezeResult, freeze
from redknot.bench.measure import request_timings
from redknot.bench.records import (FINAL_STATUSES, RECORDS_FILE, RecordWriter, RequestRecord, finished_case_ids,
                                   read_records)
from redknot.bench.frozen_inputs import FrozenInputs
from redknot.bench.runner import CaseJob, CaseOutcome, Runner
from redknot.bench.scoring import score_prediction

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
    """The engine could not be built (wrong device, missing kernel package, bad checkpoint)."""


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
        if not path.is_file():
            return None
        run_dir = Path(json.loads(path.read_text())["run_dir"])
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

    # ------------------------------------------------------------------ setup

    def _resume(self, key: str, inputs: FrozenInputs) -> List[dict]:
        index = ResumeIndex(self.cache_dir)
        previous = index.previous(key)
        index.point(key, self.run_dir)
        if previous is None or previous.resolve() == self.run_dir.resolve():
            return read_records(self.run_dir / RECORDS_FILE)[0]
        records, _ = read_records(previous / RECORDS_FILE)
        done = finished_case_ids(records) & {c.case_id for c in inputs.cases}
        if len(done) >= len(inputs.cases):
            return []
        carried = [r for r in records if r.get("status") in FINAL_STATUSES and r.get("case_id") in done]
        with RecordWriter(self.run_dir / RECORDS_FILE) as writer:
            for record in carried:
                writer.write(RequestRecord(**record))
        self.console.print(f"resuming {previous}: {len(done)}/{len(inputs.cases)} cases already finished")
        return carried

    def _write_meta(self, key: str, frozen: FreezeResult) -> None:
        meta = {"config_hash": key, "inputs_address": frozen.inputs.address,
                "inputs_dir": str(frozen.inputs.directory), "suite": _plain(self.cfg.suite),
                "model": _plain(self.cfg.model), "git_sha": git_sha(), "started_unix": time.time()}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / RUN_META).write_text(json.dumps(meta, indent=2) + "\n")
        shutil.copyfile(frozen.inputs.directory / "manifest.json", self.run_dir / MANIFEST_COPY)

    # ------------------------------------------------------------------ records

    def _record(self, outcome: CaseOutcome, key: str, address: str, sha: str) -> RequestRecord:
        entry, out = outcome.entry, outcome.output
        timings = request_timings(getattr(out, "metrics", None))
        raw = out.text if out is not None else ""
        record = RequestRecord(
            case_id=entry.case_id, dataset=entry.dataset, row_id=entry.row_id, suite=self.cfg.suite.name,
            status=outcome.status, prompt_tokens=entry.num_tokens, max_new_tokens=entry.max_new_tokens,
            ids_sha256=entry.ids_sha256, inputs_address=address, config_hash=key, git_sha=sha,
            completion_tokens=len(out.token_ids) if out is not None else 0,
            finish_reason=getattr(out, "finish_reason", None), error=outcome.error, dp_rank=outcome.dp_rank,
            ttft_s=timings.ttft_s, e2e_s=timings.e2e_s, queue_s=timings.queue_s,
            prefill_tok_s=timings.prefill_tok_s, decode_tok_s=timings.decode_tok_s,
            draft_proposed=timings.draft_proposed, draft_accepted=timings.draft_accepted,
            accept_len=timings.accept_len, peak_memory_bytes=outcome.peak_memory_bytes, prediction_raw=raw,
            metric=entry.metric, finished_unix=time.time())
        metrics = getattr(out, "metrics", None)
        if metrics is not None and metrics.num_prompt_tokens:
            record.prompt_tokens = int(metrics.num_prompt_tokens)  # what the engine saw; validate compares
        if outcome.status == "ok":
            scored = score_prediction(raw, entry.answers, entry.metric, entry.first_line_only)
            record.prediction, record.score, record.scores = scored.prediction, scored.primary, scored.metrics
        return record

    # ------------------------------------------------------------------ run

    def execute(self) -> int:
        frozen = freeze(self.cfg.suite, self.cfg.model, self.cache_dir, console=self.console)
        inputs = frozen.inputs
        self.console.print(f"inputs {inputs.address}: {len(inputs.cases)} cases of {self.cfg.suite.context_tokens} "
                           f"tokens ({'reused' if frozen.reused else 'built'} in {frozen.seconds:.1f} s)")
        key = config_hash(self.cfg, inputs.address)
        self._write_meta(key, frozen)
        self.tracker.set_tags({"bench.config_hash": key, "bench.inputs_address": inputs.address})
        done = finished_case_ids(self._resume(key, inputs))
        jobs = [c for c in inputs.cases if c.case_id not in done]
        try:
            if jobs:
                self._run_jobs(inputs, jobs, key)
        finally:
            code = self._report(inputs, key)
        return code

    def _run_jobs(self, inputs: FrozenInputs, todo, key: str) -> None:
        try:
            engine = self.setup.make_engine(self.cfg)
        except Exception as err:  # the engine's own message names the cause; keep it whole
            raise EngineStartError(f"the engine did not start: {type(err).__name__}: {err}") from err
        runner = Runner(engine, self.setup.make_params(self.cfg), self.cfg.suite.admission_batch_size,
                        self.cfg.features.parallel.dp, self.cfg.suite.request_timeout_s)
        warm = [CaseJob(c, inputs.load_ids(c).tolist()) for c in inputs.cases[:self.cfg.suite.warmup_requests]]
        if warm:
            self.console.print(f"warm-up: {len(warm)} request(s), not recorded")
            runner.warmup(warm)
        jobs = [CaseJob(c, inputs.load_ids(c).tolist()) for c in todo]
        sha, address = git_sha(), inputs.address
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[last]}"))
        with RecordWriter(self.run_dir / RECORDS_FILE) as writer, \
                Progress(*columns, console=self.console) as progress:
            task = progress.add_task(f"suite {self.cfg.suite.name}", total=len(jobs), last="")
            count = [0]

            def on_outcome(outcome: CaseOutcome) -> None:
                record = self._record(outcome, key, address, sha)
                writer.write(record)
                count[0] += 1
                if record.ttft_s is not None:
                    self.tracker.log_metrics({"request.ttft_s": record.ttft_s}, step=count[0])
                last = f"{record.case_id} {record.status}" + (f" ttft {record.ttft_s:.3f}s" if record.ttft_s else "")
                progress.update(task, advance=1, last=last)

            runner.run(jobs, on_outcome)
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
                        "inputs_address": inputs.address, "config_hash": key})
        report.write_results(self.run_dir, results)
        report.write_summary_csv(self.run_dir, results)
        report.write_plots(self.run_dir, records, results)
        report.print_summary(self.console, results)
        self.tracker.log_metrics(tracked_metrics(results))
        self.tracker.set_tags({"bench.partial": str(results["partial"]).lower()})
        if not self.cfg.tracking.log_run_dir:
            self.tracker.log_artifacts(self.run_dir, "run_dir")
        return 0 if not results["partial"] else 1
