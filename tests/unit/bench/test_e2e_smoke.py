"""End to end: ``python -m redknot`` (smoke suite, tiny model, CPU) then ``mode=validate`` on its run directory."""
import json
import subprocess
import sys
from pathlib import Path


def _redknot(cwd: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "redknot", *overrides], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_default_run_writes_records_report_plots_and_mlflow_run(tmp_path):
    import mlflow

    out = tmp_path / "outputs"
    # The embedded default, one case per dataset to keep the default test run short.
    run = _redknot(tmp_path, f"output.root={out}", "suite.samples_per_dataset=1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (meta,) = out.glob("*/*/bench_run.json")
    run_dir = meta.parent
    records = [json.loads(line) for line in (run_dir / "records.jsonl").read_text().splitlines()]
    assert len(records) == 5 and {r["status"] for r in records} == {"ok"}
    assert all(r["prompt_tokens"] == 2048 and r["ttft_s"] > 0 and r["completion_tokens"] > 0 for r in records)
    results = json.loads((run_dir / "results.json").read_text())
    assert results["completed"] == results["total"] == 5 and results["partial"] is False
    assert (run_dir / "summary.csv").is_file()
    assert {p.name for p in (run_dir / "plots").glob("*.png")} == {"ttft_vs_context.png", "score_per_dataset.png"}
    assert "suite smoke: 5/5 cases" in run.stdout

    client = mlflow.tracking.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlrun.info.status == "FINISHED"
    assert mlrun.data.metrics["completed"] == 5 and "ttft_s.p90" in mlrun.data.metrics
    assert mlrun.data.params["suite.name"] == "smoke"
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id, "run_dir")}
    assert {"run_dir/records.jsonl", "run_dir/results.json", "run_dir/plots"} <= artifacts

    check = _redknot(tmp_path, f"output.root={out}", "mode=validate", f"run_dir={run_dir}",
                     "tracking.enabled=false")
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert "OK (5 cases, 5 records)" in check.stdout
