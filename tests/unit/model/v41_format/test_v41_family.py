"""The V4.1 family behind the seam: registry detection, config parsing, the model options
(model=tiny-v41, model=deepseek-v4.1-flash), the seeded native checkpoint with its own
tokenizer, and the memory plan / refusal of a layout that cannot fit."""
import json
import os

import pytest
from hydra import compose, initialize_config_dir

import redknot.config.schema_store  # noqa: F401
from redknot.bench.typed import load_yaml_option
from redknot.config.hardware_fit import CONF_DIR
from redknot.config.resolve import resolve
from redknot.config.schema import FeaturesConfig, HardwareConfig, ModelConfig
from redknot.config.violations import ConfigError
from redknot.models.deepseek_v41.config import V41Config, synthetic_config, tiny_v41_config
from redknot.models.registry import FamilyError, detect_family, family_for, load_family

from .test_v41_config import RELEASED


def _resolved(tmp_path, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
        return resolve(cfg, run_dir=tmp_path / "run", overrides=list(overrides), environ={}, cwd=tmp_path)


def test_registry_detects_v41_checkpoints(tmp_path):
    assert detect_family(RELEASED).name == "deepseek_v41"
    assert detect_family({"model_type": "deepseek_v41_text"}).name == "deepseek_v41"
    v4 = tmp_path / "v4"
    v4.mkdir()
    (v4 / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"]}))
    with pytest.raises(FamilyError, match="set model.family=deepseek_v4"):
        family_for(ModelConfig(name="x", family="deepseek_v41", path=str(v4)))
    v41 = tmp_path / "v41"
    v41.mkdir()
    (v41 / "config.json").write_text(json.dumps(RELEASED))
    family = family_for(ModelConfig(name="x", family="deepseek_v41", path=str(v41)))
    assert family.name == "deepseek_v41"
    assert family.parse_config(str(v41)) == family.parse_config(RELEASED) == V41Config.flash()
    assert family.cost_model(V41Config.flash()).decode(1024).bytes > 0


def test_tiny_v41_option_is_the_parity_config():
    model = load_yaml_option(CONF_DIR / "model" / "tiny-v41.yaml", ModelConfig)
    assert model.family == "deepseek_v41" and model.synthetic.quantize_fp8
    cfg = synthetic_config(dict(model.synthetic.architecture), True)
    assert cfg == tiny_v41_config()
    assert model.sliding_window == cfg.window_size and model.max_position == cfg.max_position_embeddings


def test_model_options_compose_and_validate(tmp_path):
    ctx = _resolved(tmp_path, "model=tiny-v41")
    assert ctx.cfg.model.family == "deepseek_v41"
    with pytest.raises(ConfigError, match="model.path"):
        _resolved(tmp_path, "model=deepseek-v4.1-flash", "mode=run")
    ctx = _resolved(tmp_path, "model=deepseek-v4.1-flash", "mode=catalog")
    assert ctx.cfg.model.family == "deepseek_v41" and ctx.cfg.model.path is None


def test_seeded_checkpoint_carries_its_tokenizer(tmp_path):
    from redknot.models.deepseek_v41.weights import checkpoint_tokenizer_file, engram_token_map

    model = load_yaml_option(CONF_DIR / "model" / "tiny-v41.yaml", ModelConfig)
    family = load_family("deepseek_v41")
    path = family.write_synthetic_checkpoint(model, str(tmp_path))
    assert family.write_synthetic_checkpoint(model, str(tmp_path)) == path      # written once
    assert family.parse_config(path) == tiny_v41_config()
    tokenizer = checkpoint_tokenizer_file(None, path)
    assert tokenizer == os.path.join(path, "tokenizer.json")
    tmap = engram_token_map(tiny_v41_config(), tokenizer, str(tmp_path))
    assert tmap.size == 99092
    bad = tiny_v41_config().with_overrides({"engram_compressed_vocab_size": 99000})
    with pytest.raises(ValueError, match=r"'engram_compressed_vocab_size'=99000: must equal the size of the Engram "
                                         r"token map built from the tokenizer .*tokenizer\.json, which is 99092"):
        engram_token_map(bad, tokenizer, str(tmp_path))
    assert family.load_tokenizer(None).eos_id == tiny_v41_config().eos_token_id


def _flash_model():
    return load_yaml_option(CONF_DIR / "model" / "deepseek-v4.1-flash.yaml", ModelConfig)


def test_memory_plan_and_refusal():
    family = load_family("deepseek_v41")
    features = FeaturesConfig()
    features.parallel.dp = features.parallel.ep = 8
    hw = load_yaml_option(CONF_DIR / "hardware" / "sm90-port.yaml", HardwareConfig)
    plans = {p.device_name: p for p in family.memory_plans(_flash_model(), hw, features)}
    assert set(plans) == {"H100", "H200"}
    assert plans["H200"].fits and not plans["H100"].fits
    gib = 1 << 30
    family.check_memory(_flash_model(), hw, features, device_bytes=int(139.8 * gib), device_name="NVIDIA H200")
    with pytest.raises(ValueError, match=r"does not fit one NVIDIA H100 .* Engram tables 23\.6 GiB sharded"):
        family.check_memory(_flash_model(), hw, features, device_bytes=int(79.1 * gib), device_name="NVIDIA H100")
    features.parallel.engram_placement = "replicated"
    with pytest.raises(ValueError, match=r"Engram tables 188\.8 GiB replicated"):
        family.check_memory(_flash_model(), hw, features, device_bytes=int(139.8 * gib), device_name="NVIDIA H200")
    tiny = load_yaml_option(CONF_DIR / "model" / "tiny-v41.yaml", ModelConfig)
    family.check_memory(tiny, hw, FeaturesConfig(), device_bytes=int(79.1 * gib), device_name="NVIDIA H100")
    assert family.memory_plans(tiny, load_yaml_option(CONF_DIR / "hardware" / "cpu.yaml", HardwareConfig),
                               FeaturesConfig()) == []


def test_catalog_shows_the_plan_of_the_configured_layout(tmp_path):
    from redknot.bench.catalog import memory_plan_lines
    from redknot.config.hardware_fit import DeviceFacts
    from redknot.config.schema import Accelerator

    ctx = _resolved(tmp_path, "model=deepseek-v4.1-flash", "mode=catalog", "hardware=sm90-port",
                    "features.parallel.dp=8", "features.parallel.ep=8")
    lines = memory_plan_lines(ctx.cfg, DeviceFacts(Accelerator.cuda, 8, "NVIDIA H200", "9.0"))
    text = "\n".join(lines)
    assert "dp=8 ep=8 engram_placement=sharded" in text and "H200 139.8 GiB" in text
    assert "890 B/token" in text and "-> fits" in text and "H100" not in text
    cpu = _resolved(tmp_path, "model=tiny-v41", "mode=catalog")
    assert memory_plan_lines(cpu.cfg, DeviceFacts(Accelerator.cpu)) == []


def test_plan_census_and_token_map_code_stay_torch_free():
    """mode=catalog prints the plan without torch: the family, config, cost and census modules import none."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from redknot.models.registry import load_family\n"
            "from redknot.config.schema import ModelConfig, HardwareConfig, FeaturesConfig\n"
            "from redknot.models.deepseek_v41 import census, config, engram_hash, token_map\n"
            "m = ModelConfig(name='x', family='deepseek_v41', max_position=1048576)\n"
            "plans = load_family('deepseek_v41').memory_plans(m, HardwareConfig(device_names=['H200']), "
            "FeaturesConfig())\n"
            "census.describe(config.V41Config.flash())\n"
            "assert plans and 'torch' not in sys.modules, sorted(k for k in sys.modules if 'torch' in k)[:5]\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
