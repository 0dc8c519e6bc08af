"""``torchrun -m redknot`` on two CPU processes: rank 0 runs the suite and is the only rank that
writes records and an MLflow run (with the layout and every rank's metrics); the other rank serves.
A rank 0 that never builds an engine releases the waiting worker instead of leaving it hanging."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

# The smoke suite cut to its three synthetic datasets, one short case each.
SUITE = ["suite.samples_per_dataset=1", "suite.context_tokens=512", "suite.warmup_requests=0",
         "suite.datasets=[niah_single,niah_multikey,variable_tracking]", "suite.default_max_new_tokens=4"]


def torchrun(cwd: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--tee=3",
           "-m", "redknot", *overrides]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_torchrun_suite_records_once_with_layout_and_rank_metrics(tmp_path):
    import mlflow

    out = tmp_path / "outputs"
    # model=tiny: the V4 family (tiny-v41 under the same layout: test_v41_ep.py)
    run = torchrun(tmp_path, f"output.root={out}", "model=tiny", "features.parallel.dp=2", "features.parallel.ep=2",
                   *SUITE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"suite smoke~[0-9a-f]{6}: 3/3 cases", run.stdout)  # the smoke suite, cut: a derived name
    (records_file,) = [p for p in out.glob("*/*/records.jsonl")]  # one run directory holds records
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert len(records) == 3 and {r["status"] for r in records} == {"ok"}
    assert {r["dp_rank"] for r in records} == {0, 1}
    assert all(r["ttft_s"] > 0 for r in records)  # worker times are on the front's clock

    client = mlflow.tracking.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlrun.info.status == "FINISHED"
    tags, metrics = mlrun.data.tags, mlrun.data.metrics
    assert (tags["parallel.world_size"], tags["parallel.dp"], tags["parallel.ep"]) == ("2", "2", "2")
    assert tags["parallel.ep_comm"] == "all_to_all" and tags["parallel.backend"] == "gloo"
    for rank in (0, 1):
        assert metrics[f"rank{rank}.prefill_tokens"] > 0
        assert metrics[f"rank{rank}.ep.routed_pairs"] > 0
    assert metrics["rank0.ep.forwards"] == metrics["rank1.ep.forwards"] > 0
    assert metrics["rank0.prefill_tokens"] + metrics["rank1.prefill_tokens"] == 3 * 512


def test_front_without_engine_releases_the_worker(tmp_path):
    # The 64k suite needs the full LongBench data: rank 0 stops while building its inputs.
    run = torchrun(tmp_path, f"output.root={tmp_path / 'outputs'}", "suite=64k", "features.parallel.dp=2",
                   "tracking.enabled=false", timeout=300)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "filler runs out" in text
    assert "rank 1 has nothing to serve" in text
