"""mode=run with the engine double: records, scores, resume, report files."""
import csv
import json

import pytest

from redknot.bench.benchmark import BenchmarkRun
from redknot.bench.freeze import freeze
from redknot.bench.records import RECORDS_FILE, read_records
from redknot.config.schema import ModelConfig

from .support import answer_book, engine_setup, make_ctx, smoke_suite


@pytest.fixture()
def cache(tmp_path):
    return tmp_path / "outputs" / "cache"


def _book(cache):
    return answer_book(freeze(smoke_suite(), ModelConfig(), cache).inputs)


def _run(tmp_path, cache, name, tokenizer, book, engines=None, **fake):
    from redknot.tracking.base import NullTracker

    ctx = make_ctx(tmp_path / name, cache)
    engines = [] if engines is None else engines
    return BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, book, engines, **fake)).execute(), ctx.run_dir


def _scores(run_dir):
    records, problems = read_records(run_dir / RECORDS_FILE)
    assert not problems
    return {r["case_id"]: (r["status"], r["score"], r["prediction"]) for r in records}, records


def test_full_run_records_scores_and_report(tmp_path, cache, tokenizer):
    book = _book(cache)
    engines = []
    code, run_dir = _run(tmp_path, cache, "full", tokenizer, book, engines)
    assert code == 0
    scores, records = _scores(run_dir)
    assert len(records) == 10 and len(scores) == 10
    # Row 0 of every dataset gets the right answer, row 1 a wrong one (hand-derived expectations):
    # qa_f1 of the answer itself is 1; contains_all of all answers is 1; "no idea" shares no token.
    for case_id, (status, score, _) in scores.items():
        assert status == "ok"
        assert score == (1.0 if case_id.endswith("-0000") else 0.0), case_id
    results = json.loads((run_dir / "results.json").read_text())
    assert results["partial"] is False and results["completed"] == results["total"] == 10
    assert results["datasets"]["hotpotqa"]["score"] == 50.0 and results["overall_score"] == 50.0
    assert results["ttft_s"]["p50"] == pytest.approx(2048 * 1e-5)
    rows = list(csv.DictReader(open(run_dir / "summary.csv")))
    assert [r["dataset"] for r in rows][-1] == "overall" and len(rows) == 6
    # every prompt has the same length: a TTFT-vs-context scatter would be one column of points
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == ["score_per_dataset.png", "ttft_per_case.png"]
    assert (run_dir / "plots" / "ttft_per_case.png").stat().st_size > 1000
    # warm-up ran first on the engine and left no record
    assert engines[0].active_log[0] == ["warmup:niah_single-0000"]
    assert all(not r["case_id"].startswith("warmup") for r in records)


def test_interrupted_run_resumes_to_identical_scores(tmp_path, cache, tokenizer):
    book = _book(cache)
    code, full_dir = _run(tmp_path, cache, "uninterrupted", tokenizer, book)
    assert code == 0
    expected, _ = _scores(full_dir)

    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, cache, "interrupted", tokenizer, book, interrupt_after=4 + 1)  # 1 warm-up + 4 cases
    partial, records = _scores(tmp_path / "interrupted")
    assert len(records) == 4
    assert json.loads((tmp_path / "interrupted" / "results.json").read_text())["partial"] is True

    engines = []
    code, resumed_dir = _run(tmp_path, cache, "resumed", tokenizer, book, engines)
    assert code == 0
    scores, records = _scores(resumed_dir)
    assert len(records) == 10 and len({r["case_id"] for r in records}) == 10
    assert scores == expected
    # the resumed engine saw only the 6 missing cases (plus the warm-up)
    ran = {r for active in engines[0].active_log for r in active if r.startswith("case:")}
    assert ran == {f"case:{c}" for c in expected if c not in partial}

    # A finished config is measured again, not resumed.
    code, again = _run(tmp_path, cache, "again", tokenizer, book)
    assert code == 0 and len(_scores(again)[1]) == 10


def test_failed_cases_are_recorded_partial_and_nonzero(tmp_path, cache, tokenizer):
    book = _book(cache)
    code, run_dir = _run(tmp_path, cache, "oom", tokenizer, book, fail={"case:hotpotqa-0001": "oom"})
    assert code == 1
    scores, records = _scores(run_dir)
    assert len(records) == 10 and scores["hotpotqa-0001"][0] == "oom"
    results = json.loads((run_dir / "results.json").read_text())
    assert results["partial"] is True and results["completed"] == 9
    assert results["datasets"]["hotpotqa"]["partial"] is True
    assert results["datasets"]["hotpotqa"]["score"] == 100.0  # scored over its one ok case
    assert results["status_counts"] == {"ok": 9, "oom": 1}


def test_engine_that_does_not_start_is_reported_with_its_message(tmp_path, cache, monkeypatch, capsys):
    from redknot.bench import app
    from redknot.tracking.base import NullTracker

    def refuse(cfg):
        raise RuntimeError("hardware=sm100 needs accelerator cuda, but this machine has no accelerator")

    monkeypatch.setattr(app, "build_engine", refuse)
    ctx = make_ctx(tmp_path / "run", cache)
    assert app.run(ctx, NullTracker()) == 2
    assert "the engine did not start: RuntimeError: hardware=sm100 needs accelerator cuda" in capsys.readouterr().out
    results = json.loads((ctx.run_dir / "results.json").read_text())
    assert results["completed"] == 0 and results["partial"] is True


def test_a_resumed_run_is_linked_to_the_run_it_resumes(tmp_path, cache, tokenizer):
    import mlflow

    from redknot.config.schema import TrackingConfig
    from redknot.tracking import open_tracker

    book = _book(cache)
    uri = f"sqlite:///{tmp_path / 'outputs' / 'mlflow.db'}"
    run_ids = []
    for name, fake in (("first", {"interrupt_after": 4}), ("second", {})):
        ctx = make_ctx(tmp_path / name, cache)
        ctx.cfg.tracking = TrackingConfig(enabled=True, uri=uri, experiment="resume")
        ctx.run_dir.mkdir(parents=True)
        try:
            with open_tracker(ctx) as tracker:
                run_ids.append(tracker.run_id)
                tracker.exit_code = BenchmarkRun(ctx, tracker, engine_setup(tokenizer, book, [], **fake)).execute()
        except KeyboardInterrupt:
            pass
    second = mlflow.tracking.MlflowClient(uri).get_run(run_ids[1])
    assert second.data.tags["bench.resumed_from_run_id"] == run_ids[0]
    assert second.data.tags["bench.resumed_from_dir"] == str(tmp_path / "first")


def test_a_resumed_sweep_reports_a_finished_job_without_an_engine(tmp_path, cache, tokenizer):
    from redknot.config.sweep_files import SWEEP_RESUME_FILE

    book = _book(cache)
    code, first_dir = _run(tmp_path, cache, "first", tokenizer, book)
    assert code == 0
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / SWEEP_RESUME_FILE).write_text("{}")
    engines = []
    ctx = make_ctx(sweep / "0", cache)
    ctx.sweep_dir = sweep
    from redknot.tracking.base import NullTracker

    assert BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, book, engines)).execute() == 0
    assert engines == []  # nothing was measured again
    assert _scores(ctx.run_dir)[0] == _scores(first_dir)[0]
    # outside a resumed sweep, the same finished config is measured again
    code, again = _run(tmp_path, cache, "again", tokenizer, book)
    assert code == 0 and len(_scores(again)[1]) == 10


def test_an_engine_that_does_not_start_does_not_suggest_resuming(tmp_path, cache, monkeypatch, capsys):
    from redknot.bench import app
    from redknot.config.schema import HardwareConfig
    from redknot.config.hardware_fit import load_hardware_options
    from redknot.tracking.base import NullTracker

    ctx = make_ctx(tmp_path / "run", cache)
    ctx.cfg.hardware = load_hardware_options()["sm100"]  # this CPU machine has no B200
    assert isinstance(ctx.cfg.hardware, HardwareConfig)
    assert app.run(ctx, NullTracker()) == 2
    out = capsys.readouterr().out.replace("\n", " ")
    assert "rerun" not in out and "the engine did not start, so no case ran" in out
    assert "hardware=sm100 needs accelerator cuda" in out and "hardware=cpu" in out
    assert "pip install" not in out  # the device is the problem, not a missing kernel package
