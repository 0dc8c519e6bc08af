"""Release suites: the frozen suite files and ``RELEASE_SUITES.json`` that pins them.

A release suite (``suite.release=true``: ``release_smoke``, ``release_64k`` … ``release_440k``)
is frozen like any suite (:mod:`redknot.bench.freeze`), then exported and pinned under
``<output.cache_dir>/release/``:

* ``<suite>_<N>case.jsonl`` — the cases in run order, one JSON line each (short-answer cases
  first, then the presentation cases): id, dataset, role, question, answers, generation length,
  prompt length and the sha256 of its prompt ids;
* ``RELEASE_SUITES.json`` — per suite: that file, the inputs manifest and every ids file with its
  SHA-256 (paths relative to ``output.cache_dir``), the case order, and the execution contract
  (lengths, case counts, repetitions, decoding, what the accuracy aggregate covers).

``mode=prepare`` writes the entry; ``mode=run`` and ``mode=compare`` check it before any engine
starts (:func:`check_release`): an edited, missing or extra file, a changed order or a contract
that the config no longer matches fails with the file or key named.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, List

from redknot.bench.integrity import InputsError
from redknot.bench.frozen_inputs import MANIFEST, FrozenInputs
from redknot.bench.suite import TOKENS_PER_K
from redknot.config.schema import SuiteConfig

RELEASE_DIR = "release"
MANIFEST_NAME = "RELEASE_SUITES.json"
FORMAT = "redknot-release-suites/1"


class ReleaseError(InputsError):
    """A release suite whose frozen files or contract do not match ``RELEASE_SUITES.json``."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / RELEASE_DIR / MANIFEST_NAME


def case_file_name(suite: SuiteConfig, inputs: FrozenInputs) -> str:
    return f"{suite.name}_{len(inputs.cases)}case.jsonl"


def contract(suite: SuiteConfig, inputs: FrozenInputs) -> dict:
    """What a comparable run of this suite must do (frozen with the files)."""
    short = [c for c in inputs.cases if c.role != "presentation"]
    return {
        "context_tokens": suite.context_tokens, "tokens_per_k": TOKENS_PER_K,
        "chat_template": getattr(suite.chat_template, "value", suite.chat_template),
        "short_answer_cases": len(short), "presentation_cases": len(inputs.cases) - len(short),
        "presentation_max_new_tokens": suite.presentation_max_new_tokens,
        "max_new_tokens": {c.dataset: c.max_new_tokens for c in short},
        "warmup_repeats": suite.warmup_repeats, "measured_repeats": suite.measured_repeats,
        "admission_batch_size": suite.admission_batch_size, "decoding": "greedy",
        "ttft": "engine clock, arrival to first token; per case the p50 and p95 of the measured repetitions",
        "accuracy": "mean of the short-answer dataset scores; presentation cases are excluded",
        "tokenizer_sha256": inputs.header.get("tokenizer", {}).get("sha256"),
        "inputs_address": inputs.address,
    }


def _case_lines(inputs: FrozenInputs) -> str:
    lines = []
    for case in inputs.cases:
        lines.append(json.dumps({"case_id": case.case_id, "dataset": case.dataset, "role": case.role,
                                 "question": case.question, "answers": list(case.answers),
                                 "max_new_tokens": case.max_new_tokens, "num_tokens": case.num_tokens,
                                 "ids_sha256": case.ids_sha256}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def _pinned_files(cache_dir: Path, inputs: FrozenInputs, case_file: Path) -> List[Path]:
    ids = sorted({inputs.ids_path(c) for c in inputs.cases})
    return [case_file, inputs.directory / MANIFEST, *ids]


def _relative(path: Path, cache_dir: Path) -> str:
    return str(Path(path).resolve().relative_to(Path(cache_dir).resolve()))


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReleaseError(f"{path} is not valid JSON ({err}; truncated or edited)") from None
    if not isinstance(data, dict) or not isinstance(data.get("suites"), dict):
        raise ReleaseError(f"{path} has no 'suites' object (not a {FORMAT} manifest)")
    return data


def write_release(cache_dir: Path, suite: SuiteConfig, inputs: FrozenInputs) -> Path:
    """Export the suite's case list and (re)write its entry in ``RELEASE_SUITES.json``."""
    cache_dir = Path(cache_dir)
    path = manifest_path(cache_dir)
    case_file = path.parent / case_file_name(suite, inputs)
    with _locked(path):
        case_file.write_text(_case_lines(inputs), encoding="utf-8")
        data = _read(path) if path.is_file() else {"format": FORMAT, "suites": {}}
        data["suites"][suite.name] = {
            "file": _relative(case_file, cache_dir),
            "order": [c.case_id for c in inputs.cases],
            "sha256": {_relative(p, cache_dir): file_sha256(p) for p in _pinned_files(cache_dir, inputs, case_file)},
            "contract": contract(suite, inputs),
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    return path


def release_problems(cache_dir: Path, suite: SuiteConfig, inputs: FrozenInputs) -> List[str]:
    """Every way the frozen release suite differs from its ``RELEASE_SUITES.json`` entry."""
    cache_dir = Path(cache_dir)
    path = manifest_path(cache_dir)
    entry = _read(path)["suites"].get(suite.name)
    if entry is None:
        return [f"{path} has no entry for suite {suite.name}; run mode=prepare suite={suite.name}"]
    problems = []
    for rel, pinned in sorted(entry.get("sha256", {}).items()):
        file = cache_dir / rel
        if not file.is_file():
            problems.append(f"{file}: missing (pinned in {path})")
        elif file_sha256(file) != pinned:
            problems.append(f"{file}: sha256 differs from the one pinned in {path} (the file was edited)")
    expected = {_relative(p, cache_dir) for p in _pinned_files(cache_dir, inputs, cache_dir / entry["file"])}
    for rel in sorted(expected - set(entry.get("sha256", {}))):
        problems.append(f"{cache_dir / rel}: not pinned in {path}")
    order = [c.case_id for c in inputs.cases]
    if entry.get("order") != order:
        problems.append(f"{path}: suite {suite.name} case order {entry.get('order')} differs from the frozen "
                        f"inputs {order}")
    problems += _contract_problems(path, suite.name, entry.get("contract", {}), contract(suite, inputs))
    return problems


def _contract_problems(path: Path, name: str, pinned: Dict, now: Dict) -> List[str]:
    out = []
    for key in sorted(set(pinned) | set(now)):
        if pinned.get(key) != now.get(key):
            out.append(f"{path}: suite {name} execution contract {key} is {pinned.get(key)!r}, this run would use "
                       f"{now.get(key)!r}")
    return out


def check_release(cache_dir: Path, suite: SuiteConfig, inputs: FrozenInputs, write_missing: bool = True) -> Path:
    """Validate the suite against ``RELEASE_SUITES.json`` (before any engine starts); a suite not yet
    pinned is pinned now when ``write_missing``. Raises :class:`ReleaseError` listing every problem."""
    path = manifest_path(cache_dir)
    if write_missing and (not path.is_file() or suite.name not in _read(path)["suites"]):
        return write_release(cache_dir, suite, inputs)
    problems = release_problems(cache_dir, suite, inputs)
    if problems:
        raise ReleaseError(f"release suite {suite.name} does not match {path}:\n  - " + "\n  - ".join(problems)
                           + f"\nrestore the files, or re-freeze with mode=prepare suite={suite.name}")
    return path
