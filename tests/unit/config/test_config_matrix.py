"""Every model x hardware x suite combination (and every features preset on every hardware)
composes from the real conf/ and validates; the combinations that must not run fail with
the expected message. Expected outcomes are written out by hand below."""
import itertools
from pathlib import Path

import pytest

from redknot.config.hardware_fit import CONF_DIR
from redknot.config.violations import ConfigError


def options(group):
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


MODELS, HARDWARE, SUITES, FEATURES = options("model"), options("hardware"), options("suite"), options("features")


def test_the_groups_hold_what_the_design_names():
    assert MODELS == ["deepseek-v4-flash", "deepseek-v4.1-flash", "tiny", "tiny-0731", "tiny-v41"]
    assert HARDWARE == ["ascend950", "cpu", "sm100", "sm90-port"]
    assert SUITES == ["128k", "256k", "440k", "64k", "release_128k", "release_256k", "release_440k", "release_64k",
                      "release_smoke", "ruler_128k", "ruler_64k", "smoke"]
    assert FEATURES == ["default", "deterministic"]


@pytest.mark.parametrize("model, hardware", list(itertools.product(MODELS, HARDWARE)))
def test_model_hardware_suite_matrix(resolved, model, hardware):
    path = [] if model == "tiny" else ["model.path=/checkpoints/v4"]  # real models need one to run
    for suite in SUITES:
        ctx = resolved(f"model={model}", f"hardware={hardware}", f"suite={suite}", *path)
        assert (ctx.cfg.model.name, ctx.cfg.hardware.name, ctx.cfg.suite.name) == (model, hardware, suite)


@pytest.mark.parametrize("features, hardware", list(itertools.product(FEATURES, HARDWARE)))
def test_features_presets_on_every_hardware(resolved, features, hardware):
    overrides = (f"features={features}", f"hardware={hardware}")
    if (features, hardware) == ("deterministic", "ascend950"):
        with pytest.raises(ConfigError) as err:
            resolved(*overrides)
        assert [v.key for v in err.value.violations] == ["features.batch_invariant.enabled"]
        assert "hardware=ascend950 has no batch-invariant kernels" in str(err.value)
    else:
        assert resolved(*overrides).cfg.features.deterministic == (features == "deterministic")


BAD = [
    (("model=deepseek-v4-flash",), "model.path=null: model=deepseek-v4-flash has no synthetic weights"),
    (("model=deepseek-v4.1-flash", "mode=generate", "prompt=hi"), "model.path=null: model=deepseek-v4.1-flash"),
    (("suite=440k", "model.max_position=450000"), "suite.context_tokens (450560) + the largest max_new_tokens (128)"),
    (("hardware=cpu", "hardware.kernels.default=torch_npu"), "backend 'torch_npu' runs on accelerator npu"),
    (("hardware=sm100", "hardware.accelerator=cpu"), "hardware.kernels.default=triton: backend 'triton' runs on"),
    (("hardware=ascend950", "features.batch_invariant.enabled=true"), "has no batch-invariant kernels"),
    (("features=deterministic", "features.dspark.adaptive=true"), "needs features.dspark.adaptive=false"),
    (("features.dspark.max_draft=7",), "features.dspark.max_draft=7: must be <= 5, the draft block size"),
    (("features.dspark.budget=file",), "features.dspark.budget=file needs features.dspark.budget_file="),
    (("features.dspark.budget=fixed",), "features.dspark.budget=fixed needs features.dspark.budget_tokens >= 1"),
    (("features.dspark.staleness=3",), "features.dspark.staleness=3: must be 1"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_combinations_fail_with_the_expected_message(resolved, overrides, message):
    with pytest.raises(ConfigError) as err:
        resolved(*overrides)
    assert message in str(err.value)


def test_paths_become_absolute_and_the_yaml_is_the_typed_config(resolved, tmp_path):
    from omegaconf import OmegaConf

    ctx = resolved("model=deepseek-v4-flash", "model.path=ckpt/v4", "mode=prepare", "features.swa_replay.mode=off")
    assert ctx.cfg.model.path == str(tmp_path / "ckpt" / "v4")
    assert ctx.cfg.engine.cache_dir == str(tmp_path / "outputs" / "cache")
    assert ctx.cfg.output.root == str(tmp_path / "outputs")
    reread = OmegaConf.create(ctx.config_yaml)
    assert reread.model.path == ctx.cfg.model.path and reread.mode == "prepare"
    assert reread.features.swa_replay.mode == "off"
    assert Path(ctx.run_dir) == tmp_path / "run"
