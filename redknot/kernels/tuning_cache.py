"""Measured launch choices kept across processes, so a new process does not time every candidate again.

``ConfigTuner`` times each candidate on the first call of a problem class; on an H200 the first prefill
chunk of the V4.1 model spends about three minutes there, in every process. This store keeps each choice
(and the timings it came from) in one JSON file, keyed by the environment that measured it (GPU name,
compute capability, torch and triton versions, the tuner's timing rule), the tuner's name and the class key's ``repr``. Classes
are the tuners' own keys (weight shapes and power-of-two size classes), so a stored choice is exactly
what a fresh measurement would have keyed: batch invariance is unchanged.

Where: ``$REDKNOT_TUNING_CACHE`` (a file path; ``0``/``off``/``none``/empty disables the store), else
``outputs/cache/tuning/kernel_choices.json`` under the working directory, the engine's default
``cache_dir`` (the engine points it at its configured ``engine.cache_dir``, :func:`use_cache_dir`);
:func:`set_path` overrides both. The file is read once per process; an unreadable, corrupt
or other-format file is ignored with one warning (and replaced on the next write). Writes re-read the
file, merge, and replace it atomically (temporary file + rename), so parallel processes never leave a
torn file (the last writer of a class wins, and both measured the same thing).

Shipped choices (the seed): JSON files of the store's format under ``redknot/kernels/tuned/`` (package
data), consulted only for a class the store has no entry for. A seed entry is used under the store's own
rule: the same environment string, i.e. the same GPU name and compute capability, the same torch and
triton versions and the same timing rule; a seed measured under other versions is not used (one warning per process names the
file, its versions and this process's), because launch choices are re-measured whenever the versions
change, as the store does. A used seed choice passes the same first-use guard as a stored one (a choice
that no longer builds or runs is tuned again, and that measurement goes to the store, which then wins).
Nothing is ever written to a seed. ``$REDKNOT_TUNING_SEED`` (a file or folder of ``*.json`` seeds;
``off``/``0``/empty: none) replaces the packaged folder; else ``engine.kernel_tuning_seed`` (default true,
:func:`use_seed`) turns the packaged seeds on or off; :func:`set_seed_path` overrides both. The seed is
independent of the store: either can be off. A seed file that is not valid JSON of the store's format is
ignored with a warning naming the file. ``python -m redknot.kernels.tuning_cache export STORE OUT`` writes
a seed from a store (``--gpu`` keeps the environments whose GPU part contains a text; ``--pin-as ENV`` writes
the selected environment's choices as pinned choices, no timings, under another environment).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV_VAR = "REDKNOT_TUNING_CACHE"
DEFAULT_PATH = os.path.join("outputs", "cache", "tuning", "kernel_choices.json")
FORMAT = 1
_OFF = ("", "0", "off", "none", "false", "no")
_UNSET = object()


TIMING = "graph<1ms"   # how ConfigTuner compares candidates (its graph_below_ms rule); a new rule re-tunes


def environment(device: torch.device) -> str:
    """The part of a key that makes a measurement valid: GPU name, compute capability, torch, triton, and the
    tuner's timing rule (choices timed under another rule are measured again)."""
    import triton

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        gpu = f"{torch.cuda.get_device_name(index)}|sm{major}{minor}"
    else:
        gpu = device.type
    return f"{gpu}|torch {torch.__version__}|triton {triton.__version__}|timing {TIMING}"


def describe(value: Any) -> str | None:
    """A stable text for a key or candidate, or None when its ``repr`` names an object address."""
    text = repr(value)
    return None if " at 0x" in text else text


class TuningStore:
    """One JSON file of choices: ``entries[environment][tuner][key] = {"choice", "timings"}``."""

    def __init__(self, path: str):
        self.path = path
        self.entries: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        self._loaded = False
        self._lock = threading.Lock()

    def _read(self, warn: bool) -> dict[str, Any]:
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

    def lookup(self, env: str, tuner: str, key: str) -> dict[str, Any] | None:
        """The stored entry ``{"choice": str, "timings": [[str, ms], ...]}``, or None."""
        with self._lock:
            self._load()
            entry = self.entries.get(env, {}).get(tuner, {}).get(key)
        ok = isinstance(entry, dict) and isinstance(entry.get("choice"), str)
        return entry if ok else None

    def record(self, env: str, tuner: str, key: str, choice: str, timings: Sequence[tuple[str, float]],
               failed: Sequence[str] = ()) -> None:
        """Store one class's choice: merged into the file as it is now, written atomically. ``failed``: the
        candidates that did not build or run here (so that :func:`untimed` counts them as measured)."""
        entry: dict[str, Any] = {"choice": choice, "timings": [[c, float(ms)] for c, ms in timings]}
        if failed:
            entry["failed"] = list(failed)
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
_stores: dict[str, TuningStore] = {}
SEED_ENV_VAR = "REDKNOT_TUNING_SEED"
SEED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")
_seed_path: Any = _UNSET
_seeds: dict[str, Seed] = {}


def set_path(path: str | None) -> None:
    """Use ``path`` for the store from now on (None: no store); overrides ``$REDKNOT_TUNING_CACHE``."""
    global _path
    _path = path


def use_cache_dir(cache_dir: str | None, enabled: bool = True) -> None:
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
    """Back to ``$REDKNOT_TUNING_CACHE`` / ``$REDKNOT_TUNING_SEED`` / the defaults, with every file read
    again on next use."""
    global _path, _seed_path
    _path = _UNSET
    _stores.clear()
    _seed_path = _UNSET
    _seeds.clear()


def current_path() -> str | None:
    if _path is not _UNSET:
        return _path
    value = os.environ.get(ENV_VAR)
    if value is None:
        return DEFAULT_PATH
    return None if value.strip().lower() in _OFF else value


def store() -> TuningStore | None:
    """The store in use, or None when disabled."""
    path = current_path()
    if path is None:
        return None
    if path not in _stores:
        _stores[path] = TuningStore(path)
    return _stores[path]


def restore(entry: dict[str, Any], candidates: Sequence[Any]) -> tuple[Any, list[tuple[Any, float]]] | None:
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


def untimed(entry: dict[str, Any], candidates: Sequence[Any]) -> list[str]:
    """The candidates (described) that a stored entry neither timed nor saw fail: candidates added to a tuner
    after the entry was measured. Empty when every candidate was measured, when a candidate has no stable
    description (nothing to compare), or when the entry has no timings at all (a choice pinned by hand)."""
    texts = [describe(c) for c in candidates]
    if any(t is None for t in texts) or not entry.get("timings"):
        return []
    seen = {row[0] for row in entry.get("timings") or [] if isinstance(row, (list, tuple)) and row}
    seen.update(t for t in entry.get("failed") or [] if isinstance(t, str))
    return [t for t in texts if t not in seen]


# ----------------------------------------------------------------------------------------- the seed
def read_seed_file(path: str) -> dict[str, Any]:
    """The entries of one seed file; ``ValueError`` naming the file when it is not the store's format."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"kernel tuning seed {path}: not readable as JSON ({exc})") from exc
    if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict)):
        raise ValueError(f"kernel tuning seed {path}: not a tuning store of format {FORMAT} "
                         '({"format": 1, "entries": {environment: {tuner: {class: {"choice": ...}}}}})')
    for env, tuners in data["entries"].items():
        if not isinstance(tuners, dict) or not all(isinstance(keys, dict) for keys in tuners.values()):
            raise ValueError(f"kernel tuning seed {path}: environment {env!r} does not map tuners to classes")
    return data["entries"]


def _split(env: str) -> tuple[str, str]:
    """(GPU part, versions part) of an environment string (``environment``): ``name|smXY``,
    ``torch ..|triton ..|timing ..``."""
    parts = env.split("|")
    versions = ("torch ", "triton ", "timing ")
    gpu = "|".join(p for p in parts if not p.startswith(versions))
    return gpu, "|".join(p for p in parts if p.startswith(versions))


class Seed:
    """Read-only shipped choices: every ``*.json`` of a folder (or one file), merged in name order."""

    def __init__(self, path: str):
        self.path = path
        self.entries: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        self.origin: dict[str, str] = {}     # environment -> the file that holds it
        self._loaded = False
        self._warned: set = set()
        self._lock = threading.Lock()

    def files(self) -> list[str]:
        if os.path.isdir(self.path):
            return sorted(os.path.join(self.path, n) for n in os.listdir(self.path) if n.endswith(".json"))
        return [self.path] if os.path.exists(self.path) else []

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for path in self.files():
            try:
                entries = read_seed_file(path)
            except ValueError as exc:
                log.warning("%s: ignored, the kernels are tuned on first use", exc)
                continue
            for env, tuners in entries.items():
                self.origin.setdefault(env, path)
                for tuner, keys in tuners.items():
                    self.entries.setdefault(env, {}).setdefault(tuner, {}).update(keys)

    def lookup(self, env: str, tuner: str, key: str) -> dict[str, Any] | None:
        """The shipped entry for exactly this environment, or None. A seed for this GPU under other torch /
        triton versions is not used; the first such miss in a process logs one warning."""
        with self._lock:
            self._load()
            entry = self.entries.get(env, {}).get(tuner, {}).get(key)
            if entry is None and env not in self.entries and env not in self._warned:
                self._warned.add(env)
                gpu, versions = _split(env)
                other = sorted(e for e in self.entries if _split(e)[0] == gpu)
                if other:
                    log.warning("kernel tuning seed %s holds choices for %s under %s, this process runs %s: not "
                                "used (choices are measured per torch/triton version); the kernels are tuned on "
                                "first use", self.origin[other[0]], gpu, ", ".join(_split(e)[1] for e in other),
                                versions)
        ok = isinstance(entry, dict) and isinstance(entry.get("choice"), str)
        return entry if ok else None


def set_seed_path(path: str | None) -> None:
    """Use the seed file or folder ``path`` from now on (None: no seed); overrides ``$REDKNOT_TUNING_SEED``."""
    global _seed_path
    _seed_path = path


def use_seed(enabled: bool = True) -> None:
    """``engine.kernel_tuning_seed``: the packaged seeds on or off, unless ``$REDKNOT_TUNING_SEED`` is set
    (the variable wins, including ``off``)."""
    if SEED_ENV_VAR in os.environ:
        return
    set_seed_path(SEED_DIR if enabled else None)


_small_rows_class = True


def use_small_rows_class(enabled: bool = True) -> None:
    """Whether the V4.1 weight streams keep a second launch choice for calls of 1-4 rows (``gemm_mx`` /
    ``moe_mx``'s small-row class: a row's bits then differ between 1-4 and 5+ rows by summation order).
    The engine turns it off under ``features.batch_invariant.enabled`` or ``features.deterministic``, so a
    row's bits do not depend on how many rows share its step."""
    global _small_rows_class
    _small_rows_class = bool(enabled)


def small_rows_class() -> bool:
    return _small_rows_class


def current_seed_path() -> str | None:
    if _seed_path is not _UNSET:
        return _seed_path
    value = os.environ.get(SEED_ENV_VAR)
    if value is None:
        return SEED_DIR
    return None if value.strip().lower() in _OFF else value


def seed() -> Seed | None:
    """The seed in use, or None when disabled."""
    path = current_seed_path()
    if path is None:
        return None
    if path not in _seeds:
        _seeds[path] = Seed(path)
    return _seeds[path]


def lookup(env: str, tuner: str, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """The entry for a class and where it came from: the store (``"stored"``) first, else the seed
    (``"shipped"``); (None, None) when neither has one."""
    st, sd = store(), seed()
    entry = st.lookup(env, tuner, key) if st is not None else None
    if entry is not None:
        return entry, "stored"
    entry = sd.lookup(env, tuner, key) if sd is not None else None
    return (entry, "shipped") if entry is not None else (None, None)


def export(store_path: str, out_path: str, gpu: str | None = None, pin_as: str | None = None) -> dict[str, int]:
    """Write a seed from a store: its entries (those whose environment's GPU part contains ``gpu``, when
    given), in the store's format. Returns the classes written per environment. ``pin_as``: the one selected
    environment's choices, without their timings, under the environment string ``pin_as`` instead: pinned
    choices (kept as they are, never timed, each still run once by the first-use guard) that let a GPU no
    store has measured start from a sibling's launch choices (an H200 from an H100's) instead of a tuning
    pass; a pinned seed says nothing about that GPU's timings, so its measurements should say it was used."""
    entries = read_seed_file(store_path)   # the store's format is the seed's
    if gpu is not None:
        entries = {e: t for e, t in entries.items() if gpu.lower() in _split(e)[0].lower()}
    if not entries:
        raise ValueError(f"{store_path}: no environment to export" + (f" matching GPU {gpu!r}" if gpu else ""))
    if pin_as is not None:
        if len(entries) != 1:
            raise ValueError(f"--pin-as: {len(entries)} environments selected ({', '.join(sorted(entries))}); "
                             "select one with --gpu")
        if "|sm" not in pin_as or "|torch " not in pin_as or "|triton " not in pin_as:
            raise ValueError(f"--pin-as: {pin_as!r} is not an environment string (GPU name|smXY|torch V|triton V"
                             f"|timing R, as a store's keys are, e.g. {next(iter(entries))!r})")
        (tuners,) = entries.values()
        entries = {pin_as: {t: {k: {"choice": e["choice"]} for k, e in keys.items()} for t, keys in tuners.items()}}
    folder = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(folder, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
        f.write("\n")
    read_seed_file(out_path)
    return {e: sum(len(keys) for keys in t.values()) for e, t in entries.items()}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m redknot.kernels.tuning_cache",
                                 description="Kernel tuning store tools")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="write a seed (shipped choices) from a store")
    ex.add_argument("store", help="a store file (kernel_choices.json)")
    ex.add_argument("out", help="the seed file to write (e.g. redknot/kernels/tuned/h200.json)")
    ex.add_argument("--gpu", default=None, help="keep the environments whose GPU part contains this text")
    ex.add_argument("--pin-as", default=None, metavar="ENVIRONMENT",
                    help="write the one selected environment's choices as pinned choices (no timings) under this "
                         "environment string: a sibling GPU's choices for a GPU no store has measured")
    a = ap.parse_args(argv)
    try:
        counts = export(a.store, a.out, a.gpu, a.pin_as)
    except ValueError as exc:
        print(f"error: {exc}")
        return 1
    for env, n in counts.items():
        print(f"{env}: {n} classes")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
