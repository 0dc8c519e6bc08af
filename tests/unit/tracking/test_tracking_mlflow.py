"""The tracked run against a real temporary SQLite store: params, tags, artifacts, metrics, status."""
import socket
import subprocess

import pytest
import yaml

from redknot.config.hardware_fit import CONF_DIR
from redknot.tracking import NullTracker, open_tracker, tracking_uri
from tracking_testutil import client, make_ctx, runs


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tmp_path_factory.mktemp("store")


def leaves(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def only_run(root, name):
    (run,) = [r for r in runs(root) if r.info.run_name == name]
    return run


def test_params_tags_and_resolved_config(store):
    ctx = make_ctx(store, "mode=prepare", "model=tiny", "suite=64k", "features.dspark.max_draft=3")
    (ctx.run_dir / "manifest.json").write_text("{}")
    with open_tracker(ctx) as tracker:
        tracker.log_metrics({"ttft_s.p50": 1.5, "coverage": 1}, step=2)
    run = only_run(store, "prepare-tiny-64k-cpu")
    assert run.info.status == "FINISHED"

    params = run.data.params
    expected = leaves(yaml.safe_load(ctx.config_yaml))
    assert set(params) == set(expected)
    assert params["features.dspark.max_draft"] == "3" and params["suite.context_tokens"] == "65536"
    assert params["suite.datasets"] == '["hotpotqa", "2wikimqa", "musique", "narrativeqa", "triviaqa"]'
    assert params["suite.max_new_tokens"] == "{}" and params["model.path"] == "null"
    assert params["features.swa_replay.mode"] == "compact" and params["output.root"] == str(store)

    tags = run.data.tags
    sha = subprocess.run(["git", "-C", str(CONF_DIR.parent), "rev-parse", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    assert tags["git.sha"] == sha and tags["git.dirty"] in ("true", "false")
    assert tags["hydra.overrides"] == (f"output.root={store} mode=prepare model=tiny suite=64k "
                                       f"features.dspark.max_draft=3")
    assert tags["host.name"] == socket.gethostname()
    assert tags["device.accelerator"] == "cpu" and tags["device.name"]
    import torch
    assert tags["version.torch"] == torch.__version__ and tags["version.python"]
    assert tags["redknot.exit_code"] == "0"

    assert run.data.metrics == {"ttft_s.p50": 1.5, "coverage": 1.0}
    c = client(store)
    assert c.get_metric_history(run.info.run_id, "coverage")[0].step == 2
    local = c.download_artifacts(run.info.run_id, "config/resolved.yaml", str(store / "dl"))
    assert open(local).read() == ctx.config_yaml
    assert [a.path for a in c.list_artifacts(run.info.run_id, "run_dir")] == ["run_dir/manifest.json"]
    assert run.info.artifact_uri.startswith((store / "mlflow-artifacts").as_uri())


def test_metrics_are_written_in_batches_and_long_values_in_full(store):
    ctx = make_ctx(store, "mode=validate", "tracking.run_name=batched")
    with open_tracker(ctx) as tracker:
        tracker.log_metrics({f"case.{i}.score": float(i) for i in range(1500)})
        tracker.log_params({"notes": {"long": "z" * 7000}})
    run = only_run(store, "batched")
    assert len(run.data.metrics) == 1500 and run.data.metrics["case.1499.score"] == 1499.0
    assert run.data.params["notes.long"].startswith("<7000 characters, over MLflow's limit")
    assert run.data.tags["redknot.params_elided"] == '["notes.long"]'
    local = client(store).download_artifacts(run.info.run_id, "params/notes.long.txt", str(store / "dl2"))
    assert open(local).read() == "z" * 7000


def test_failures_end_the_run_failed_and_keep_the_run_dir(store):
    ctx = make_ctx(store, "mode=prepare", "tracking.run_name=crashed")
    (ctx.run_dir / "records.jsonl").write_text("{}\n")
    with pytest.raises(RuntimeError):
        with open_tracker(ctx):
            raise RuntimeError("out of memory")
    run = only_run(store, "crashed")
    assert run.info.status == "FAILED" and run.data.tags["redknot.exit_code"] == "exception"
    assert [a.path for a in client(store).list_artifacts(run.info.run_id, "run_dir")] == ["run_dir/records.jsonl"]

    ctx = make_ctx(store, "mode=prepare", "tracking.run_name=exit3")
    with open_tracker(ctx) as tracker:
        tracker.exit_code = 3
    run = only_run(store, "exit3")
    assert run.info.status == "FAILED" and run.data.tags["redknot.exit_code"] == "3"


def test_legacy_translation_is_recorded(store):
    ctx = make_ctx(store, "mode=prepare", "legacy_env=translate", "tracking.run_name=legacy",
                   environ={"DEEPINFER_BATCH_INVARIANT": "1"})
    with open_tracker(ctx):
        pass
    run = only_run(store, "legacy")
    assert run.data.tags["legacy_env.DEEPINFER_BATCH_INVARIANT"] == "features.batch_invariant.enabled=true"
    assert run.data.params["legacy_env"] == "translate"
    assert run.data.params["features.batch_invariant.enabled"] == "true"


def test_disabled_tracking_writes_nothing(tmp_path):
    ctx = make_ctx(tmp_path, "mode=prepare", "tracking.enabled=false")
    with open_tracker(ctx) as tracker:
        tracker.log_metrics({"x": 1.0})
    assert isinstance(tracker, NullTracker)
    assert not (tmp_path / "mlflow.db").exists()


def test_tracking_uri_precedence(tmp_path):
    default = f"sqlite:///{tmp_path}/mlflow.db"
    assert tracking_uri(None, str(tmp_path), environ={}) == default
    assert tracking_uri(None, str(tmp_path), environ={"MLFLOW_TRACKING_URI": "http://mlflow:5000"}) == \
        "http://mlflow:5000"
    assert tracking_uri("sqlite:////data/runs.db", str(tmp_path), environ={"MLFLOW_TRACKING_URI": "x"}) == \
        "sqlite:////data/runs.db"
