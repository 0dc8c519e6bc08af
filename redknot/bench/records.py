"""Per-request records: one JSON line per finished case, appended and flushed as it finishes.

A record is final when its status is ``ok``, ``error``, ``timeout`` or
``oom``: rerunning the same config skips those cases. ``skipped`` marks a case
the run did not attempt (the engine stopped before reaching it); a rerun tries
it again and its new record supersedes the skipped one.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

RECORDS_FILE = "records.jsonl"
RECORD_VERSION = 1
STATUSES = ("ok", "error", "timeout", "oom", "skipped")
FINAL_STATUSES = ("ok", "error", "timeout", "oom")


@dataclass
class RequestRecord:
    """Everything measured and scored for one case (times in seconds, engine-side clocks)."""
    case_id: str
    dataset: str
    row_id: str
    suite: str
    status: str
    prompt_tokens: int
    max_new_tokens: int
    ids_sha256: str
    inputs_address: str
    config_hash: str
    git_sha: str
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    dp_rank: int = 0
    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    queue_s: Optional[float] = None
    prefill_tok_s: Optional[float] = None
    decode_tok_s: Optional[float] = None
    draft_proposed: int = 0
    draft_accepted: int = 0
    accept_len: Optional[float] = None
    peak_memory_bytes: Optional[int] = None       # device memory; None where the device has no counter (CPU)
    role: str = "short"                           # "presentation": long-answer case, not in the accuracy aggregate
    arm: Optional[str] = None                     # mode=compare: which arm ran it
    ttft_repeats_s: List[float] = field(default_factory=list)  # hot TTFT: every measured repetition
    ttft_p95_s: Optional[float] = None            # hot TTFT p95 (ttft_s is then the p50)
    prediction_raw: str = ""
    prediction: str = ""
    metric: str = ""
    score: Optional[float] = None
    scores: Dict[str, float] = field(default_factory=dict)
    finished_unix: float = 0.0
    record_version: int = RECORD_VERSION

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"record status={self.status!r}; allowed: {', '.join(STATUSES)}")


class RecordWriter:
    """Appends records to ``records.jsonl``; each line is flushed and synced before the next case."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_tail(self.path)
        self._handle = open(self.path, "a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._handle.write(json.dumps(asdict(record), ensure_ascii=False) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_torn_tail(path: Path) -> None:
    """A crash mid-write can leave a last line without its newline; cut it so appends stay line-aligned."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with open(path, "r+b") as handle:
        handle.truncate(keep)


def read_records(path: Path) -> Tuple[List[dict], List[str]]:
    """(records, problems): every complete line parsed; a torn last line or a bad line is a problem."""
    path = Path(path)
    if not path.is_file():
        return [], []
    records, problems = [], []
    data = path.read_text(encoding="utf-8")
    lines = data.split("\n")
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if line_no == len(lines):
            problems.append(f"{path}, line {line_no}: incomplete last line (the run stopped while writing)")
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            problems.append(f"{path}, line {line_no}: not valid JSON ({err.msg})")
    return records, problems


def latest_by_case(records: Iterable[dict]) -> Dict[str, dict]:
    """The record that counts for each case: the last final one, else the last one."""
    out: Dict[str, dict] = {}
    for record in records:
        case_id = record.get("case_id")
        current = out.get(case_id)
        if current is None or record.get("status") in FINAL_STATUSES or current.get("status") not in FINAL_STATUSES:
            out[case_id] = record
    return out


def finished_case_ids(records: Iterable[dict]) -> set:
    return {case_id for case_id, r in latest_by_case(records).items() if r.get("status") in FINAL_STATUSES}
