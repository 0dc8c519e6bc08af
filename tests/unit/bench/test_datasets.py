"""LongBench sources: directory and data.zip agree, sha256 pinning, malformed rows named by file/line/field."""
import hashlib
import json

import pytest

from redknot.bench import fixtures
from redknot.bench.datasets import SAMPLE_DIR, DataError, SourceReader, parse_rows
from redknot.bench.registry import get_spec
from redknot.bench.typed import load_yaml_option
from redknot.config.hardware_fit import CONF_DIR
from redknot.config.schema import DataConfig, SuiteConfig


def test_directory_and_archive_give_the_same_rows(tmp_path, longbench_dir):
    archive = fixtures.write_data_zip(tmp_path / "data.zip", "test", ["hotpotqa", "triviaqa"])
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    from_zip = SourceReader(DataConfig(archive=str(archive), sha256=digest.upper())).load("triviaqa")
    from_dir = SourceReader(DataConfig(dir=str(longbench_dir))).load("triviaqa")
    assert from_zip.rows == from_dir.rows and from_zip.sha256 == from_dir.sha256
    assert from_zip.archive_sha256 == digest and from_zip.origin.endswith("data.zip:data/triviaqa.jsonl")
    assert len(from_dir.rows) == 6 and from_dir.rows[0].answers


def test_archive_sha256_pin_is_enforced(tmp_path):
    archive = fixtures.write_data_zip(tmp_path / "data.zip", "test", ["hotpotqa"])
    with pytest.raises(DataError, match=r"suite.data.sha256='00ff' does not match .*data.zip"):
        SourceReader(DataConfig(archive=str(archive), sha256="00ff"))


def test_nothing_is_downloaded_unless_asked(tmp_path):
    with pytest.raises(DataError, match="suite.data.download=true to fetch it"):
        SourceReader(DataConfig(archive=str(tmp_path / "missing.zip")))


def test_missing_dataset_file_names_the_dataset(longbench_dir):
    with pytest.raises(DataError, match="no musique.jsonl"):
        SourceReader(DataConfig(dir=str(longbench_dir))).load("musique")


@pytest.mark.parametrize("line, message", [
    ('{"input": "q", "context": "c", "answers": ["a"]', "line 2: not valid JSON"),
    ('{"input": "q", "context": "c", "_id": "x2"}', "line 2: field 'answers' must be a non-empty list of strings"),
    ('{"input": "q", "context": "c", "answers": [], "_id": "x2"}', "line 2: field 'answers' must be a non-empty"),
    ('{"input": 3, "context": "c", "answers": ["a"], "_id": "x2"}', "line 2: field 'input' must be str, got int"),
    ('{"context": "c", "answers": ["a"], "_id": "x2"}', "line 2: field 'input' is missing"),
    ('{"input": "q", "context": "c", "answers": ["a"], "_id": "x1"}',
     "line 2: field '_id' = 'x1' repeats the row on line 1"),
    ('{"input": "q", "context": "c", "answers": ["a"], "_id": "x2", "length": "long"}', "line 2: field 'length'"),
    ('["a"]', "line 2: a row must be a JSON object"),
])
def test_malformed_rows_name_file_line_and_field(line, message):
    good = json.dumps({"input": "q", "context": "c", "answers": ["a"], "_id": "x1"})
    with pytest.raises(DataError) as err:
        parse_rows(f"{good}\n{line}\n".encode(), "hotpotqa.jsonl")
    assert str(err.value).startswith("hotpotqa.jsonl, line 2") and message in str(err.value)


def test_packaged_sample_is_what_the_fixture_generator_makes(tmp_path):
    names = sorted(p.stem for p in SAMPLE_DIR.glob("*.jsonl"))
    assert names == sorted(fixtures.PROFILES["smoke"].rows)
    fixtures.write_dataset_dir(tmp_path, "smoke", names)
    for name in names:
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (SAMPLE_DIR / f"{name}.jsonl").read_bytes(), name


def test_fixture_rows_state_their_answers():
    for dataset in fixtures.PROFILES["test"].rows:
        for row in fixtures.generate_rows(dataset, 5, 120, seed=3):
            text = row["context"] + row["input"]
            assert row["answers"][0] in text and row["length"] == len(row["context"].split())


def test_every_dataset_named_by_a_suite_config_is_known():
    for path in sorted((CONF_DIR / "suite").glob("*.yaml")):
        suite = load_yaml_option(path, SuiteConfig)
        for name in suite.datasets:
            assert get_spec(name).name, (path.name, name)
        for name in suite.max_new_tokens:
            assert name in suite.datasets, (path.name, name)


def test_unknown_dataset_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"suite.datasets: unknown dataset 'hotpot'; known datasets: 2wikimqa, "):
        get_spec("hotpot")


def test_download_goes_through_the_hub_client_only_when_asked(tmp_path, monkeypatch):
    import huggingface_hub

    calls = []
    made = fixtures.write_data_zip(tmp_path / "made" / "data.zip", "test", ["hotpotqa"])

    def fake_download(**kwargs):  # stands in for the network: the hub client's own function
        calls.append(kwargs)
        return str(made)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    with pytest.raises(DataError):
        SourceReader(DataConfig(archive=str(tmp_path / "absent.zip")), tmp_path / "cache")
    assert calls == []
    reader = SourceReader(DataConfig(download=True), tmp_path / "cache")
    assert calls == [{"repo_id": "THUDM/LongBench", "filename": "data.zip", "repo_type": "dataset",
                      "local_dir": str(tmp_path / "cache" / "longbench")}]
    assert len(reader.load("hotpotqa").rows) == 6 and reader.archive_sha256
