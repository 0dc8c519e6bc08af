"""The release protocol with the engine double: ten short-answer then presentation cases, hot TTFT,
RELEASE_SUITES.json written by prepare and checked before any engine starts."""
import json

import pytest

from redknot.bench import app
from redknot.bench.benchmark import BenchmarkRun
from redknot.bench.freeze import freeze
from redknot.bench.records import RECORDS_FILE, read_records
from redknot.bench.release import ReleaseError, manifest_path
from redknot.config.schema import ModelConfig
from redknot.tracking.base import NullTracker

from .support import answer_book, engine_setup, make_ctx, smoke_suite, squash

RELEASE = dict(name="release_smoke", samples_per_dataset=2, presentation_cases=5, presentation_max_new_tokens=30,
               warmup_requests=1, warmup_repeats=2, measured_repeats=3, release=True)


@pytest.fixture()
def cache(tmp_path):
    return tmp_path / "outputs" / "cache"


def _prepare(tmp_path, cache, suite):
    assert app.prepare(make_ctx(tmp_path / "prepare", cache, suite), NullTracker()) == 0
    return freeze(suite, ModelConfig(), cache).inputs


def test_ten_short_answer_cases_then_five_presentation_cases(tmp_path, cache):
    inputs = _prepare(tmp_path, cache, smoke_suite(**RELEASE))
    roles = [c.role for c in inputs.cases]
    assert roles == ["short"] * 10 + ["presentation"] * 5
    presentation = inputs.cases[10:]
    assert [c.dataset for c in presentation] == ["niah_single", "niah_multikey", "variable_tracking", "hotpotqa",
                                                 "triviaqa"]
    assert all(c.max_new_tokens == 30 and c.row_index == 2 for c in presentation)
    # the short-answer cases are exactly the suite without presentation cases
    plain = freeze(smoke_suite(**{**RELEASE, "presentation_cases": 0}), ModelConfig(), cache).inputs
    assert [c.ids_sha256 for c in plain.cases] == [c.ids_sha256 for c in inputs.cases[:10]]

    pinned = json.loads(manifest_path(cache).read_text())["suites"]["release_smoke"]
    assert pinned["order"] == [c.case_id for c in inputs.cases]
    assert pinned["contract"]["short_answer_cases"] == 10 and pinned["contract"]["presentation_cases"] == 5
    assert pinned["contract"]["measured_repeats"] == 3 and pinned["contract"]["warmup_repeats"] == 2
    assert pinned["file"] == "release/release_smoke_15case.jsonl"
    assert len(pinned["sha256"]) == 2 + len({c.ids_sha256 for c in inputs.cases})  # case list + manifest + ids
    lines = (cache / pinned["file"]).read_text().splitlines()
    assert [json.loads(line)["case_id"] for line in lines] == pinned["order"]


def test_hot_ttft_and_presentation_cases_in_a_release_run(tmp_path, cache, tokenizer):
    suite = smoke_suite(**RELEASE)
    inputs = _prepare(tmp_path, cache, suite)
    engines = []
    ctx = make_ctx(tmp_path / "run", cache, suite)
    assert BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, answer_book(inputs), engines)).execute() == 0
    records, _ = read_records(ctx.run_dir / RECORDS_FILE)
    assert len(records) == 15 and all(len(r["ttft_repeats_s"]) == 3 for r in records)
    # the engine double's clock: a 2,048-token prefill costs 2048 * 1e-5 s, every repetition alike
    assert all(r["ttft_s"] == pytest.approx(2048e-5) and r["ttft_p95_s"] == pytest.approx(2048e-5) for r in records)
    seen = [r for step in engines[0].active_log for r in step]
    first = inputs.cases[0].case_id
    assert [r for r in dict.fromkeys(seen) if first in r and r.startswith("case:")] == [
        f"case:{first}#warm0", f"case:{first}#warm1", f"case:{first}#rep0", f"case:{first}#rep1", f"case:{first}"]
    assert max(len(step) for step in engines[0].active_log) == 1  # one request at a time: no queueing in a TTFT
    results = json.loads((ctx.run_dir / "results.json").read_text())
    assert results["ttft_hot_s"]["count"] == 45 and results["completed"] == 15 and results["total"] == 15
    # row 0 of each dataset right, row 1 wrong -> 50 per dataset; the presentation rows (row 2: right) do not count
    assert results["overall_score"] == 50.0
    assert [p["case_id"] for p in results["presentation"]] == [c.case_id for c in inputs.cases[10:]]
    assert all(p["prediction"] for p in results["presentation"])


def test_an_edited_release_file_fails_before_any_engine_starts(tmp_path, cache, tokenizer):
    suite = smoke_suite(**RELEASE)
    _prepare(tmp_path, cache, suite)
    case_list = cache / "release" / "release_smoke_15case.jsonl"
    case_list.write_text(case_list.read_text().replace("niah_single-0001", "niah_single-0009", 1))
    engines = []
    ctx = make_ctx(tmp_path / "run", cache, suite)
    with pytest.raises(ReleaseError) as err:
        BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, {}, engines)).execute()
    assert f"{case_list}: sha256 differs" in str(err.value)
    assert engines == []


def test_a_changed_execution_contract_is_refused(tmp_path, cache, tokenizer, capsys):
    _prepare(tmp_path, cache, smoke_suite(**RELEASE))
    changed = smoke_suite(**{**RELEASE, "measured_repeats": 2})
    ctx = make_ctx(tmp_path / "run", cache, changed)
    assert app.run(ctx, NullTracker()) == 2
    out = squash(capsys.readouterr().out)
    assert squash("execution contract measured_repeats is 3, this run would use 2") in out
