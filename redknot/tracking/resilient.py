"""A tracker that never stops or slows the benchmark it records.

:class:`ResilientTracker` wraps the MLflow tracker of a run that has already started (so the
store was reachable then). Every call is queued and delivered in order by one background
thread; the benchmark never waits on the store. When a delivery fails (the server died, the
disk filled up), the thread keeps the call, retries with a growing pause and marks the run
*degraded*; when the store comes back, delivery resumes where it stopped, and the run is tagged
with the gap. At :meth:`finish`, the thread gets ``flush_timeout_s`` to deliver the rest; what
it could not deliver is written to ``tracking_backlog.jsonl`` in the run directory and the run
is *incomplete* (the benchmark's own files in the run directory are complete either way).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Deque, Dict, Mapping, Optional, Tuple

log = logging.getLogger(__name__)

BACKLOG_FILE = "tracking_backlog.jsonl"
RETRY_PAUSES_S = (0.5, 1.0, 2.0, 5.0, 10.0)

_Op = Tuple[str, tuple, dict]


class ResilientTracker:
    """Queued, retried delivery to an MLflow tracker (see the module docstring)."""

    def __init__(self, inner: Any, backlog_dir: Optional[Path] = None, flush_timeout_s: float = 30.0,
                 pauses_s: Tuple[float, ...] = RETRY_PAUSES_S):
        self.inner = inner
        self.run_id = inner.run_id
        self.uri = getattr(inner, "uri", None)
        self.backlog_dir = Path(backlog_dir) if backlog_dir is not None else None
        self.flush_timeout_s = flush_timeout_s
        self.pauses_s = pauses_s
        self.exit_code = 0
        self.failures = 0
        self.last_error: Optional[str] = None
        self.first_failure_unix: Optional[float] = None
        self.recovered_unix: Optional[float] = None
        self.incomplete = False
        self._queue: Deque[_Op] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name=f"mlflow-{self.run_id}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the Tracker API (queued)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._submit("log_params", dict(params))

    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self._submit("log_metrics", dict(metrics), step=step, timestamp_ms=int(time.time() * 1000))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._submit("set_tags", dict(tags))

    def log_artifact(self, path, artifact_path: Optional[str] = None) -> None:
        self._submit("log_artifact", str(path), artifact_path)

    def log_artifacts(self, directory, artifact_path: Optional[str] = None) -> None:
        self._submit("log_artifacts", str(directory), artifact_path)

    def log_text(self, text: str, artifact_file: str) -> None:
        self._submit("log_text", text, artifact_file)

    def close_stale(self, run_id: str, reason: str) -> None:
        self._submit("close_stale", run_id, reason)

    def child(self, run_name: str, tags: Optional[Mapping[str, Any]] = None) -> "ResilientTracker":
        """A child run (started now, so this needs the store) with its own delivery queue."""
        inner = self.inner.child(run_name, tags)
        return ResilientTracker(inner, self.backlog_dir, self.flush_timeout_s, self.pauses_s)

    @property
    def degraded(self) -> bool:
        return self.failures > 0

    # ------------------------------------------------------------------ delivery

    def _submit(self, name: str, *args: Any, **kwargs: Any) -> None:
        with self._cv:
            if self._stopped:
                self._spill([(name, args, kwargs)])
                return
            self._queue.append((name, args, kwargs))
            self._cv.notify_all()

    def _work(self) -> None:
        attempt = 0
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._stopped or (self._closing and not self._queue):
                    return
                name, args, kwargs = self._queue[0]
            try:
                getattr(self.inner, name)(*args, **kwargs)
            except Exception as err:  # the store is down or full: keep the call, try again later
                self._note_failure(name, err)
                pause = self.pauses_s[min(attempt, len(self.pauses_s) - 1)]
                attempt += 1
                with self._cv:
                    self._cv.wait_for(lambda: self._stopped, timeout=pause)
                continue
            with self._cv:
                if self._queue and self._queue[0][0] == name:
                    self._queue.popleft()
                self._cv.notify_all()
            if attempt:
                self.recovered_unix = time.time()
                log.warning("MLflow store %s reachable again; delivering the %d queued call(s)", self.uri,
                            len(self._queue))
            attempt = 0

    def _note_failure(self, name: str, err: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
        if self.first_failure_unix is None:
            self.first_failure_unix = time.time()
            log.warning("MLflow store %s failed on %s (%s); the benchmark goes on and tracking retries in the "
                        "background", self.uri, name, self.last_error)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued call is delivered (True) or ``timeout_s`` passes (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue, timeout=timeout_s)

    def finish(self, status: str = "FINISHED") -> None:
        """Close the run; give the store ``flush_timeout_s`` to take what is queued, spill the rest."""
        if self.degraded:
            self.set_tags({"redknot.tracking_gaps": f"{self.failures} failed deliveries from "
                           f"{time.strftime('%H:%M:%S', time.localtime(self.first_failure_unix))}; "
                           f"last error: {self.last_error}"})
        self._submit("finish", status)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        delivered = self.flush(self.flush_timeout_s)
        with self._cv:
            self._stopped = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if not delivered and left:
            self.incomplete = True
            self._spill(left)
        self._thread.join(timeout=1.0)

    def _spill(self, ops) -> None:
        self.incomplete = True
        if self.backlog_dir is None:
            return
        try:
            self.backlog_dir.mkdir(parents=True, exist_ok=True)
            with open(self.backlog_dir / BACKLOG_FILE, "a", encoding="utf-8") as handle:
                for name, args, kwargs in ops:
                    handle.write(json.dumps({"run_id": self.run_id, "op": name, "args": list(args),
                                             "kwargs": kwargs}, default=str) + "\n")
        except OSError as err:
            log.error("could not write the tracking backlog into %s: %s", self.backlog_dir, err)

    def summary(self) -> Dict[str, Any]:
        return {"degraded": self.degraded, "incomplete": self.incomplete, "failures": self.failures,
                "last_error": self.last_error}
