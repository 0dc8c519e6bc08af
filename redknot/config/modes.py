"""Finding the body of each ``mode``.

The bodies live in :mod:`redknot.bench.app` (``run``, ``prepare``, ``validate``,
``generate`` take ``(ctx, tracker)``; ``catalog`` takes ``(ctx)``) and are imported
only when their mode is asked for, so ``mode=catalog`` never loads the engine.
``catalog`` prints the harness's details (suites, datasets, models, hardware)
followed by the option list of every config group (:mod:`redknot.config.group_options`),
so sweeps, feature presets and launchers show too; without the harness, the
group listing alone, with a summary per option.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from redknot.config.schema import Mode

BODIES_MODULE = "redknot.bench.app"
UNTRACKED = {Mode.catalog}  # modes that only print: no MLflow run


class ModeUnavailable(RuntimeError):
    """The installed code has no body for the requested mode."""


@dataclass(frozen=True)
class ModeBody:
    """A mode's entry point; ``tracked`` bodies are called as ``fn(ctx, tracker)``."""
    mode: Mode
    fn: Callable[..., int]
    tracked: bool


def load_mode(mode: Mode) -> ModeBody:
    mode = Mode(mode)
    fn = getattr(_bodies_module(), mode.value, None)
    if mode == Mode.catalog:
        from redknot.config.group_options import catalog_with

        fn = catalog_with(fn)
    if fn is None:
        raise ModeUnavailable(
            f"mode={mode.value}: this installation has no {BODIES_MODULE}.{mode.value}; "
            f"modes available here: {available_modes()}")
    return ModeBody(mode, fn, mode not in UNTRACKED)


def available_modes() -> list:
    module = _bodies_module()
    names = [m.value for m in Mode if getattr(module, m.value, None) is not None]
    if Mode.catalog.value not in names:
        names.append(Mode.catalog.value)
    return names


def _bodies_module():
    try:
        return importlib.import_module(BODIES_MODULE)
    except ModuleNotFoundError as err:
        # Only a missing harness module is tolerated; a missing dependency inside it is a real error.
        if err.name != BODIES_MODULE:
            raise
        return None
