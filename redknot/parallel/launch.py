"""``torchrun --nproc-per-node N -m redknot ...``: what each rank of a launched world does.

Rank 0 is the front: it runs the mode body as usual (inputs, engine, harness,
records, the MLflow run). Every other rank builds the same engine from the same
resolved config and serves the front's steps (:func:`worker_body`); it writes no
records and opens no MLflow run. Around the front's body, :func:`front_of_world`
records the layout (tags ``parallel.*``) and every rank's metrics (``rank<r>.*``)
in the run, then shuts the workers down — also when the body never built an
engine (nothing to run, bad inputs), so that no worker waits forever.

Only ``mode=run`` and ``mode=generate`` use the world; in other modes the
workers exit at once. This module does not import torch unless a world is used.
"""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from redknot.config.schema import Mode
from redknot.parallel.layout import LaunchEnv, export_slurm_env

log = logging.getLogger(__name__)

ENGINE_MODES = (Mode.run, Mode.generate)


def launched_world() -> LaunchEnv:
    export_slurm_env()
    return LaunchEnv.from_env()


def worker_body(ctx) -> Optional[Callable[[Any], int]]:
    """For a rank > 0 of a launched world: the function to run instead of the mode body; else None."""
    if launched_world().rank == 0:
        return None
    return _serve if Mode(ctx.cfg.mode) in ENGINE_MODES else (lambda _ctx: 0)


def _serve(ctx) -> int:
    from redknot.config.instantiate import build
    from redknot.parallel.groups import FrontExited
    from redknot.parallel.runtime import serve

    cfg = ctx.cfg
    try:
        kernels = build(cfg.hardware.kernels, "hardware.kernels")
        llm = build(cfg.engine, "engine", model=cfg.model, hardware=cfg.hardware, features=cfg.features,
                    kernels=kernels)
    except FrontExited as done:
        log.info("%s", done)
        return 0
    serve(llm)
    llm.close()
    llm.parallel.destroy()
    _destroy_default_group()
    return 0


def _destroy_default_group() -> None:
    """Tear the default group down before the interpreter exits: a gloo group left to exit-time
    destructors can abort the process after its work is done (``terminate called ...``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active_runtimes() -> list:
    module = sys.modules.get("redknot.parallel.runtime")
    return list(module.ACTIVE) if module is not None else []


@contextmanager
def front_of_world(ctx, tracker) -> Iterator[None]:
    """Around rank 0's mode body in a launched world (see the module docstring); a no-op otherwise."""
    env = launched_world()
    if env.world_size == 1 or Mode(ctx.cfg.mode) not in ENGINE_MODES:
        yield
        return
    try:
        yield
    finally:
        runtimes = active_runtimes()
        for runtime in runtimes:
            record_layout(tracker, runtime)
            runtime.destroy()
        if not runtimes:
            release_workers(ctx.cfg, env)
        _destroy_default_group()


def record_layout(tracker, runtime) -> None:
    """The layout as tags and every rank's latest metrics as ``rank<r>.<name>``."""
    tracker.set_tags(runtime.describe())
    metrics = {f"rank{rank}.{name}": value for rank, values in sorted(runtime.rank_metrics().items())
               for name, value in values.items()}
    if metrics:
        tracker.log_metrics(metrics)


def release_workers(cfg, env: LaunchEnv) -> None:
    """Rank 0 built no engine: meet the workers in group creation and tell them to exit."""
    from redknot.parallel.groups import init_groups

    log.info("no engine was built on rank 0; releasing %d worker rank(s)", env.world_size - 1)
    init_groups(cfg.features.parallel, cfg.hardware, env, proceed=False)
