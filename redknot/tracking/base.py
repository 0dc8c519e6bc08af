"""The tracking API the rest of RedKnot calls, and the tracker used when tracking is off."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Protocol, Union

PathLike = Union[str, Path]


class Tracker(Protocol):
    """What mode bodies get: record params, metrics (batched), tags and artifacts of one run."""

    run_id: Optional[str]

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None: ...

    def log_artifact(self, path: PathLike, artifact_path: Optional[str] = None) -> None: ...

    def log_artifacts(self, directory: PathLike, artifact_path: Optional[str] = None) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_text(self, text: str, artifact_file: str) -> None: ...


class NullTracker:
    """``tracking.enabled=false``: every call is accepted and nothing is recorded."""

    run_id: Optional[str] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.exit_code = 0

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        pass

    def log_artifact(self, path: PathLike, artifact_path: Optional[str] = None) -> None:
        pass

    def log_artifacts(self, directory: PathLike, artifact_path: Optional[str] = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def start(self, tags: Optional[Dict[str, str]] = None) -> None:
        pass

    def finish(self, status: str = "FINISHED") -> None:
        pass

    def child(self, run_name: str, tags: Optional[Mapping[str, Any]] = None) -> "NullTracker":
        return NullTracker()

    def close_stale(self, run_id: str, reason: str) -> None:
        pass

    degraded = False
    incomplete = False
