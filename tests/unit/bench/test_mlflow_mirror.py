"""mode=run mirrored to MLflow through the project's tracker (SQLite store in tmp_path), engine double."""
from redknot.bench.benchmark import BenchmarkRun
from redknot.bench.freeze import freeze
from redknot.config.schema import ModelConfig, TrackingConfig

from .support import answer_book, engine_setup, make_ctx, smoke_suite


def test_run_metrics_and_artifacts_reach_mlflow(tmp_path, tokenizer):
    import mlflow
    from redknot.tracking import open_tracker

    cache = tmp_path / "outputs" / "cache"
    inputs = freeze(smoke_suite(), ModelConfig(), cache).inputs
    ctx = make_ctx(tmp_path / "outputs" / "run", cache)
    uri = f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    ctx.cfg.tracking = TrackingConfig(enabled=True, uri=uri, experiment="bench-test")
    ctx.run_dir.mkdir(parents=True)
    with open_tracker(ctx) as tracker:
        tracker.exit_code = BenchmarkRun(ctx, tracker, engine_setup(tokenizer, answer_book(inputs), [])).execute()
    assert tracker.exit_code == 0

    client = mlflow.tracking.MlflowClient(uri)
    experiment = client.get_experiment_by_name("bench-test")
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = run.data.metrics
    assert metrics["score.hotpotqa"] == 50.0 and metrics["coverage"] == 1.0 and metrics["partial"] == 0.0
    assert abs(metrics["ttft_s.p50"] - 2048 * 1e-5) < 1e-9
    assert {"ttft_s.mean", "ttft_s.p90", "ttft_s.p99", "score.overall", "score.niah_single"} <= set(metrics)
    assert len(client.get_metric_history(run.info.run_id, "request.ttft_s")) == 10
    assert run.data.tags["bench.inputs_address"] == inputs.address
    names = {a.path for a in client.list_artifacts(run.info.run_id, "run_dir")}
    assert {"run_dir/records.jsonl", "run_dir/results.json", "run_dir/summary.csv", "run_dir/plots",
            "run_dir/inputs_manifest.json"} <= names
