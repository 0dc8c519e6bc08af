"""Cheap checks of a frozen-input entry before it is reused (hashes only; no re-tokenizing).

:func:`entry_problems` lists what is wrong with one store entry: a manifest that
is missing, unreadable or no longer matches the sha256 recorded beside it, and
ids files that are missing or whose content no longer matches the sha256 they
are named by. ``mode=prepare`` and ``mode=run`` call it on every reuse: a
damaged entry is rebuilt (it is content-addressed, so rebuilding gives the same
bytes), or refused where the inputs must stay frozen (release suites); either
way the message names the path. ``mode=validate`` still re-derives everything.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List

import numpy as np

from redknot.bench.datasets import DataError


class InputsError(DataError):
    """Frozen inputs that are damaged (edited, truncated or missing files); the message names the path."""


def _ids_sha(path: Path) -> str:
    ids = np.load(path, allow_pickle=False)
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<u4").tobytes()).hexdigest()


def read_manifest(path: Path) -> dict:
    """``manifest.json`` parsed, or :class:`InputsError` naming the file and what is wrong."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputsError(f"{path} is missing") from None
    try:
        manifest = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputsError(f"{path} is not valid JSON ({err}; truncated or edited)") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("cases"), list):
        raise InputsError(f"{path} has no list of cases (not a RedKnot inputs manifest)")
    return manifest


def entry_problems(directory: Path) -> List[str]:
    """Everything wrong with the entry at ``directory`` (empty: it can be reused)."""
    from redknot.bench.frozen_inputs import MANIFEST, MANIFEST_SHA

    directory = Path(directory)
    manifest_path, sha_path = directory / MANIFEST, directory / MANIFEST_SHA
    try:
        manifest = read_manifest(manifest_path)
    except InputsError as err:
        return [str(err)]
    problems = []
    recorded = sha_path.read_text().strip() if sha_path.is_file() else None
    actual = hashlib.sha256(manifest_path.read_bytes()).hexdigest()
    if recorded != actual:
        problems.append(f"{manifest_path}: sha256 {actual[:16]}… differs from the recorded "
                        f"{(recorded or 'none')[:16]}… (manifest edited)")
    for case in manifest["cases"]:
        sha = case.get("ids_sha256", "")
        path = directory / "ids" / f"{sha}.npy"
        if not path.is_file():
            problems.append(f"{path}: missing (ids of case {case.get('case_id')})")
            continue
        try:
            content = _ids_sha(path)
        except (OSError, ValueError) as err:
            problems.append(f"{path}: unreadable ({err})")
            continue
        if content != sha:
            problems.append(f"{path}: content sha256 {content[:16]}… does not match its name "
                            f"(ids of case {case.get('case_id')} edited)")
    return problems
