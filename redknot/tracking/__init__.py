"""Run tracking: the only package that imports mlflow.

``open_tracker(ctx)`` opens the MLflow run around a mode body and yields a
tracker (``log_params``, ``log_metrics`` (batched), ``log_artifact(s)``,
``set_tags``, ``log_text``); :class:`NullTracker` stands in when
``tracking.enabled=false``. mlflow is imported only when a run is actually
tracked, so composing, cataloguing and preparing stay fast.
"""
from __future__ import annotations

from redknot.tracking.base import NullTracker, Tracker

__all__ = ["MlflowTracker", "NullTracker", "Tracker", "open_tracker", "tracking_uri"]


def __getattr__(name):
    if name == "MlflowTracker":
        from redknot.tracking.mlflow_tracker import MlflowTracker
        return MlflowTracker
    if name == "open_tracker":
        from redknot.tracking.run import open_tracker
        return open_tracker
    if name == "tracking_uri":
        from redknot.tracking.backend_store import tracking_uri
        return tracking_uri
    raise AttributeError(f"module 'redknot.tracking' has no attribute {name!r}")
