"""mode=compare with engine doubles: interleaving, per-case pairs, the quality gate, the files, MLflow runs."""
import copy
import json

import pytest

from redknot.bench.benchmark import RunSetup
from redknot.bench.compare import Comparison
from redknot.bench.freeze import freeze
from redknot.config.schema import ModelConfig, SwaReplayMode, TrackingConfig
from redknot.sample.params import SamplingParams

from .fake_engine import FakeLLM, prompt_key
from .support import answer_book, make_ctx, smoke_suite

SUITE = dict(context_tokens=1024, datasets=["niah_single", "hotpotqa"], samples_per_dataset=2, warmup_requests=0,
             warmup_repeats=1, measured_repeats=2)


class FastPrefill(FakeLLM):
    PREFILL_S_PER_TOKEN = FakeLLM.PREFILL_S_PER_TOKEN / 2


def _ctx(tmp_path, cache, max_drop=1.0):
    ctx = make_ctx(tmp_path / "run", cache, smoke_suite(**SUITE))
    ctx.cfg.compare.max_accuracy_drop = max_drop
    ctx.cfg.compare.baseline, ctx.cfg.compare.candidate = ["features.swa_replay.mode=off"], \
        ["features.swa_replay.mode=compact"]
    base, cand = copy.deepcopy(ctx.cfg), copy.deepcopy(ctx.cfg)
    base.features.swa_replay.mode = SwaReplayMode.off
    ctx.arms = {"replay_off": base, "replay_compact": cand}
    return ctx


def _setup(tokenizer, inputs, engines, candidate_wrong=()):
    book = answer_book(inputs, correct_every=1)  # the baseline answers everything right

    def make_engine(cfg):
        if cfg.features.swa_replay.mode == SwaReplayMode.off:
            engine = FakeLLM(tokenizer, lambda ids: book[prompt_key(ids)])
        else:
            wrong = {prompt_key(inputs.load_ids(c)) for c in inputs.cases if c.case_id in candidate_wrong}
            engine = FastPrefill(tokenizer,
                                 lambda ids: "no idea" if prompt_key(ids) in wrong else book[prompt_key(ids)])
        engines[cfg.features.swa_replay.mode.value] = engine
        return engine

    return RunSetup(make_engine, lambda cfg: lambda n: SamplingParams(max_tokens=n))


@pytest.fixture()
def cache(tmp_path):
    return tmp_path / "outputs" / "cache"


def test_paired_runs_interleave_per_case_and_report_speedup_and_outputs(tmp_path, cache, tokenizer):
    from redknot.tracking.base import NullTracker

    inputs = freeze(smoke_suite(**SUITE), ModelConfig(), cache).inputs
    engines = {}
    ctx = _ctx(tmp_path, cache)
    assert Comparison(ctx, NullTracker(), _setup(tokenizer, inputs, engines)).execute() == 0
    summary = json.loads((ctx.run_dir / "summary.json").read_text())
    assert summary["gate"]["passed"] and summary["gate"]["accuracy_delta"] == 0.0 and summary["complete"]
    assert [row["case_id"] for row in summary["cases"]] == [c.case_id for c in inputs.cases]
    for row in summary["cases"]:
        assert row["speedup"] == pytest.approx(2.0)  # the candidate's double prefills twice as fast
        assert row["same_output"] and row["baseline"]["prediction"] == row["candidate"]["prediction"]
        assert len(row["baseline"]["ttft_repeats_s"]) == 2
    assert summary["gate"]["speedup_p50"] == pytest.approx(2.0)
    # both engines stayed loaded; each served every case (1 warm-up + 1 TTFT-only + the scored run)
    for engine in engines.values():
        served = {r for step in engine.active_log for r in step}
        assert len(served) == 3 * len(inputs.cases)
    markdown = (ctx.run_dir / "comparison.md").read_text()
    assert "quality gate: **PASSED**" in markdown and "## Outputs side by side" in markdown
    for arm in ("replay_off", "replay_compact"):
        results = json.loads((ctx.run_dir / arm / "results.json").read_text())
        assert results["completed"] == results["total"] == len(inputs.cases)


def test_a_failed_quality_gate_keeps_every_result(tmp_path, cache, tokenizer):
    from redknot.tracking.base import NullTracker

    inputs = freeze(smoke_suite(**SUITE), ModelConfig(), cache).inputs
    ctx = _ctx(tmp_path, cache, max_drop=10.0)
    code = Comparison(ctx, NullTracker(), _setup(tokenizer, inputs, {}, candidate_wrong={"hotpotqa-0001"})).execute()
    assert code == 1
    summary = json.loads((ctx.run_dir / "summary.json").read_text())
    # hotpotqa drops from 100 to 50, niah_single stays at 100: overall 100 -> 75, a 25-point drop
    assert summary["gate"]["baseline_accuracy"] == 100.0 and summary["gate"]["candidate_accuracy"] == 75.0
    assert summary["gate"]["passed"] is False and summary["gate"]["accuracy_delta"] == -25.0
    assert "quality gate: **FAILED**" in (ctx.run_dir / "comparison.md").read_text()
    row = next(r for r in summary["cases"] if r["case_id"] == "hotpotqa-0001")
    assert row["candidate"]["prediction"] == "no idea" and not row["same_output"]


def test_one_parent_run_with_a_child_per_arm_linked_by_tags(tmp_path, cache, tokenizer):
    import mlflow

    from redknot.tracking import open_tracker

    inputs = freeze(smoke_suite(**SUITE), ModelConfig(), cache).inputs
    ctx = _ctx(tmp_path, cache)
    uri = f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    ctx.cfg.tracking = TrackingConfig(enabled=True, uri=uri, experiment="compare-test")
    ctx.run_dir.mkdir(parents=True)
    with open_tracker(ctx) as tracker:
        tracker.exit_code = Comparison(ctx, tracker, _setup(tokenizer, inputs, {})).execute()
    client = mlflow.tracking.MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("compare-test").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["compare.arm"]: r for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert set(children) == {"replay_off", "replay_compact"}
    assert {c.data.tags["mlflow.parentRunId"] for c in children.values()} == {parent.info.run_id}
    assert children["replay_off"].data.tags["compare.peer"] == "replay_compact"
    assert parent.data.tags["compare.baseline_run_id"] == children["replay_off"].info.run_id
    assert parent.data.tags["compare.gate"] == "passed"
    assert parent.data.metrics["compare.speedup_p50"] == pytest.approx(2.0)
    assert children["replay_off"].data.params["features.swa_replay.mode"] == "off"
    assert children["replay_compact"].data.params["features.swa_replay.mode"] == "compact"
    assert all(c.info.status == "FINISHED" for c in children.values()) and parent.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "compare")} == {
        "compare/summary.json", "compare/comparison.md"}
