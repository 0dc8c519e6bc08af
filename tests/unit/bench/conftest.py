"""Shared pieces for the harness tests: the real V4 tokenizer (loaded once) and fixture data made by the project."""
from functools import lru_cache
from pathlib import Path

import pytest

from redknot.bench import fixtures
from redknot.bench.tokenizer import load_tokenizer
from redknot.config.schema import ModelConfig


@lru_cache(maxsize=1)
def v4_tokenizer():
    return load_tokenizer(ModelConfig())


@pytest.fixture(scope="session")
def tokenizer():
    return v4_tokenizer()


@pytest.fixture(scope="session")
def longbench_dir(tmp_path_factory) -> Path:
    """LongBench-format files (test profile: 6 rows per dataset, short contexts) made by redknot.bench.fixtures."""
    out = tmp_path_factory.mktemp("longbench")
    fixtures.write_dataset_dir(out, "test", ["hotpotqa", "narrativeqa", "triviaqa", "multifieldqa_en"])
    return out
