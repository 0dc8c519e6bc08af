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
from redknot.tracking.backend_store import tracking_uri

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


@contextmanager
def open_tracker(ctx) -> Iterator[Any]:
    """Yield the run's tracker. Params (the flattened resolved config), tags (code,
    host, device, versions, overrides, legacy translation) and the resolved YAML are
    recorded at the start; the run directory is copied at the end (also on failure).
    The run ends FINISHED when the body returns 0 (``tracker.exit_code``), else FAILED.
    """
    settings = ctx.cfg.tracking
    if not settings.enabled:
        yield NullTracker()
        return
    from redknot.config.instantiate import build
    from redknot.tracking.facts import all_facts

    uri = tracking_uri(settings.uri, ctx.cfg.output.root)
    tracker = build(settings, "tracking", uri=uri, run_name=run_name(ctx), parent_run_id=parent_run_id(ctx, uri))
    tracker.start(run_tags(ctx, all_facts()))
    outcome: Any = "exception"
    try:
        tracker.log_params(config_params(ctx.cfg))
        tracker.log_text(ctx.config_yaml, "config/resolved.yaml")
        yield tracker
        outcome = tracker.exit_code
    finally:
        tracker.set_tags({"redknot.exit_code": outcome})
        if settings.log_run_dir and Path(ctx.run_dir).is_dir():
            tracker.log_artifacts(ctx.run_dir, "run_dir")
        tracker.finish("FINISHED" if outcome == 0 else "FAILED")
