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


class TrackingUnavailable(RuntimeError):
    """The tracking store cannot be used at the start of a run; nothing has been measured yet."""


FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"
_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "request_timeout_s", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "max_retries"}


def is_file_store(uri: str) -> bool:
    """``file:`` URIs and plain paths (MLflow's file store); not databases or servers."""
    return uri.startswith("file:") or (":" not in uri.split("/", 1)[0] and not uri.startswith("databricks"))


def check_uri(uri: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse, with the way out named, a store MLflow itself would refuse later (the file store)."""
    environ = os.environ if environ is None else environ
    if is_file_store(uri) and str(environ.get(FILE_STORE_ENV, "")).lower() not in ("1", "true", "yes"):
        raise TrackingUnavailable(
            f"tracking.uri={uri}: MLflow 3 keeps its file store in maintenance mode and refuses it unless "
            f"{FILE_STORE_ENV}=true is exported; use a database store instead (tracking.uri=sqlite:///path/mlflow.db, "
            f"the default), or export {FILE_STORE_ENV}=true to keep the file store")


@contextmanager
def http_settings(tracking) -> Iterator[None]:
    """MLflow's HTTP timeout and retries set from ``tracking`` for the run, restored afterwards
    (MLflow's own default retries a dead server for minutes)."""
    saved = {name: os.environ.get(name) for name in _HTTP_ENV}
    for name, key in _HTTP_ENV.items():
        value = getattr(tracking, key)
        os.environ[name] = str(max(int(value), 0 if key == "max_retries" else 1))  # MLflow reads integers
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def describe_failure(uri: str, err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"tracking.uri={uri}: the MLflow store cannot be used ({type(err).__name__}: {text[:300]}); start "
            f"the tracking server or fix the path, point tracking.uri elsewhere, or run with "
            f"tracking.enabled=false (nothing has been measured yet)")
