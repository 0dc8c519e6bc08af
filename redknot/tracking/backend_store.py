"""Where runs are recorded, and making the store exist before anyone writes to it.

Default store: ``sqlite:///<absolute output.root>/mlflow.db``; ``MLFLOW_TRACKING_URI``
or ``tracking.uri=`` point elsewhere (e.g. an MLflow server). A fresh SQLite file
is created by MLflow's schema migrations, which are not safe to run from several
processes at once, so :func:`ensure_experiment` serialises the first contact with
a file lock beside the database (sweep launchers call it once before starting
jobs; parallel independent runs are covered by the same lock).
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional

SQLITE_PREFIX = "sqlite:///"
ARTIFACTS_DIRNAME = "mlflow-artifacts"


def tracking_uri(configured: Optional[str], output_root: str, environ: Optional[Mapping[str, str]] = None) -> str:
    """``tracking.uri`` if set, else ``$MLFLOW_TRACKING_URI``, else the SQLite file under ``output_root``."""
    environ = os.environ if environ is None else environ
    if configured:
        return configured
    if environ.get("MLFLOW_TRACKING_URI"):
        return environ["MLFLOW_TRACKING_URI"]
    return SQLITE_PREFIX + str(Path(output_root).resolve() / "mlflow.db")


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a ``sqlite:///`` URI (relative or absolute), else None."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    return Path(uri[len(SQLITE_PREFIX):].split("?", 1)[0])


def default_artifact_location(uri: str, configured: Optional[str]) -> Optional[str]:
    """Artifacts beside a SQLite store (MLflow's own default is ./mlruns in the working directory,
    outside outputs/); None lets a tracking server decide."""
    if configured:
        return configured
    db = sqlite_path(uri)
    if db is None:
        return None
    return (db.resolve().parent / ARTIFACTS_DIRNAME).as_uri()


@contextmanager
def store_lock(uri: str) -> Iterator[None]:
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
