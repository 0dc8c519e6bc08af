"""Frozen inputs are checked every time they are reused: an edited token, an edited answer, a truncated
manifest or a deleted ids file is rebuilt (or, for a release suite, refused) with the path named, before
any engine starts."""
import json

import numpy as np
import pytest

from redknot.bench import app
from redknot.bench.freeze import freeze
from redknot.bench.integrity import InputsError
from redknot.bench.records import RECORDS_FILE, read_records
from redknot.bench.frozen_inputs import MANIFEST
from redknot.config.schema import ModelConfig
from redknot.tracking.base import NullTracker

from .support import answer_book, make_ctx, smoke_suite, squash

SUITE = dict(context_tokens=1024, datasets=["niah_single", "hotpotqa"], samples_per_dataset=2, warmup_requests=0)


@pytest.fixture()
def cache(tmp_path):
    return tmp_path / "outputs" / "cache"


@pytest.fixture()
def frozen(cache):
    return freeze(smoke_suite(**SUITE), ModelConfig(), cache)


def _flip_token(inputs, index=1):
    case = inputs.cases[index]
    path = inputs.ids_path(case)
    ids = np.load(path)
    ids[100] ^= 1
    np.save(path, ids)
    return case, path


def _edit_answer(inputs, index=2):
    path = inputs.directory / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["cases"][index]["answers"] = ["an edited answer"]
    path.write_text(json.dumps(manifest, indent=1))
    return path


    monkey = engine_setup(tokenizer, book, engines)
    return app.run.__wrapped__(ctx, NullTracker(), monkey) if hasattr(app.run, "__wrapped__") else None


def test_run_rebuilds_an_edited_ids_file_and_scores_against_the_true_prompt(tmp_path, cache, frozen, tokenizer,
                                                                             capsys):
    from redknot.bench.benchmark import BenchmarkRun

    from .support import engine_setup

    book = answer_book(frozen.inputs)
    case, path = _flip_token(frozen.inputs)
    engines = []
    ctx = make_ctx(tmp_path / "run", cache, smoke_suite(**SUITE))
    assert BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, book, engines)).execute() == 0
    out = squash(capsys.readouterr().out)
    assert squash(f"frozen inputs at {frozen.inputs.directory} failed their check; rebuilding") in out
    assert squash(f"{path}: content sha256") in out
    records, _ = read_records(ctx.run_dir / RECORDS_FILE)
    # every prompt the engine saw is the true one again: the engine double found each in its answer book
    assert len(records) == 4 and all(r["prediction_raw"] != "unknown prompt" for r in records)


def test_run_rebuilds_a_manifest_whose_answer_was_edited(tmp_path, cache, frozen, tokenizer, capsys):
    from redknot.bench.benchmark import BenchmarkRun

    from .support import engine_setup

    book = answer_book(frozen.inputs)
    manifest = _edit_answer(frozen.inputs)
    ctx = make_ctx(tmp_path / "run", cache, smoke_suite(**SUITE))
    assert BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, book, [])).execute() == 0
    assert squash(f"{manifest}: sha256") in squash(capsys.readouterr().out)
    stored = json.loads(manifest.read_text())["cases"][2]["answers"]
    assert stored != ["an edited answer"]


@pytest.mark.parametrize("mode", ["prepare", "run", "validate"])
def test_a_truncated_manifest_is_a_clean_message_in_every_mode(tmp_path, cache, frozen, tokenizer, monkeypatch,
                                                             capsys, mode):
    from .fake_engine import FakeLLM

    path = frozen.inputs.directory / MANIFEST
    path.write_bytes(path.read_bytes()[:500])
    monkeypatch.setattr(app, "build_engine", lambda cfg: FakeLLM(tokenizer, lambda ids: "x"))
    ctx = make_ctx(tmp_path / "run", cache, smoke_suite(**SUITE))
    code = getattr(app, mode)(ctx, NullTracker())
    out = squash(capsys.readouterr().out)
    assert "JSONDecodeError" not in out and "Traceback" not in out
    assert str(path) in out
    if mode == "validate":
        assert code == 1 and squash("is not valid JSON") in out  # the damage is the finding
    else:
        assert code == 0 and squash("failed their check; rebuilding") in out  # rebuilt from the sources


def test_prepare_repairs_a_deleted_ids_file_instead_of_saying_reused(tmp_path, cache, frozen, capsys):
    case = frozen.inputs.cases[3]
    frozen.inputs.ids_path(case).unlink()
    ctx = make_ctx(tmp_path / "run", cache, smoke_suite(**SUITE))
    assert app.prepare(ctx, NullTracker()) == 0
    out = squash(capsys.readouterr().out)
    assert squash(f"{frozen.inputs.ids_path(case)}: missing") in out
    assert squash("rebuilt (the stored copy was damaged)") in out
    assert frozen.inputs.ids_path(case).is_file()


def test_a_release_suite_refuses_damaged_inputs_before_the_engine_starts(tmp_path, cache, tokenizer, capsys):
    from redknot.bench.benchmark import BenchmarkRun

    from .support import engine_setup

    suite = smoke_suite(**SUITE, release=True)
    inputs = freeze(suite, ModelConfig(), cache).inputs
    case, path = _flip_token(inputs)
    engines = []
    ctx = make_ctx(tmp_path / "run", cache, suite)
    with pytest.raises(InputsError) as err:
        BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, {}, engines)).execute()
    assert str(path) in str(err.value) and "mode=prepare suite=smoke" in str(err.value)
    assert engines == []  # no engine was built
