"""Mode bodies: prepare / validate / catalog never import torch or the engine; catalog shows what it should."""
import json
import subprocess
import sys
import textwrap

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
