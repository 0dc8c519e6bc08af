"""Multirun and parallel runs through the real entry path (compose -> resolve -> tracker ->
Hydra sweep callback), each in subprocesses on a fresh SQLite store."""
from tracking_testutil import client, runs, start_app, start_forked


def test_two_by_two_multirun_gives_one_parent_and_four_children(tmp_path):
    # seed=98 makes the job body raise: that job's run is FAILED, the sweep goes on, the process exits 1.
    proc = start_app("-m", f"output.root={tmp_path}", "seed=1,98", "suite.samples_per_dataset=1,3", cwd=tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out

    found = runs(tmp_path)
    parents = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 4, out
    parent = parents[0]
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parent.info.run_id}
    jobs = sorted((c.data.params["seed"], c.data.params["suite.samples_per_dataset"], c.info.status)
                  for c in children)
    assert jobs == [("1", "1", "FINISHED"), ("1", "3", "FINISHED"), ("98", "1", "FAILED"), ("98", "3", "FAILED")]
    assert sorted(c.data.tags["hydra.job.num"] for c in children) == ["0", "1", "2", "3"]
    assert parent.data.tags["sweep.children"] == "4" and parent.data.tags["sweep.children_failed"] == "2"
    assert parent.info.status == "FAILED"
    assert {c.data.tags["redknot.exit_code"] for c in children if c.info.status == "FAILED"} == {"exception"}
    assert out.count("RuntimeError: seed=98 plays a crashing job") == 2
    assert [a.path for a in client(tmp_path).list_artifacts(parent.info.run_id, "config")] == \
        ["config/multirun.yaml"]
    # Hydra wrote only under output.root: the sweep dir (microsecond timestamp), the store and the sweep registry.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mlflow-artifacts", "mlflow.db",
                                                          "mlflow.db.lock", "multirun"]
    (sweep_dir,) = tmp_path.glob("multirun/*/*")
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["0", "1", "2", "3", "jobs", "mlflow_parent_run.json",
                                                           "multirun.yaml"]


def test_eight_parallel_runs_on_a_fresh_store_lose_nothing(tmp_path):
    # Eight processes forked at once from one interpreter that has imported the app (forked_apps.py): each
    # runs the app's real entry path on the same fresh store, all starting from the same instant.
    results = start_forked([[f"output.root={tmp_path}", f"seed={seed}"] for seed in range(1, 9)], cwd=tmp_path)
    assert [code for code, _ in results] == [0] * 8, "\n".join(out for _, out in results)

    found = runs(tmp_path)
    assert sorted(int(r.data.params["seed"]) for r in found) == list(range(1, 9))
    assert {r.info.status for r in found} == {"FINISHED"}
    assert len(client(tmp_path).search_experiments()) == 2  # MLflow's "Default" and ours
    for run in found:
        assert run.data.metrics["job.seed"] == float(run.data.params["seed"])
    assert len({r.data.tags["run_dir"] for r in found}) == 8


def test_a_job_refused_before_its_run_opened_fails_the_sweep(tmp_path):
    # suite.samples_per_dataset=0 breaks a rule: that job never opens an MLflow run, yet the parent counts it.
    proc = start_app("-m", f"output.root={tmp_path}", "seed=1", "suite.samples_per_dataset=1,0", cwd=tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert "suite.samples_per_dataset=0: must be >= 1" in out
    found = runs(tmp_path)
    (parent,) = [r for r in found if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in found if "mlflow.parentRunId" in r.data.tags]
    assert len(children) == 1 and children[0].info.status == "FINISHED"
    assert parent.info.status == "FAILED"
    assert parent.data.tags["sweep.jobs"] == "2" and parent.data.tags["sweep.children_failed"] == "1"
    assert parent.data.tags["sweep.jobs_without_run"] == "1"
