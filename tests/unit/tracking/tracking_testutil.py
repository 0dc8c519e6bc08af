"""Helpers for tracking tests: a resolved RunContext on the real conf/, MLflow stores in tmp dirs."""
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import redknot.config.schema_store  # noqa: F401
from redknot.config.hardware_fit import CONF_DIR
from redknot.config.resolve import resolve

APP = Path(__file__).with_name("tracked_app.py")
FORKED = Path(__file__).with_name("forked_apps.py")


def make_ctx(root: Path, *overrides, environ=None):
    """A resolved context writing under ``root``, with a fresh run directory of its own."""
    import tempfile

    overrides = [f"output.root={root}", *overrides]
    (root / "runs").mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(dir=root / "runs"))
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
        return resolve(cfg, run_dir=run_dir, overrides=overrides, environ=environ or {}, cwd=root)


def client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")


def runs(root: Path, experiment="redknot"):
    c = client(root)
    exp = c.get_experiment_by_name(experiment)
    return [] if exp is None else c.search_runs([exp.experiment_id], max_results=1000)


def start_app(*args, cwd: Path):
    """Start tracked_app.py (the real conf/, resolve, tracker and sweep callback) in a subprocess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "MLFLOW_"))}
    return subprocess.Popen([sys.executable, str(APP), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def start_forked(jobs, cwd: Path, timeout: int = 300):
    """Run tracked_app.py once per argument list in ``jobs``, all at once: processes forked from one
    interpreter that has imported the app (forked_apps.py). -> [[exit code, output], ...] in job order."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "MLFLOW_"))}
    spec = cwd / "forked_apps.json"
    spec.write_text(json.dumps({"cwd": str(cwd), "jobs": jobs}))
    try:
        proc = subprocess.run([sys.executable, str(FORKED), str(spec)], check=False, cwd=cwd, env=env, text=True,
                              capture_output=True, timeout=timeout)
    finally:
        spec.unlink()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
