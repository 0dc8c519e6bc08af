"""Frozen inputs: reuse and addressing, freeze → validate round trip, tampering caught and named."""
import json
import shutil

import numpy as np
import pytest

from redknot.bench.freeze import freeze, make_builder
from redknot.bench.frozen_inputs import MANIFEST
from redknot.bench.validate import validate_inputs, validate_results
from redknot.config.schema import DataConfig, ModelConfig

from .support import smoke_suite

SUITE_DATASETS = ["hotpotqa", "narrativeqa", "triviaqa", "niah_multivalue"]


@pytest.fixture()
def suite(longbench_dir):
    return smoke_suite(context_tokens=1024, datasets=SUITE_DATASETS, samples_per_dataset=3,
                       data=DataConfig(dir=str(longbench_dir)))


@pytest.fixture()
def frozen(suite, tmp_path):
    return freeze(suite, ModelConfig(), tmp_path / "cache")


def _validate(suite, inputs, tmp_path):
    return validate_inputs(make_builder(suite, ModelConfig(), tmp_path / "cache"), inputs)


def test_round_trip_passes(suite, frozen, tmp_path):
    assert not frozen.reused and len(frozen.inputs.cases) == 12
    report = _validate(suite, frozen.inputs, tmp_path)
    assert report.ok, report.differences
    assert report.checked_cases == 12
    header = frozen.inputs.header
    assert header["tokens_per_k"] == 1024 and header["target_tokens"] == 1024
    assert header["chat_template"] == "non_thinking" and header["tokenizer"]["sha256"]
    assert header["datasets"]["hotpotqa"]["source_rows"] == 6


def test_prepare_twice_reuses_and_a_changed_input_changes_the_address(suite, frozen, tmp_path, longbench_dir):
    again = freeze(suite, ModelConfig(), tmp_path / "cache")
    assert again.reused and again.inputs.address == frozen.inputs.address
    reseeded = freeze(smoke_suite(**{**suite.__dict__, "seed": 1}), ModelConfig(), tmp_path / "cache")
    assert reseeded.inputs.address != frozen.inputs.address and not reseeded.reused
    # one edited source row changes that dataset's sha256 and so the address
    path = longbench_dir.parent / "edited"
    shutil.copytree(longbench_dir, path)
    (path / "triviaqa.jsonl").write_text((path / "triviaqa.jsonl").read_text().replace("Answer:", "Answer :", 1))
    edited = freeze(smoke_suite(**{**suite.__dict__, "data": DataConfig(dir=str(path))}), ModelConfig(),
                    tmp_path / "cache")
    assert edited.inputs.address != frozen.inputs.address
    assert edited.inputs.header["key"]["sources"]["triviaqa"] != frozen.inputs.header["key"]["sources"]["triviaqa"]


def test_flipping_one_token_fails_naming_the_case(suite, frozen, tmp_path):
    inputs = frozen.inputs
    case = inputs.cases[4]
    path = inputs.ids_path(case)
    ids = np.load(path)
    ids[700] ^= 1
    path.chmod(0o644)
    np.save(path, ids)
    report = _validate(suite, inputs, tmp_path)
    assert not report.ok
    assert all(case.case_id in line for line in report.differences), report.differences
    assert any("token 700" in line for line in report.differences)
    assert any("does not match its sha256 name" in line for line in report.differences)


def test_flipping_one_manifest_byte_fails_naming_the_case(suite, frozen, tmp_path):
    inputs = frozen.inputs
    case = inputs.cases[7]
    manifest = inputs.directory / MANIFEST
    data = manifest.read_bytes()
    needle = f'"row_id": "{case.row_id}"'.encode()
    at = data.index(needle) + len(b'"row_id": "') + 3
    flipped = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
    manifest.write_bytes(flipped)
    from redknot.bench.frozen_inputs import load_entry

    report = _validate(suite, load_entry(inputs.directory), tmp_path)
    assert not report.ok
    assert any("manifest edited" in line for line in report.differences)
    assert any(line.startswith(f"case {case.case_id}: row_id") for line in report.differences), report.differences


def test_validation_catches_a_manifest_gold_span_that_lies(suite, frozen, tmp_path):
    inputs = frozen.inputs
    manifest = json.loads((inputs.directory / MANIFEST).read_text())
    manifest["cases"][2]["gold_spans"] = [[5000, 5010]]
    (inputs.directory / MANIFEST).write_text(json.dumps(manifest))
    from redknot.bench.frozen_inputs import load_entry

    report = _validate(suite, load_entry(inputs.directory), tmp_path)
    case_id = inputs.cases[2].case_id
    assert any(f"case {case_id}: gold span [5000, 5010) lies outside" in line for line in report.differences)


def test_results_directory_checked_against_the_manifest(tmp_path, tokenizer):
    from redknot.bench.benchmark import BenchmarkRun
    from redknot.bench.records import RECORDS_FILE
    from redknot.tracking.base import NullTracker

    from .support import answer_book, engine_setup, make_ctx

    cache = tmp_path / "outputs" / "cache"
    inputs = freeze(smoke_suite(), ModelConfig(), cache).inputs
    ctx = make_ctx(tmp_path / "run", cache)
    assert BenchmarkRun(ctx, NullTracker(), engine_setup(tokenizer, answer_book(inputs), [])).execute() == 0
    assert validate_results(ctx.run_dir, inputs).ok
    lines = (ctx.run_dir / RECORDS_FILE).read_text().splitlines()
    record = json.loads(lines[3])
    record["score"] = 0.5
    lines[3] = json.dumps(record)
    lines.append(lines[0])
    (ctx.run_dir / RECORDS_FILE).write_text("\n".join(lines) + "\n")
    report = validate_results(ctx.run_dir, inputs)
    assert any(f"record 4 (case {record['case_id']}): score 0.5 but its prediction re-scores" in d
               for d in report.differences), report.differences
    assert any("already has a final record" in d for d in report.differences)
    assert any(d.startswith("results.json: overall_score") or "datasets." in d for d in report.differences)


def test_prepare_reuses_tokenized_contexts_but_validate_does_not_trust_them(suite, tmp_path):
    from redknot.bench.tokcache import TokenCache

    cache = tmp_path / "cache"
    first = freeze(suite, ModelConfig(), cache)
    entries = sorted((cache / "tokens").glob("*.npz"))
    assert len(entries) == 3  # hotpotqa, narrativeqa, triviaqa (the synthetic set has no source file)
    # Damage one cached context, then prepare the same data at another length: the damage flows into
    # the new inputs, and validation (which tokenizes the sources afresh) reports the cases it touched.
    tokens = TokenCache(cache)
    key = entries[0].stem
    contexts = tokens.get(key)
    contexts[0] = contexts[0].copy()
    contexts[0][3] ^= 1
    tokens.put(key, contexts)
    other = smoke_suite(**{**suite.__dict__, "context_tokens": 1100})
    second = freeze(other, ModelConfig(), cache)
    assert second.inputs.address != first.inputs.address
    report = _validate(other, second.inputs, tmp_path)
    assert not report.ok and all(line.startswith("case ") for line in report.differences)
