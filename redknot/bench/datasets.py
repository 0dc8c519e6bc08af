"""LongBench JSONL sources: a directory, the official ``data.zip``, or the packaged sample.

Where rows come from (``suite.data``): ``dir`` (``<dir>/<dataset>.jsonl``, or
``<dir>/data/<dataset>.jsonl`` for an unpacked archive), else ``archive`` (the
LongBench ``data.zip``; its sha256 is checked against ``sha256`` when given),
else the small LongBench-format sample RedKnot ships for the smoke suite.
Nothing is downloaded unless ``download=true``; then the archive is fetched
once into the cache through the Hugging Face hub client.

Each dataset's file bytes are hashed (sha256) and the hash goes into the
manifest of every case built from it. A malformed row stops loading with the
file, the line and the field.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from redknot.config.schema import DataConfig

SAMPLE_DIR = Path(__file__).parent / "data" / "longbench_sample"
LONGBENCH_REPO = "THUDM/LongBench"
LONGBENCH_ARCHIVE = "data.zip"


class DataError(ValueError):
    """A dataset source that is missing, does not match its pinned hash, or holds a malformed row."""


@dataclass(frozen=True)
class LongBenchRow:
    """One LongBench row (the fields the harness uses) and its position in the file."""
    index: int
    row_id: str
    input: str
    context: str
    answers: Tuple[str, ...]
    length: Optional[int]
    all_classes: Optional[Tuple[str, ...]]


@dataclass(frozen=True)
class DatasetSource:
    """A dataset's rows and where they came from: ``origin`` names the file (in the archive if any)."""
    dataset: str
    origin: str
    sha256: str
    archive_sha256: Optional[str]
    rows: Tuple[LongBenchRow, ...]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _field(obj: dict, name: str, kind, where: str):
    if name not in obj:
        raise DataError(f"{where}: field {name!r} is missing (LongBench rows need input, context, answers, _id)")
    value = obj[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {name!r} must be {kind.__name__}, got {type(value).__name__}: "
                        f"{str(value)[:60]!r}")
    return value


def _string_list(value, name: str, where: str, allow_empty: bool) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or (not value and not allow_empty):
        need = "a list of strings" if allow_empty else "a non-empty list of strings"
        raise DataError(f"{where}: field {name!r} must be {need}, got {str(value)[:60]!r}")
    return tuple(value)


def parse_rows(data: bytes, origin: str) -> Tuple[LongBenchRow, ...]:
    """Rows of one JSONL file; blank lines are skipped, anything malformed raises :class:`DataError`."""
    rows: List[LongBenchRow] = []
    seen = {}
    for line_no, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{origin}, line {line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a row must be a JSON object, got {type(obj).__name__}")
        row_id = _field(obj, "_id", str, where)
        if row_id in seen:
            raise DataError(f"{where}: field '_id' = {row_id!r} repeats the row on line {seen[row_id]}")
        seen[row_id] = line_no
        length = obj.get("length")
        if length is not None and not isinstance(length, int):
            raise DataError(f"{where}: field 'length' must be int or null, got {length!r}")
        classes = obj.get("all_classes")
        rows.append(LongBenchRow(
            index=len(rows), row_id=row_id, input=_field(obj, "input", str, where),
            context=_field(obj, "context", str, where),
            answers=_string_list(obj.get("answers"), "answers", where, allow_empty=False),
            length=length,
            all_classes=None if classes is None else _string_list(classes, "all_classes", where, allow_empty=True)))
    if not rows:
        raise DataError(f"{origin}: no rows")
    return tuple(rows)


def _archive_member(archive: zipfile.ZipFile, dataset: str) -> Optional[str]:
    wanted = f"{dataset}.jsonl"
    for name in archive.namelist():
        if name == wanted or name.endswith("/" + wanted):
            return name
    return None


def download_archive(cache_dir: Path) -> Path:
    """Fetch LongBench's ``data.zip`` through the hub client into ``<cache_dir>/longbench`` (once)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as err:  # pragma: no cover - huggingface_hub ships with transformers
        raise DataError("suite.data.download=true needs the huggingface_hub package (pip install huggingface_hub)") \
            from err
    target = cache_dir / "longbench"
    return Path(hf_hub_download(repo_id=LONGBENCH_REPO, filename=LONGBENCH_ARCHIVE, repo_type="dataset",
                                local_dir=str(target)))


class SourceReader:
    """Reads datasets from the location ``suite.data`` names (see the module docstring)."""

    def __init__(self, data: DataConfig, cache_dir: Optional[Path] = None):
        self.data = data
        self.archive: Optional[Path] = None
        self.archive_sha256: Optional[str] = None
        self.directory: Optional[Path] = None
        if data.dir:
            self.directory = Path(data.dir)
            if not self.directory.is_dir():
                raise DataError(f"suite.data.dir={data.dir!r} is not a directory")
        elif data.archive or data.download:
            self._open_archive(cache_dir)
        else:
            self.directory = SAMPLE_DIR

    def _open_archive(self, cache_dir: Optional[Path]) -> None:
        path = Path(self.data.archive) if self.data.archive else None
        if path is None or not path.is_file():
            if not self.data.download:
                raise DataError(f"suite.data.archive={self.data.archive!r} does not exist; give the path of "
                                "LongBench's data.zip, or set suite.data.download=true to fetch it")
            if cache_dir is None:
                raise DataError("suite.data.download=true needs output.cache_dir to store the archive")
            path = download_archive(cache_dir)
        self.archive = path
        self.archive_sha256 = _sha256(path.read_bytes())
        if self.data.sha256 and self.data.sha256.lower() != self.archive_sha256:
            raise DataError(f"suite.data.sha256={self.data.sha256!r} does not match {path} "
                            f"(sha256 {self.archive_sha256}); the archive changed or the pin is wrong")

    @property
    def description(self) -> str:
        if self.archive is not None:
            return str(self.archive)
        if self.directory == SAMPLE_DIR:
            return "the packaged LongBench-format sample"
        return str(self.directory)

    def _read_bytes(self, dataset: str) -> Tuple[bytes, str]:
        if self.archive is not None:
            with zipfile.ZipFile(self.archive) as archive:
                member = _archive_member(archive, dataset)
                if member is None:
                    raise DataError(f"{self.archive}: no {dataset}.jsonl in the archive (suite.datasets names it)")
                return archive.read(member), f"{self.archive}:{member}"
        for candidate in (self.directory / f"{dataset}.jsonl", self.directory / "data" / f"{dataset}.jsonl"):
            if candidate.is_file():
                return candidate.read_bytes(), str(candidate)
        raise DataError(f"{self.description}: no {dataset}.jsonl (suite.datasets names {dataset!r}; "
                        "set suite.data.dir or suite.data.archive to the LongBench data)")

    def load(self, dataset: str) -> DatasetSource:
        data, origin = self._read_bytes(dataset)
        return DatasetSource(dataset=dataset, origin=origin, sha256=_sha256(data),
                             archive_sha256=self.archive_sha256, rows=parse_rows(data, origin))

    def sha256(self, dataset: str) -> str:
        """The dataset file's sha256 without parsing it (cheap address computation)."""
        return _sha256(self._read_bytes(dataset)[0])
