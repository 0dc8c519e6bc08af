"""Start several tracked_app.py processes at once, each a fork of one interpreter that has already imported
the app and its tracking stack (MLflow, SQLAlchemy, Hydra): the processes race on the store from the same
instant, without each paying the imports.

``python tests/unit/tracking/forked_apps.py SPEC.json`` where SPEC.json is ``{"cwd": DIR, "jobs": [[arg, ...],
...]}``. Each job is one process running ``tracked_app.py arg ...`` (its own ``sys.argv``, its output in a file
of its own). Prints one JSON line: ``[[exit code, output], ...]`` in job order.
"""
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tracked_app
from mlflow.store.tracking import sqlalchemy_store  # noqa: F401  (what the tracker loads on first use)

import redknot.tracking.mlflow_tracker  # noqa: F401


def run_job(args, out_path: str) -> None:
    """In the forked child: the app's ``__main__`` block with ``args`` as its command line, its output to
    ``out_path``; the child ends as the app's process does (exit code, traceback, exit handlers)."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.argv = [str(HERE / "tracked_app.py"), *args]
    tracked_app.main()
    sys.exit(tracked_app.exit_code())


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.chdir(spec["cwd"])
    logs = tempfile.mkdtemp(prefix="forked-apps-")
    children = []
    for i, args in enumerate(spec["jobs"]):
        path = os.path.join(logs, f"job{i}.txt")
        pid = os.fork()
        if pid == 0:  # the child never returns here: it exits with the app (no cleanup of ours on its way)
            run_job(args, path)
        children.append((pid, path))
    results = []
    for pid, path in children:
        _, status = os.waitpid(pid, 0)
        results.append([os.waitstatus_to_exitcode(status), Path(path).read_text()])
    shutil.rmtree(logs)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
