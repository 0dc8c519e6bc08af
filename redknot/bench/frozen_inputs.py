"""The frozen-input store: token ids + manifest, content-addressed, under ``<output.cache_dir>/inputs``.

Layout of one entry::

    inputs/<address>/manifest.json     header (suite, tokenizer, sources, key) + one entry per case
    inputs/<address>/manifest.sha256   sha256 of manifest.json (any edit to the manifest is detected)
    inputs/<address>/ids/<sha256>.npy  one case's prompt ids (uint32), named by the sha256 of their bytes

``address`` is the sha256 of the key (:meth:`SuiteBuilder.key`): the suite's
parameters, the tokenizer's and every source file's sha256, and the builder,
template and generator versions. Preparing twice reuses the entry; a changed
input gives a new address. Entries are written to a temporary directory and
renamed into place, so a crash never leaves a half-written entry behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np

from redknot.bench.suite import CaseEntry

MANIFEST = "manifest.json"
MANIFEST_SHA = "manifest.sha256"
FORMAT = "redknot-inputs/1"


def address_of(key: dict) -> str:
    """The store address of a key: the first 20 hex digits of the sha256 of its canonical JSON."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class FrozenInputs:
    """A loaded store entry: the manifest header, the case entries and where the ids live."""
    directory: Path
    header: dict
    cases: List[CaseEntry]

    @property
    def address(self) -> str:
        return self.header["address"]

    def ids_path(self, case: CaseEntry) -> Path:
        return self.directory / "ids" / f"{case.ids_sha256}.npy"

    def load_ids(self, case: CaseEntry) -> np.ndarray:
        return np.load(self.ids_path(case), allow_pickle=False)  # [num_tokens] uint32

    def by_id(self) -> Dict[str, CaseEntry]:
        return {case.case_id: case for case in self.cases}


class InputStore:
    """Frozen inputs under ``<cache_dir>/inputs``."""

    def __init__(self, cache_dir: Path):
        self.root = Path(cache_dir) / "inputs"

    def path(self, address: str) -> Path:
        return self.root / address

    def exists(self, address: str) -> bool:
        directory = self.path(address)
        return (directory / MANIFEST).is_file() and (directory / MANIFEST_SHA).is_file()

    def write(self, address: str, header: dict, cases: Iterable[Tuple[CaseEntry, np.ndarray]]) -> FrozenInputs:
        """Freeze ``cases`` under ``address`` (atomically); an existing entry wins a race."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{address}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "ids").mkdir(parents=True)
        entries: List[CaseEntry] = []
        try:
            for entry, ids in cases:
                path = tmp / "ids" / f"{entry.ids_sha256}.npy"
                if not path.exists():
                    np.save(path, np.ascontiguousarray(ids, dtype="<u4"), allow_pickle=False)
                entries.append(entry)
            manifest = dict(header, format=FORMAT, address=address, created_unix=time.time(),
                            num_cases=len(entries), cases=[e.to_json() for e in entries])
            data = json.dumps(manifest, indent=1, ensure_ascii=False).encode()
            (tmp / MANIFEST).write_bytes(data)
            (tmp / MANIFEST_SHA).write_text(hashlib.sha256(data).hexdigest() + "\n")
            try:
                os.rename(tmp, self.path(address))
            except OSError:
                if not self.exists(address):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return self.load(address)

    def load(self, address: str) -> FrozenInputs:
        return load_entry(self.path(address))

    def set_aside(self, address: str) -> Path:
        """Move a damaged entry out of the way (kept for inspection) so that it can be rebuilt."""
        target = self.root / ".damaged" / f"{address}-{int(time.time())}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.path(address), target)
        return target

    def disk_bytes(self, address: str) -> int:
        return sum(p.stat().st_size for p in self.path(address).rglob("*") if p.is_file())


def load_entry(directory: Path) -> FrozenInputs:
    """Read one store entry (integrity: :mod:`redknot.bench.integrity` on reuse, :mod:`redknot.bench.validate`
    in full); an unreadable manifest raises ``InputsError`` naming it."""
    from redknot.bench.integrity import InputsError, read_manifest

    manifest = read_manifest(Path(directory) / MANIFEST)
    try:
        cases = [CaseEntry.from_json(obj) for obj in manifest.pop("cases")]
    except (TypeError, KeyError, ValueError) as err:
        raise InputsError(f"{Path(directory) / MANIFEST}: a case entry does not fit ({err})") from None
    return FrozenInputs(directory=Path(directory), header=manifest, cases=cases)


def manifest_sha_mismatch(directory: Path) -> Optional[str]:
    """A message when ``manifest.json`` no longer matches the sha256 written next to it."""
    data = (Path(directory) / MANIFEST).read_bytes()
    recorded = (Path(directory) / MANIFEST_SHA).read_text().strip()
    actual = hashlib.sha256(data).hexdigest()
    if recorded != actual:
        return f"{Path(directory) / MANIFEST}: sha256 {actual} differs from the recorded {recorded} (manifest edited)"
    return None
