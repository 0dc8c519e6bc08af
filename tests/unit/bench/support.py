"""Helpers for the harness tests: a typed run context, a suite, answers for the engine double."""
from pathlib import Path
from typing import Dict, List, Optional

from redknot.bench.benchmark import RunSetup
from redknot.bench.frozen_inputs import FrozenInputs
from redknot.config.resolve import RunContext
from redknot.config.schema import DataConfig, OutputConfig, RedKnotConfig, SuiteConfig, TrackingConfig
from redknot.engine import SamplingParams

from .fake_engine import FakeLLM, prompt_key

SMOKE_DATASETS = ["niah_single", "niah_multikey", "variable_tracking", "hotpotqa", "triviaqa"]


def smoke_suite(**overrides) -> SuiteConfig:
    values = dict(name="smoke", context_tokens=2048, datasets=list(SMOKE_DATASETS), samples_per_dataset=2,
                  warmup_requests=1, request_timeout_s=600.0, data=DataConfig())
    values.update(overrides)
    return SuiteConfig(**values)


def make_ctx(run_dir: Path, cache_dir: Path, suite: Optional[SuiteConfig] = None, **cfg_overrides) -> RunContext:
    cfg = RedKnotConfig(suite=suite or smoke_suite(), output=OutputConfig(root=str(cache_dir.parent),
                                                                          cache_dir=str(cache_dir)),
                        tracking=TrackingConfig(enabled=False), **cfg_overrides)
    return RunContext(cfg=cfg, run_dir=Path(run_dir), overrides=[], legacy_translation={}, config_yaml="")


def answer_book(inputs: FrozenInputs, correct_every: int = 2) -> Dict[str, str]:
    """prompt key → the text the engine double answers: right for every ``correct_every``-th row, else wrong."""
    book = {}
    for case in inputs.cases:
        right = case.row_index % correct_every == 0
        if case.metric == "contains_all":
            text = ", ".join(case.answers) if right else "no idea"
        else:
            text = case.answers[0] if right else "no idea"
        book[prompt_key(inputs.load_ids(case))] = text
    return book


def engine_setup(tokenizer, book: Dict[str, str], engines: List[FakeLLM], **fake_kwargs) -> RunSetup:
    def make_engine(cfg):
        engine = FakeLLM(tokenizer, lambda ids: book.get(prompt_key(ids), "unknown prompt"), **fake_kwargs)
        engines.append(engine)
        return engine

    return RunSetup(make_engine=make_engine, make_params=lambda cfg: lambda n: SamplingParams(max_tokens=n))



def squash(text: str) -> str:
    """Text without any whitespace: console output wraps long lines (paths too) wherever it likes."""
    import re

    return re.sub(r"\s+", "", text)
