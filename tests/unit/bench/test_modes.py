"""Mode bodies: prepare / validate / catalog never import torch or the engine; catalog shows what it should."""
import json
import subprocess
import sys
import textwrap

import pytest

from rich.console import Console

from redknot.bench.catalog import show_catalog
from redknot.config.hardware_fit import CONF_DIR

_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from redknot.bench import app
    from redknot.config.resolve import RunContext
    from redknot.config.schema import OutputConfig, RedKnotConfig, SuiteConfig
    from redknot.tracking.base import NullTracker

    root = Path(sys.argv[1])
    suite = SuiteConfig(context_tokens=1024, datasets=["niah_single", "hotpotqa"], samples_per_dataset=2)
    cfg = RedKnotConfig(suite=suite, output=OutputConfig(root=str(root), cache_dir=str(root / "cache")))
    ctx = RunContext(cfg=cfg, run_dir=root / "run", overrides=[], legacy_translation={}, config_yaml="",
                     choices={"suite": "smoke"})
    codes = [app.prepare(ctx, NullTracker()), app.prepare(ctx, NullTracker()), app.validate(ctx, NullTracker()),
             app.catalog(ctx)]
    leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("redknot.engine"))
    print("RESULT", codes, leaked)
""")


def test_prepare_validate_catalog_stay_free_of_torch_and_the_engine(tmp_path):
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESULT [0, 0, 0, 0] []" in out.stdout, out.stdout[-3000:]
    assert "built in" in out.stdout and "reused in" in out.stdout and "OK" in out.stdout
    assert "4 cases of 1,024 tokens" in out.stdout


def test_validate_without_prepared_inputs_exits_nonzero(tmp_path):
    from redknot.bench import app
    from redknot.config.resolve import RunContext
    from redknot.config.schema import OutputConfig, RedKnotConfig
    from redknot.tracking.base import NullTracker

    cfg = RedKnotConfig(output=OutputConfig(root=str(tmp_path), cache_dir=str(tmp_path / "cache")))
    ctx = RunContext(cfg=cfg, run_dir=tmp_path / "run", overrides=[], legacy_translation={}, config_yaml="")
    assert app.validate(ctx, NullTracker()) == 1


def test_catalog_lists_suites_datasets_families_models_and_hardware(tmp_path):
    console = Console(record=True, width=200)
    show_catalog(console, CONF_DIR, tmp_path / "cache", {"suite": "smoke", "hardware": "cpu"})
    text = console.export_text()
    for expected in ("131,072 (128K)", "450,560 (440K)", "2,048 (2K)", "niah_multikey", "qa_f1 (first line)",
                     "answer passage sits in", "tiny", "deepseek-v4-flash", "sm100", "ascend950", "runs here"):
        assert expected in text, expected
    rows = [line for line in text.splitlines() if line.startswith("│")]
    first_cells = {row.split("│")[1].strip(" *"): row for row in rows}
    family = [cell.strip() for cell in first_cells["deepseek_v4"].split("│")[1:-1]]
    assert family[1:3] == ["DeepseekV4ForCausalLM", "deepseek_v4"]
    assert {"tiny", "deepseek-v4-flash"} <= set(family[3].split(", "))
    hardware_rows = first_cells
    assert hardware_rows["sm100"].rstrip("│ ").endswith("no")
    assert hardware_rows["cpu"].rstrip("│ ").endswith("yes")


def test_catalog_shows_token_statistics_once_prepared(tmp_path, longbench_dir):
    from redknot.bench.freeze import freeze
    from redknot.config.schema import DataConfig, ModelConfig, SuiteConfig

    suite = SuiteConfig(name="smoke", context_tokens=1024, datasets=["triviaqa"], samples_per_dataset=3,
                        data=DataConfig(dir=str(longbench_dir)))
    result = freeze(suite, ModelConfig(), tmp_path / "cache")
    stats = json.loads((result.inputs.directory / "manifest.json").read_text())["datasets"]["triviaqa"]
    console = Console(record=True, width=250)
    show_catalog(console, CONF_DIR, tmp_path / "cache", {})
    text = console.export_text()
    assert f"{stats['source_rows']} rows; gold context tokens mean {stats['gold_tokens']['mean']:,.0f}" in text
    assert result.inputs.address in text


def test_generate_wraps_the_prompt_in_the_chat_template_and_prints_the_completion(tmp_path, monkeypatch,
                                                                                     tokenizer, capsys):
    from redknot.bench import app
    from redknot.config.resolve import RunContext
    from redknot.config.schema import OutputConfig, RedKnotConfig
    from redknot.tracking.base import NullTracker

    from .fake_engine import FakeLLM

    prompts = []

    def respond(ids):
        prompts.append(ids)
        return "Paris is the capital."

    monkeypatch.setattr(app, "build_engine", lambda cfg: FakeLLM(tokenizer, respond))
    cfg = RedKnotConfig(prompt="Capital of France?", output=OutputConfig(root=str(tmp_path),
                                                                          cache_dir=str(tmp_path / "cache")))
    ctx = RunContext(cfg=cfg, run_dir=tmp_path / "run", overrides=[], legacy_translation={}, config_yaml="")
    assert app.generate(ctx, NullTracker()) == 0
    assert "Paris is the capital." in capsys.readouterr().out
    (prompt,) = prompts
    assert prompt[:2] == [0, 128803] and prompt[-2:] == [128804, 128822]  # <bos><User> ... <Assistant></think>
    assert tokenizer.decode(prompt[2:-2]) == "Capital of France?"
    cfg.prompt = None
    assert app.generate(ctx, NullTracker()) == 2


def _generate_ctx(tmp_path, prompt, **model):
    from redknot.config.resolve import RunContext
    from redknot.config.schema import ModelConfig, OutputConfig, RedKnotConfig

    cfg = RedKnotConfig(prompt=prompt, output=OutputConfig(root=str(tmp_path), cache_dir=str(tmp_path / "cache")))
    for key, value in model.items():
        setattr(cfg.model, key, value)
    assert isinstance(cfg.model, ModelConfig)
    return RunContext(cfg=cfg, run_dir=tmp_path / "run", overrides=[], legacy_translation={}, config_yaml="")


def test_generate_saves_its_text_and_a_report(tmp_path, monkeypatch, tokenizer, capsys):
    from redknot.bench import app
    from redknot.tracking.base import NullTracker

    from .fake_engine import FakeLLM

    monkeypatch.setattr(app, "build_engine", lambda cfg: FakeLLM(tokenizer, lambda ids: "Paris."))
    ctx = _generate_ctx(tmp_path, "Capital of France?")
    assert app.generate(ctx, NullTracker()) == 0
    assert (ctx.run_dir / "generation.txt").read_text() == "Paris."
    saved = json.loads((ctx.run_dir / "generation.json").read_text())
    assert saved["prompt"] == "Capital of France?" and saved["finish_reason"] == "stop"
    assert "Paris." in (ctx.run_dir / "report.md").read_text()
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith(f"run directory: {ctx.run_dir}") and out[-1].startswith("MLflow: tracking disabled")


@pytest.mark.parametrize("case", ["model_path", "too_long", "not_utf8", "outside_vocab"])
def test_generate_refuses_bad_input_with_a_message_and_exit_2(tmp_path, monkeypatch, tokenizer, capsys, case):
    from redknot.bench import app
    from redknot.tracking.base import NullTracker

    from .fake_engine import FakeLLM
    from .support import squash

    class RefusesIds(FakeLLM):  # what the engine does with ids its model has no embedding for
        def add_request(self, req_id, prompt_token_ids, params):
            raise ValueError(f"request {req_id!r}: prompt_token_ids has [129279]; token ids must be ints in "
                             f"[0, 1000)")

    prompt, model = "Capital of France?", {}
    if case == "model_path":
        model = {"path": str(tmp_path / "no-such-checkpoint")}  # the real engine factory, failing at its start
    else:
        monkeypatch.setattr(app, "build_engine", lambda cfg: (RefusesIds if case == "outside_vocab" else FakeLLM)(
            tokenizer, lambda ids: "x"))
    if case == "too_long":
        prompt, model = "word " * 300, {"max_position": 256}
    if case == "not_utf8":
        prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Python hands over a Latin-1 argument
    ctx = _generate_ctx(tmp_path, prompt, **model)
    assert app.generate(ctx, NullTracker()) == 2
    out = squash(capsys.readouterr().out)
    assert "Traceback" not in out
    expected = {"model_path": f"model.path='{tmp_path / 'no-such-checkpoint'}' is not a directory",
                "too_long": "exceed model.max_position=256", "not_utf8": "prompt is not valid UTF-8 text",
                "outside_vocab": "the engine refused the prompt: request"}[case]
    assert squash(expected) in out, out


def test_the_default_run_says_what_its_numbers_mean(tmp_path, tokenizer, capsys):
    from redknot.bench.benchmark import BenchmarkRun
    from redknot.bench.freeze import freeze
    from redknot.config.schema import ModelConfig, SyntheticModelConfig
    from redknot.tracking.base import NullTracker

    from .fake_engine import FakeLLM
    from .support import engine_setup, make_ctx, smoke_suite, squash

    class CpuEngine(FakeLLM):  # the CPU engine keeps no device-memory counter and, here, drafts nothing
        def stats(self):
            stats = super().stats()
            stats.peak_memory_bytes = 0
            return stats

    cache = tmp_path / "outputs" / "cache"
    suite = smoke_suite(datasets=["niah_single", "hotpotqa"], samples_per_dataset=1, warmup_requests=0)
    freeze(suite, ModelConfig(), cache)
    ctx = make_ctx(tmp_path / "run", cache, suite)
    ctx.cfg.model.synthetic = SyntheticModelConfig()
    setup = engine_setup(tokenizer, {}, [])
    setup.make_engine = lambda cfg: CpuEngine(tokenizer, lambda ids: "noise")
    assert BenchmarkRun(ctx, NullTracker(), setup).execute() == 0
    out = squash(capsys.readouterr().out)
    for expected in ("seeded random weights: its answers are noise and scores near 0 are expected",
                     "acceptance length n/a (nothing drafted)", "peak device memory n/a", "peak host memory",
                     "no score_per_dataset.png: every dataset score is 0"):
        assert squash(expected) in out, expected
    assert not (ctx.run_dir / "plots" / "score_per_dataset.png").exists()
    assert not (ctx.run_dir / "plots" / "ttft_vs_context.png").exists()  # one prompt length: one column of points
    assert (ctx.run_dir / "plots" / "ttft_per_case.png").is_file()


def test_a_long_suite_without_data_says_how_to_get_it_and_a_synthetic_one_needs_none(tmp_path, capsys):
    from redknot.bench import app
    from redknot.bench.freeze import freeze
    from redknot.bench.typed import load_yaml_option
    from redknot.config.schema import ModelConfig, SuiteConfig
    from redknot.tracking.base import NullTracker

    from .support import make_ctx, squash

    cache = tmp_path / "outputs" / "cache"
    suite = load_yaml_option(CONF_DIR / "suite" / "128k.yaml", SuiteConfig)
    assert app.prepare(make_ctx(tmp_path / "run", cache, suite), NullTracker()) == 2
    out = squash(capsys.readouterr().out)
    for hint in ("suite.data.download=true", "suite.data.dir=DIR", "suite=ruler_64k or ruler_128k"):
        assert squash(hint) in out, hint
    ruler = load_yaml_option(CONF_DIR / "suite" / "ruler_64k.yaml", SuiteConfig)
    ruler.samples_per_dataset = 1  # one case per task keeps the test short; the suite's own count is 5
    inputs = freeze(ruler, ModelConfig(), cache).inputs
    assert [c.num_tokens for c in inputs.cases] == [65536] * 4
    assert {c.dataset for c in inputs.cases} == {"niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"}
