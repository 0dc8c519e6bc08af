"""Runs left RUNNING by a process that died (SIGKILL, OOM killer, a lost node).

Every run records the host, the process id and that process's start time. When a new run
starts on the same store, :func:`close_stale_runs` looks at the RUNNING runs of its experiment
that were started on this host: a run whose process no longer exists (or whose pid now belongs
to a younger process) is marked KILLED, tagged with who found it. Runs from other hosts are left
alone (their processes cannot be seen from here).
"""
from __future__ import annotations

import os
import socket
from typing import Dict, List, Optional

HOST_TAG, PID_TAG, PID_START_TAG = "redknot.host", "redknot.pid", "redknot.pid_start"


def process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot, from /proc), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return fields[19]  # field 22 of stat; the first two (pid, comm) were split off
    except (OSError, IndexError):
        return None


def process_tags() -> Dict[str, str]:
    pid = os.getpid()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(pid), PID_START_TAG: process_start(pid) or ""}


def is_dead(tags: Dict[str, str]) -> bool:
    """True when the run's process is known to be gone (same host, pid absent or reused)."""
    if tags.get(HOST_TAG) != socket.gethostname() or not tags.get(PID_TAG, "").isdigit():
        return False
    started = process_start(int(tags[PID_TAG]))
    return started is None or (bool(tags.get(PID_START_TAG)) and started != tags[PID_START_TAG])


def close_stale_runs(client, experiment_id: str, current_run_id: str) -> List[str]:
    """Mark this host's RUNNING runs whose process died KILLED; return their ids."""
    runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=1000)
    closed = []
    for run in runs:
        if run.info.run_id == current_run_id or not is_dead(run.data.tags):
            continue
        client.set_tag(run.info.run_id, "redknot.stale",
                       f"process {run.data.tags.get(PID_TAG)} on {run.data.tags.get(HOST_TAG)} is gone; marked "
                       f"KILLED when run {current_run_id} started")
        client.set_terminated(run.info.run_id, "KILLED")
        closed.append(run.info.run_id)
    return closed
