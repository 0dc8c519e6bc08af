"""Check frozen inputs and result directories; every difference is listed with the case it concerns.

Inputs: the manifest still matches its recorded sha256; its key matches the
key derived now from the config, tokenizer and sources; every case re-derived
from the sources equals the stored one bit for bit (ids and every manifest
field); every prompt is exactly the target length; gold spans lie inside it;
ids files match the sha256 they are named by.

Results: every record names a case of the manifest with matching ids, length
and dataset; no case is recorded twice; ok records re-score to their stored
score; the stored aggregates equal those recomputed from the records.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from redknot.bench.aggregate import aggregate
from redknot.bench.freeze import progress_callback
from redknot.bench.frozen_inputs import FrozenInputs, address_of, manifest_sha_mismatch
from redknot.bench.records import FINAL_STATUSES, RECORDS_FILE, STATUSES, read_records
from redknot.bench.report import RESULTS_FILE
from redknot.bench.scoring import score_prediction
from redknot.bench.suite import CaseEntry, SuiteBuilder, ids_sha256


@dataclass
class ValidationReport:
    """What was checked, what differs (→ non-zero exit) and notes that are not failures."""
    checked_cases: int = 0
    checked_records: int = 0
    differences: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def extend(self, other: "ValidationReport") -> None:
        self.checked_cases += other.checked_cases
        self.checked_records += other.checked_records
        self.differences += other.differences
        self.notes += other.notes


def _first_difference(stored: np.ndarray, derived: np.ndarray) -> str:
    if len(stored) != len(derived):
        return f"{len(stored)} tokens stored, {len(derived)} derived"
    index = int(np.flatnonzero(stored != derived)[0])
    return f"token {index} is {int(stored[index])} stored, {int(derived[index])} derived"


def _diff_key(stored: dict, derived: dict, prefix: str = "") -> List[str]:
    out = []
    for name in sorted(set(stored) | set(derived)):
        a, b = stored.get(name), derived.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff_key(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(f"manifest key {prefix}{name}: stored {a!r}, derived now {b!r}")
    return out


def _check_stored_ids(inputs: FrozenInputs, case: CaseEntry, target: int) -> tuple:
    """(ids or None, differences) for a stored case on its own (no sources needed)."""
    path = inputs.ids_path(case)
    if not path.is_file():
        return None, [f"case {case.case_id}: ids file {path.name} is missing"]
    ids = inputs.load_ids(case)
    problems = []
    if ids.dtype != np.uint32:
        problems.append(f"case {case.case_id}: ids stored as {ids.dtype}, expected uint32")
    if ids_sha256(ids) != case.ids_sha256:
        problems.append(f"case {case.case_id}: ids file content does not match its sha256 name {case.ids_sha256[:16]}…")
    if len(ids) != target or case.num_tokens != target:
        problems.append(f"case {case.case_id}: {len(ids)} tokens stored (manifest says {case.num_tokens}), "
                        f"target {target}")
    for start, end in case.gold_spans:
        if not 0 <= start <= end <= len(ids):
            problems.append(f"case {case.case_id}: gold span [{start}, {end}) lies outside the {len(ids)}-token prompt")
    return ids, problems


def _compare_case(stored: CaseEntry, derived: CaseEntry, stored_ids: Optional[np.ndarray],
                  derived_ids: np.ndarray) -> List[str]:
    out = []
    for f in fields(CaseEntry):
        a, b = getattr(stored, f.name), getattr(derived, f.name)
        if a != b:
            out.append(f"case {stored.case_id}: {f.name} stored {a!r}, derived {b!r}")
    if stored_ids is not None and not np.array_equal(stored_ids, derived_ids):
        out.append(f"case {stored.case_id}: ids differ from the re-derived prompt "
                   f"({_first_difference(stored_ids, derived_ids)})")
    if stored_ids is not None:
        for start, end in derived.gold_spans:
            if not np.array_equal(stored_ids[start:end], derived_ids[start:end]):
                out.append(f"case {stored.case_id}: gold span [{start}, {end}) does not hold the gold tokens")
    return out


def validate_inputs(builder: SuiteBuilder, inputs: FrozenInputs, console=None) -> ValidationReport:
    """Re-derive every case with ``builder`` and compare with ``inputs`` (see the module docstring)."""
    report = ValidationReport()
    mismatch = manifest_sha_mismatch(inputs.directory)
    if mismatch:
        report.differences.append(mismatch)
    key = builder.key()
    report.differences += _diff_key(inputs.header.get("key", {}), key)
    if inputs.address != address_of(key) or inputs.directory.name != inputs.address:
        report.differences.append(f"address {inputs.address} (directory {inputs.directory.name}) is not the "
                                  f"address {address_of(key)} of the key derived now")
    target = builder.suite.context_tokens
    stored_cases: Dict[str, CaseEntry] = {}
    for case in inputs.cases:
        if case.case_id in stored_cases:
            report.differences.append(f"case {case.case_id}: listed twice in the manifest")
        stored_cases[case.case_id] = case
    seen = set()
    with progress_callback(console) as progress:
        for derived, derived_ids in builder.build(progress):
            seen.add(derived.case_id)
            stored = stored_cases.get(derived.case_id)
            if stored is None:
                report.differences.append(f"case {derived.case_id}: derived from the sources but not in the manifest")
                continue
            stored_ids, problems = _check_stored_ids(inputs, stored, target)
            report.differences += problems
            report.differences += _compare_case(stored, derived, stored_ids, derived_ids)
            report.checked_cases += 1
    for case_id in sorted(set(stored_cases) - seen):
        report.differences.append(f"case {case_id}: in the manifest but not derived from the sources")
    return report


def _check_record(record: dict, case: Optional[CaseEntry], line: int, inputs: FrozenInputs) -> List[str]:
    where = f"record {line} (case {record.get('case_id')})"
    if case is None:
        return [f"{where}: no such case in the manifest {inputs.address}"]
    out = []
    expected = {"dataset": case.dataset, "ids_sha256": case.ids_sha256, "prompt_tokens": case.num_tokens,
                "inputs_address": inputs.address}
    for name, value in expected.items():
        if record.get(name) != value:
            out.append(f"{where}: {name} is {record.get(name)!r}, the manifest says {value!r}")
    if record.get("status") not in STATUSES:
        out.append(f"{where}: status {record.get('status')!r} is not one of {', '.join(STATUSES)}")
    if record.get("status") == "ok":
        scored = score_prediction(record.get("prediction_raw", ""), case.answers, case.metric, case.first_line_only)
        if record.get("score") is None or abs(scored.primary - record["score"]) > 1e-9:
            out.append(f"{where}: score {record.get('score')!r} but its prediction re-scores to {scored.primary!r}")
    return out


def validate_results(run_dir: Path, inputs: FrozenInputs) -> ValidationReport:
    """Check ``run_dir``'s records (and results.json, when present) against the manifest of ``inputs``."""
    report = ValidationReport()
    records, problems = read_records(Path(run_dir) / RECORDS_FILE)
    report.differences += problems
    cases = inputs.by_id()
    final_seen: Dict[str, int] = {}
    for line, record in enumerate(records, start=1):
        report.differences += _check_record(record, cases.get(record.get("case_id")), line, inputs)
        if record.get("status") in FINAL_STATUSES:
            if record.get("case_id") in final_seen:
                report.differences.append(f"record {line} (case {record.get('case_id')}): the case already has a "
                                          f"final record (line {final_seen[record['case_id']]})")
            final_seen.setdefault(record.get("case_id"), line)
        report.checked_records += 1
    results_path = Path(run_dir) / RESULTS_FILE
    derived = aggregate(records, inputs.cases)
    if results_path.is_file():
        stored = json.loads(results_path.read_text())
        for name in ("completed", "total", "partial", "overall_score", "status_counts"):
            if stored.get(name) != derived[name]:
                report.differences.append(f"{RESULTS_FILE}: {name} is {stored.get(name)!r}, the records give "
                                          f"{derived[name]!r}")
        for name, block in derived["datasets"].items():
            if stored.get("datasets", {}).get(name, {}).get("score") != block["score"]:
                report.differences.append(f"{RESULTS_FILE}: datasets.{name}.score differs from the records "
                                          f"({block['score']!r})")
    else:
        report.notes.append(f"{results_path} is missing (the run stopped before its report)")
    if derived["partial"]:
        report.notes.append(f"partial: {derived['completed']}/{derived['total']} cases have an ok record "
                            f"(statuses {derived['status_counts']})")
    return report
