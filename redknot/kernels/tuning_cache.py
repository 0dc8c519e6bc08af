"""Measured launch choices kept across processes, so a new process does not time every candidate again.

``ConfigTuner`` times each candidate on the first call of a problem class; on an H200 the first prefill
chunk of the V4.1 model spends about three minutes there, in every process. This store keeps each choice
(and the timings it came from) in one JSON file, keyed by the environment that measured it (GPU name,
compute capability, torch and triton versions), the tuner's name and the class key's ``repr``. Classes
are the tuners' own keys (weight shapes and power-of-two size classes), so a stored choice is exactly
what a fresh measurement would have keyed: batch invariance is unchanged.

Where: ``$REDKNOT_TUNING_CACHE`` (a file path; ``0``/``off``/``none``/empty disables the store), else
``outputs/cache/tuning/kernel_choices.json`` under the working directory, the engine's default
``cache_dir`` (the engine points it at its configured ``engine.cache_dir``, :func:`use_cache_dir`);
:func:`set_path` overrides both. The file is read once per process; an unreadable, corrupt
or other-format file is ignored with one warning (and replaced on the next write). Writes re-read the
file, merge, and replace it atomically (temporary file + rename), so parallel processes never leave a
torn file (the last writer of a class wins, and both measured the same thing).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

ENV_VAR = "REDKNOT_TUNING_CACHE"
DEFAULT_PATH = os.path.join("outputs", "cache", "tuning", "kernel_choices.json")
FORMAT = 1
_OFF = ("", "0", "off", "none", "false", "no")
_UNSET = object()


def environment(device: torch.device) -> str:
    """The part of a key that makes a measurement valid: GPU name, compute capability, torch, triton."""
    import triton

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        gpu = f"{torch.cuda.get_device_name(index)}|sm{major}{minor}"
    else:
        gpu = device.type
    return f"{gpu}|torch {torch.__version__}|triton {triton.__version__}"


def describe(value: Any) -> Optional[str]:
    """A stable text for a key or candidate, or None when its ``repr`` names an object address."""
    text = repr(value)
    return None if " at 0x" in text else text


class TuningStore:
    """One JSON file of choices: ``entries[environment][tuner][key] = {"choice", "timings"}``."""

    def __init__(self, path: str):
        self.path = path
        self.entries: Dict[str, Dict[str, Dict[str, Dict[str, Any]]]] = {}
        self._loaded = False
        self._lock = threading.Lock()

    def _read(self, warn: bool) -> Dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            if warn:
                log.warning("tuning cache %s is unreadable (%s): ignored, the kernels are tuned again",
                            self.path, exc)
            return {}
        if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict)):
            if warn:
                log.warning("tuning cache %s is not format %d: ignored, the kernels are tuned again", self.path, FORMAT)
            return {}
        return data["entries"]

    def _load(self) -> None:
        if not self._loaded:
            self.entries = self._read(warn=True)
            self._loaded = True

    def lookup(self, env: str, tuner: str, key: str) -> Optional[Dict[str, Any]]:
        """The stored entry ``{"choice": str, "timings": [[str, ms], ...]}``, or None."""
        with self._lock:
            self._load()
            entry = self.entries.get(env, {}).get(tuner, {}).get(key)
        ok = isinstance(entry, dict) and isinstance(entry.get("choice"), str)
        return entry if ok else None

    def record(self, env: str, tuner: str, key: str, choice: str, timings: Sequence[Tuple[str, float]]) -> None:
        """Store one class's choice: merged into the file as it is now, written atomically."""
        entry = {"choice": choice, "timings": [[c, float(ms)] for c, ms in timings]}
        with self._lock:
            self._load()
            self.entries.setdefault(env, {}).setdefault(tuner, {})[key] = entry
            merged = self._read(warn=False)
            for e, tuners in self.entries.items():
                for t, keys in tuners.items():
                    merged.setdefault(e, {}).setdefault(t, {}).update(keys)
            self.entries = merged
            try:
                folder = os.path.dirname(os.path.abspath(self.path))
                os.makedirs(folder, exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=".kernel_choices.", suffix=".tmp", dir=folder)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump({"format": FORMAT, "entries": merged}, f, indent=1, sort_keys=True)
                    os.replace(tmp, self.path)
                except BaseException:
                    os.unlink(tmp)
                    raise
            except OSError as exc:
                log.warning("tuning cache %s not written (%s)", self.path, exc)


_path: Any = _UNSET
_stores: Dict[str, TuningStore] = {}


def set_path(path: Optional[str]) -> None:
    """Use ``path`` for the store from now on (None: no store); overrides ``$REDKNOT_TUNING_CACHE``."""
    global _path
    _path = path


def use_cache_dir(cache_dir: Optional[str], enabled: bool = True) -> None:
    """Keep the store under a run's cache directory (``<cache_dir>/tuning/kernel_choices.json``), or no
    store when ``enabled`` is false (``engine.kernel_tuning_store``), unless ``$REDKNOT_TUNING_CACHE`` says
    otherwise (the variable wins, including ``off``)."""
    if ENV_VAR in os.environ:
        return
    if not enabled:
        set_path(None)
    elif cache_dir:
        set_path(os.path.join(cache_dir, "tuning", "kernel_choices.json"))


def reset() -> None:
    """Back to ``$REDKNOT_TUNING_CACHE`` / the default, with every file read again on next use."""
    global _path
    _path = _UNSET
    _stores.clear()


def current_path() -> Optional[str]:
    if _path is not _UNSET:
        return _path
    value = os.environ.get(ENV_VAR)
    if value is None:
        return DEFAULT_PATH
    return None if value.strip().lower() in _OFF else value


def store() -> Optional[TuningStore]:
    """The store in use, or None when disabled."""
    path = current_path()
    if path is None:
        return None
    if path not in _stores:
        _stores[path] = TuningStore(path)
    return _stores[path]


def restore(entry: Dict[str, Any], candidates: Sequence[Any]) -> Optional[Tuple[Any, List[Tuple[Any, float]]]]:
    """The candidate a stored entry names and its timings (those still candidates), or None when the stored
    choice is no candidate any more (renamed, removed, reshaped)."""
    by_text = {describe(c): c for c in candidates}
    choice = by_text.get(entry["choice"])
    if choice is None:
        return None
    timings = []
    for row in entry.get("timings") or []:
        if isinstance(row, (list, tuple)) and len(row) == 2 and row[0] in by_text:
            try:
                timings.append((by_text[row[0]], float(row[1])))
            except (TypeError, ValueError):
                continue
    return choice, timings
