"""Files a sweep's jobs and its launcher leave for each other in the sweep directory.

* ``jobs/<num>.json`` — each job's exit code (also for a job refused before it could open an
  MLflow run), read by the sweep callback to close the parent run honestly;
* ``sweep_resume.json`` — written by the callback when the sweep resumes an interrupted one:
  its jobs report finished work from its records instead of measuring it again.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

JOBS_DIR = "jobs"
SWEEP_RESUME_FILE = "sweep_resume.json"


def record_job_exit(sweep_dir: Path, job_num: int, code: int, error: Optional[str] = None) -> None:
    directory = Path(sweep_dir) / JOBS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{job_num}.json").write_text(json.dumps({"job": job_num, "exit_code": code, "error": error}))


def job_exits(sweep_dir: Path) -> Dict[int, int]:
    """``{job number: exit code}`` of the jobs that finished (a job killed mid-way left nothing)."""
    out = {}
    for path in (Path(sweep_dir) / JOBS_DIR).glob("*.json"):
        try:
            info = json.loads(path.read_text())
            out[int(info["job"])] = int(info["exit_code"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
