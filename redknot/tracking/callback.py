"""Hydra callback: one MLflow parent run per sweep, each job's run its child.

Registered in ``conf/config.yaml`` under ``hydra.callbacks``. It runs in the
process that launches the sweep: before any job starts it creates the store and
the parent run, and writes the parent's id into the sweep directory, where every
job (in this process, or on a Slurm node or Ray worker sharing the filesystem)
finds it. At the end it records how many jobs ran and failed — a job refused
before it could open a run (an invalid config) counts, from the exit code each
job leaves in ``<sweep dir>/jobs/`` — and closes the parent: FINISHED when every
job succeeded, else FAILED.

Interrupted sweeps: every sweep is registered under ``<output.cache_dir>/sweeps/``
by its command (config name, overrides, sweeper parameters). Running the same
command again after an interruption marks the old parent KILLED, links the new
parent to it (``sweep.resumes_run_id``) and tells the jobs, through
``sweep_resume.json`` in the sweep directory, to report finished jobs from their
records instead of measuring them again.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from redknot.config.sweep_files import SWEEP_RESUME_FILE, job_exits
from redknot.tracking.run import PARENT_FILE

log = logging.getLogger(__name__)

def sweep_key(config: DictConfig) -> str:
    """The identity of a sweep command: config name, task overrides and sweeper parameters."""
    blob = {"config": str(config.hydra.job.config_name), "overrides": list(config.hydra.overrides.task),
            "sweeper": _sweeper_params(config)}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:20]


class SweepRegistry:
    """``<cache_dir>/sweeps/<key>.json``: the latest sweep of a command and whether it completed."""

    def __init__(self, cache_dir: Path):
        self.root = Path(cache_dir) / "sweeps"

    def previous(self, key: str) -> Optional[dict]:
        try:
            return json.loads((self.root / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None

    def record(self, key: str, info: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / f"{key}.json").write_text(json.dumps(info, indent=1) + "\n")


class MlflowSweepCallback(Callback):
    """Creates and closes the parent run of a Hydra multirun."""

    def __init__(self) -> None:
        self.tracker: Optional[Any] = None
        self.key: Optional[str] = None
        self.registry: Optional[SweepRegistry] = None
        self.resumes: Optional[dict] = None

    def _register(self, config: DictConfig, sweep_dir: Path) -> None:
        self.key = sweep_key(config)
        self.registry = SweepRegistry(Path(str(OmegaConf.select(config, "output.cache_dir", default="outputs/cache"))))
        previous = self.registry.previous(self.key)
        if previous and not previous.get("completed") and Path(previous.get("sweep_dir", "")).is_dir() \
                and Path(previous["sweep_dir"]) != sweep_dir:
            self.resumes = previous
            sweep_dir.mkdir(parents=True, exist_ok=True)
            (sweep_dir / SWEEP_RESUME_FILE).write_text(json.dumps(previous, indent=1))
            log.info("this sweep resumes the interrupted sweep in %s: finished jobs are reported, not re-measured",
                     previous["sweep_dir"])
        self.registry.record(self.key, {"sweep_dir": str(sweep_dir), "completed": False, "parent_run_id": None})

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        self._register(config, sweep_dir)
        if not OmegaConf.select(config, "tracking.enabled", default=False):
            return
        from redknot.config.schema import TrackingConfig
        from redknot.tracking.facts import all_facts
        from redknot.tracking.mlflow_tracker import MlflowTracker
        from redknot.tracking.backend_store import (TrackingUnavailable, check_uri, describe_failure,
                                                    http_settings, tracking_uri)

        tracking = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrackingConfig), config.tracking))
        uri = tracking_uri(tracking.uri, str(config.output.root))
        choices = OmegaConf.to_container(config.hydra.runtime.choices)
        name = tracking.run_name or f"sweep-{choices.get('sweep') or sweep_dir.name}"
        check_uri(uri)
        try:
            with http_settings(tracking):
                self.tracker = MlflowTracker(tracking, uri, run_name=name)
                self._start(config, sweep_dir, choices, all_facts)
        except Exception as err:
            raise TrackingUnavailable(describe_failure(uri, err)) from None
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_FILE).write_text(json.dumps({"run_id": self.tracker.run_id, "uri": uri}))
        self.registry.record(self.key, {"sweep_dir": str(sweep_dir), "completed": False,
                                        "parent_run_id": self.tracker.run_id})
        log.info("MLflow parent run %s at %s", self.tracker.run_id, uri)

    def _start(self, config: DictConfig, sweep_dir: Path, choices: dict, all_facts) -> None:
        self.tracker.start({
            **all_facts(), "mlflow.source.name": "redknot", "sweep": "true", "sweep_dir": str(sweep_dir),
            "hydra.overrides": " ".join(config.hydra.overrides.task),
            "hydra.sweeper.params": json.dumps(_sweeper_params(config)),
            **{f"hydra.choice.{g}": str(o) for g, o in choices.items() if not g.startswith("hydra/")},
        })
        old = (self.resumes or {}).get("parent_run_id")
        if old:
            self.tracker.set_tags({"sweep.resumes_run_id": old, "sweep.resumes_dir": self.resumes["sweep_dir"]})
            self.tracker.close_stale(old, f"its sweep was interrupted; resumed by sweep run {self.tracker.run_id}")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        exits = job_exits(sweep_dir)
        if self.registry is not None and self.key is not None:
            self.registry.record(self.key, {"sweep_dir": str(sweep_dir), "completed": True,
                                            "parent_run_id": getattr(self.tracker, "run_id", None)})
        if self.tracker is None:
            return
        from redknot.config.schema import TrackingConfig
        from redknot.tracking.backend_store import http_settings

        tracking = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrackingConfig), config.tracking))
        try:
            with http_settings(tracking):
                self._close(config, exits)
        except Exception as err:  # the jobs' results are on disk; the parent stays for the next start to close
            log.error("could not close the MLflow parent run %s: %s", self.tracker.run_id, err)
        self.tracker = None

    def _close(self, config: DictConfig, exits: Dict[int, int]) -> None:
        children = self.tracker.client.search_runs(
            [self.tracker.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{self.tracker.run_id}'",
            max_results=50000)
        statuses = [run.info.status for run in children]
        failed_runs = sum(s != "FINISHED" for s in statuses)
        failed_jobs = sum(code != 0 for code in exits.values())
        jobs = max(len(exits), len(statuses))
        self.tracker.set_tags({"sweep.children": len(statuses), "sweep.jobs": jobs,
                               "sweep.children_failed": max(failed_runs, failed_jobs),
                               "sweep.jobs_without_run": max(len(exits) - len(statuses), 0)})
        multirun_yaml = Path(config.hydra.sweep.dir) / "multirun.yaml"
        if multirun_yaml.is_file():
            self.tracker.log_artifact(multirun_yaml, "config")
        ok = jobs > 0 and failed_runs == 0 and failed_jobs == 0
        self.tracker.finish("FINISHED" if ok else "FAILED")


def _sweeper_params(config: DictConfig) -> dict:
    params = OmegaConf.select(config, "hydra.sweeper.params")
    return OmegaConf.to_container(params) if params is not None else {}
