"""Hydra callback: one MLflow parent run per sweep, each job's run its child.

Registered in ``conf/config.yaml`` under ``hydra.callbacks``. It runs in the
process that launches the sweep: before any job starts it creates the store and
the parent run, and writes the parent's id into the sweep directory, where every
job (in this process, or on a Slurm node or Ray worker sharing the filesystem)
finds it. At the end it records how many children ran and closes the parent:
FINISHED when every child finished, else FAILED.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from redknot.tracking.run import PARENT_FILE

log = logging.getLogger(__name__)


class MlflowSweepCallback(Callback):
    """Creates and closes the parent run of a Hydra multirun."""

    def __init__(self) -> None:
        self.tracker: Optional[Any] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not OmegaConf.select(config, "tracking.enabled", default=False):
            return
        from redknot.config.schema import TrackingConfig
        from redknot.tracking.facts import all_facts
        from redknot.tracking.mlflow_tracker import MlflowTracker
        from redknot.tracking.backend_store import tracking_uri

        tracking = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrackingConfig), config.tracking))
        uri = tracking_uri(tracking.uri, str(config.output.root))
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        choices = OmegaConf.to_container(config.hydra.runtime.choices)
        name = tracking.run_name or f"sweep-{choices.get('sweep') or sweep_dir.name}"
        self.tracker = MlflowTracker(tracking, uri, run_name=name)
        self.tracker.start({
            **all_facts(), "mlflow.source.name": "redknot", "sweep": "true", "sweep_dir": str(sweep_dir),
            "hydra.overrides": " ".join(config.hydra.overrides.task),
            "hydra.sweeper.params": json.dumps(_sweeper_params(config)),
            **{f"hydra.choice.{g}": str(o) for g, o in choices.items() if not g.startswith("hydra/")},
        })
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / PARENT_FILE).write_text(json.dumps({"run_id": self.tracker.run_id, "uri": uri}))
        log.info("MLflow parent run %s at %s", self.tracker.run_id, uri)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.tracker is None:
            return
        children = self.tracker.client.search_runs(
            [self.tracker.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{self.tracker.run_id}'",
            max_results=50000)
        statuses = [run.info.status for run in children]
        self.tracker.set_tags({"sweep.children": len(statuses),
                               "sweep.children_failed": sum(s != "FINISHED" for s in statuses)})
        multirun_yaml = Path(config.hydra.sweep.dir) / "multirun.yaml"
        if multirun_yaml.is_file():
            self.tracker.log_artifact(multirun_yaml, "config")
        ok = bool(statuses) and all(s == "FINISHED" for s in statuses)
        self.tracker.finish("FINISHED" if ok else "FAILED")
        self.tracker = None


def _sweeper_params(config: DictConfig) -> dict:
    params = OmegaConf.select(config, "hydra.sweeper.params")
    return OmegaConf.to_container(params) if params is not None else {}
