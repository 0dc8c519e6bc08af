"""The MLflow tracker: one MLflow run, written through ``MlflowClient`` with explicit run ids
(no global active-run state, so sweeps and threads cannot cross-write)."""
from __future__ import annotations

import json
import time
from typing import Any, Dict, Mapping, Optional

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from redknot.config.schema import TrackingConfig
from redknot.tracking.base import PathLike
from redknot.tracking.params import (MAX_METRICS_PER_BATCH, MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VALUE_LENGTH,
                                     batches, fit, flatten, to_text)
from redknot.tracking.backend_store import default_artifact_location, store_lock

PARENT_TAG = "mlflow.parentRunId"


def ensure_experiment(uri: str, name: str, artifact_location: Optional[str] = None) -> str:
    """Create the store (if new) and the experiment (if missing); return the experiment id."""
    location = default_artifact_location(uri, artifact_location)
    with store_lock(uri):
        client = MlflowClient(tracking_uri=uri)
        for attempt in range(5):
            experiment = client.get_experiment_by_name(name)
            if experiment is not None:
                return experiment.experiment_id
            try:
                return client.create_experiment(name, artifact_location=location)
            except MlflowException as err:
                # Another process (on a server store) created it between our two calls.
                if err.error_code != "RESOURCE_ALREADY_EXISTS" or attempt == 4:
                    raise
                time.sleep(0.1 * (attempt + 1))
    raise RuntimeError(f"could not create MLflow experiment {name!r} at {uri}")


class MlflowTracker:
    """Records one run in the MLflow store at ``uri`` (experiment ``tracking.experiment``).

    ``start()`` creates the run (a child of ``parent_run_id`` when given);
    ``finish(status)`` closes it. Params and tags are fitted to MLflow's limits by
    :mod:`redknot.tracking.params` (over-long values are replaced by a marker and
    logged in full as artifacts, never cut silently).
    """

    def __init__(self, tracking: TrackingConfig, uri: str, run_name: Optional[str] = None,
                 parent_run_id: Optional[str] = None):
        self.tracking = tracking
        self.uri = uri
        # The store must be created under ensure_experiment's lock: a client touches it on construction.
        self.experiment_id = ensure_experiment(uri, tracking.experiment, tracking.artifact_location)
        self.client = MlflowClient(tracking_uri=uri)
        self.run_name = run_name
        self.parent_run_id = parent_run_id
        self.run_id: Optional[str] = None
        self.exit_code = 0

    def start(self, tags: Optional[Mapping[str, Any]] = None) -> str:
        """Create the run; it carries this process's identity so that a later start can tell a run
        whose process died (SIGKILL) from one still running (:mod:`redknot.tracking.stale`)."""
        from redknot.tracking.stale import process_tags

        run = self.client.create_run(self.experiment_id, run_name=self.run_name)
        self.run_id = run.info.run_id
        tags = {**dict(tags or {}), **process_tags()}
        if self.parent_run_id:
            tags[PARENT_TAG] = self.parent_run_id
        self.set_tags(tags)
        return self.run_id

    def child(self, run_name: str, tags: Optional[Mapping[str, Any]] = None) -> "MlflowTracker":
        """A started child run of this one (``mode=compare``: one per arm)."""
        child = MlflowTracker(self.tracking, self.uri, run_name=run_name, parent_run_id=self.run_id)
        child.start(tags)
        return child

    def close_stale(self, run_id: str, reason: str) -> None:
        """Mark ``run_id`` KILLED if it is still RUNNING (a run whose process is gone), saying why."""
        run = self.client.get_run(run_id)
        if run.info.status == "RUNNING":
            self.client.set_tag(run_id, "redknot.stale", reason)
            self.client.set_terminated(run_id, "KILLED")

    def log_params(self, params: Mapping[str, Any]) -> None:
        fitted = fit(flatten(params))
        for batch in batches(fitted.params, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in batch.items()])
        for key, value in fitted.elided.items():
            self.log_text(value, f"params/{key}.txt")
        notes = {}
        if fitted.elided:
            notes["redknot.params_elided"] = json.dumps(sorted(fitted.elided))
        if fitted.renamed:
            notes["redknot.params_renamed"] = json.dumps(fitted.renamed)
        if notes:
            self.set_tags(notes)

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None,
                    timestamp_ms: Optional[int] = None) -> None:
        now = timestamp_ms or int(time.time() * 1000)
        for batch in batches(dict(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step or 0)
                                                        for k, v in batch.items()])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        fitted = fit({k: to_text(v) for k, v in tags.items()}, value_limit=MAX_TAG_VALUE_LENGTH,
                     artifact_dir="tags")
        for batch in batches(fitted.params, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in batch.items()])
        for key, value in fitted.elided.items():
            self.log_text(value, f"tags/{key}.txt")

    def log_artifact(self, path: PathLike, artifact_path: Optional[str] = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, directory: PathLike, artifact_path: Optional[str] = None) -> None:
        self.client.log_artifacts(self.run_id, str(directory), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status)

    def params(self) -> Dict[str, str]:
        """The params recorded so far (for reports and tests)."""
        return dict(self.client.get_run(self.run_id).data.params)
