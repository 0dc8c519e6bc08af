"""Opening and closing the tracked run around a mode body (used by ``python -m redknot``)."""
from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from omegaconf import OmegaConf

from redknot.tracking.base import NullTracker
from redknot.tracking.backend_store import (TrackingUnavailable, check_uri, describe_failure, http_settings,
                                            tracking_uri)
from redknot.tracking.resilient import BACKLOG_FILE, ResilientTracker
from redknot.tracking.stale import close_stale_runs

log = logging.getLogger(__name__)

PARENT_FILE = "mlflow_parent_run.json"   # written by the sweep callback into the sweep directory
PARENT_ENV = "REDKNOT_MLFLOW_PARENT_RUN_ID"


def run_name(ctx) -> str:
    cfg = ctx.cfg
    if cfg.tracking.run_name:
        return cfg.tracking.run_name
    name = f"{cfg.mode.value}-{cfg.model.name}-{cfg.suite.name}-{cfg.hardware.name}"
    return name if ctx.job_num is None else f"{name}-job{ctx.job_num}"


def parent_run_id(ctx, uri: str) -> Optional[str]:
    """The sweep's parent run, when this run is one job of a tracked multirun on the same store."""
    if ctx.sweep_dir is not None:
        marker = Path(ctx.sweep_dir) / PARENT_FILE
        if marker.is_file():
            info = json.loads(marker.read_text())
            if info.get("uri") == uri:
                return info["run_id"]
            log.warning("sweep parent run is in %s, this job tracks to %s: not linking", info.get("uri"), uri)
            return None
    return os.environ.get(PARENT_ENV) or None


def run_tags(ctx, facts: Dict[str, str]) -> Dict[str, Any]:
    tags: Dict[str, Any] = dict(facts)
    tags["hydra.overrides"] = " ".join(ctx.overrides)
    tags["mlflow.source.name"] = "redknot"
    tags["run_dir"] = str(ctx.run_dir)
    tags["mode"] = ctx.cfg.mode.value
    for group, option in ctx.choices.items():
        tags[f"hydra.choice.{group}"] = option
    for var, overrides in ctx.legacy_translation.items():
        tags[f"legacy_env.{var}"] = overrides
    if ctx.job_num is not None:
        tags["hydra.job.num"] = str(ctx.job_num)
    return tags


def config_params(cfg) -> Dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)


def start_tracker(ctx, uri: str):
    """Build and start the run's MLflow tracker; any failure is :class:`TrackingUnavailable` (in seconds:
    MLflow's HTTP timeout and retries come from ``tracking``)."""
    from redknot.config.instantiate import build
    from redknot.tracking.facts import all_facts

    settings = ctx.cfg.tracking
    check_uri(uri)
    try:
        tracker = build(settings, "tracking", uri=uri, run_name=run_name(ctx), parent_run_id=parent_run_id(ctx, uri))
        tracker.start(run_tags(ctx, all_facts()))
    except TrackingUnavailable:
        raise
    except Exception as err:  # unreachable server, unwritable or corrupt store, bad URI
        raise TrackingUnavailable(describe_failure(uri, err)) from err
    client = getattr(tracker, "client", None)
    if client is not None:
        try:
            closed = close_stale_runs(client, tracker.experiment_id, tracker.run_id)
        except Exception as err:  # best effort: never a reason not to run
            log.warning("could not look for stale runs in %s: %s", uri, err)
            closed = []
        for run_id in closed:
            log.warning("run %s was left RUNNING by a process that no longer exists: marked KILLED", run_id)
    return tracker


@contextmanager
def open_tracker(ctx) -> Iterator[Any]:
    """Yield the run's tracker. Params (the flattened resolved config), tags (code,
    host, device, versions, overrides, legacy translation, effective values) and the
    resolved YAML are recorded at the start; the run directory is copied at the end
    (also on failure). The run ends FINISHED when the body returns 0
    (``tracker.exit_code``), else FAILED.

    The store is probed when the run starts: unreachable, it raises
    :class:`TrackingUnavailable` within seconds and nothing runs. Afterwards every call
    goes through :class:`ResilientTracker`, so a store that goes down never stops or
    slows the body; what could not be delivered is left in the run directory.
    """
    settings = ctx.cfg.tracking
    if not settings.enabled:
        yield NullTracker()
        return
    uri = tracking_uri(settings.uri, ctx.cfg.output.root)
    with http_settings(settings):
        tracker = ResilientTracker(start_tracker(ctx, uri), Path(ctx.run_dir), settings.flush_timeout_s)
        outcome: Any = "exception"
        try:
            tracker.log_params(config_params(ctx.cfg))
            tracker.log_text(ctx.config_yaml, "config/resolved.yaml")
            extra = {f"effective.{k}": v for k, v in (getattr(ctx, "effective", None) or {}).items()}
            if getattr(ctx, "suite_changes", None):
                from redknot.config.effective import describe_changes

                extra["suite.changes"] = describe_changes(ctx.suite_changes)
            if extra:
                tracker.set_tags(extra)
            yield tracker
            outcome = tracker.exit_code
        finally:
            tracker.set_tags({"redknot.exit_code": outcome})
            if settings.log_run_dir and Path(ctx.run_dir).is_dir():
                tracker.log_artifacts(ctx.run_dir, "run_dir")
            tracker.finish("FINISHED" if outcome == 0 else "FAILED")
            if tracker.incomplete:
                log.error("MLflow run %s is incomplete: the store at %s was unreachable at the end (%s); the "
                          "calls it missed are in %s; the benchmark's files in %s are complete", tracker.run_id,
                          uri, tracker.last_error, Path(ctx.run_dir) / BACKLOG_FILE, ctx.run_dir)
