"""``python -m redknot key=value ...``: compose, resolve, dispatch by ``mode``.

Hydra composes ``conf/``; :func:`redknot.config.resolve.resolve` checks legacy
variables, validates and types the config; the mode body (``redknot.bench.app``)
runs inside an MLflow run opened here. The process exits with the body's code
(2 for a config error); in a sweep, a failing job does not stop the others and
the sweep exits non-zero at the end.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import List, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from redknot.config.modes import ModeBody, ModeUnavailable, load_mode
from redknot.config.resolve import resolve
from redknot.config.violations import ConfigError
from redknot.parallel.launch import front_of_world, worker_body

log = logging.getLogger("redknot")
_exit_codes: List[int] = []


def dispatch(cfg: DictConfig, body: Optional[ModeBody] = None) -> int:
    """Resolve ``cfg`` and run its mode's body (``body`` replaces the lookup, for embedding)."""
    try:
        ctx = resolve(cfg)
        worker = worker_body(ctx)  # a rank > 0 under torchrun: serve rank 0's engine, record nothing
        body = body or (None if worker else load_mode(ctx.cfg.mode))
    except (ConfigError, ModeUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if worker is not None:
        return int(worker(ctx) or 0)
    for key, note in sorted(ctx.effective.items()):
        log.warning("%s is effectively %s", key, note)
    if not body.tracked:
        return int(body.fn(ctx) or 0)
    from redknot.tracking import open_tracker
    from redknot.tracking.backend_store import TrackingUnavailable

    try:
        with open_tracker(ctx) as tracker, front_of_world(ctx, tracker):
            tracker.exit_code = int(body.fn(ctx, tracker) or 0)
    except TrackingUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:  # a read-only or full output directory: say which, keep what was written
        where = f" {err.filename}" if getattr(err, "filename", None) else ""
        print(f"error: cannot write{where}: {err.strerror or err}; everything written before this point is "
              f"kept in {ctx.run_dir}", file=sys.stderr)
        return 1
    return tracker.exit_code


def run_job(cfg: DictConfig, body: Optional[ModeBody] = None) -> int:
    """One Hydra job: :func:`dispatch`, its exit code kept for the process exit.
    In a sweep an exception fails this job only (its MLflow run is already FAILED)."""
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    error = None
    try:
        code = dispatch(cfg, body)
    except Exception as err:
        if not multirun:
            raise
        log.exception("job %s failed", hydra_cfg.job.num)
        code, error = 1, f"{type(err).__name__}: {err}"
    if multirun:  # the sweep callback counts every job, also one refused before it opened a run
        from redknot.config.sweep_files import record_job_exit

        try:
            record_job_exit(Path(hydra_cfg.sweep.dir).resolve(), int(hydra_cfg.job.num), code, error)
        except OSError as err:
            log.warning("could not record the exit code of job %s: %s", hydra_cfg.job.num, err)
    _exit_codes.append(code)
    return code


def exit_code() -> int:
    """The first non-zero job exit code, else 0."""
    return next((c for c in _exit_codes if c), 0)


def check_command_line(argv: List[str]) -> Optional[int]:
    """Run :func:`redknot.config.precheck.precheck` on ``argv``: an exit code (2) when the command
    line is refused, else None (legacy overrides for ``--cfg`` are appended to ``argv``)."""
    from redknot.config.hardware_fit import CONF_DIR
    from redknot.config.precheck import precheck

    result = precheck(argv[1:], CONF_DIR)
    if result is None:
        return None
    if result.legacy_stop:
        print(result.legacy_stop, file=sys.stderr)
        return 2
    if result.violations:
        print(f"error: {ConfigError(result.violations)}", file=sys.stderr)
        return 2
    argv[1:1] = result.extra_overrides  # before any flag (argparse takes overrides only there)
    return None


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> int:
    return run_job(cfg)


if __name__ == "__main__":
    refused = check_command_line(sys.argv)
    if refused is not None:
        sys.exit(refused)
    main()
    sys.exit(exit_code())
