"""Legacy DeepInfer variables: stop with the equivalent overrides, or translate and record."""
import pytest

from redknot.config.legacy import LEGACY_VARS, LegacyEnvError, find_legacy
from redknot.config.violations import ConfigError

ENV = {"DEEPINFER_ACCELERATOR": "sm100", "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact",
       "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "256", "DEEPINFER_ENABLE_MTP_VARLEN": "0"}


def test_the_design_list_of_variables_is_covered():
    assert {v.name for v in LEGACY_VARS} == {
        "DEEPINFER_ACCELERATOR", "DEEPINFER_HF_MODEL_DIR", "DEEPINFER_ENABLE_MTP_VARLEN",
        "DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE",
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "DEEPINFER_BATCH_INVARIANT"}


def test_stop_prints_every_variable_and_the_equivalent_command(resolved):
    with pytest.raises(LegacyEnvError) as err:
        resolved("suite=64k", environ={**ENV, "PATH": "/usr/bin"})
    message = str(err.value)
    assert "DEEPINFER_ACCELERATOR=sm100" in message and "->  hardware=sm100" in message
    assert "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=256" in message and "features.swa_replay.keep_tokens=256" in message
    assert ("python -m redknot suite=64k hardware=sm100 features.dspark.adaptive=false "
            "features.swa_replay.mode=compact features.swa_replay.keep_tokens=256") in message
    assert "legacy_env=translate" in message


def test_translate_applies_the_overrides_and_records_them(resolved):
    ctx = resolved("legacy_env=translate", "suite=64k", environ=ENV)
    cfg = ctx.cfg
    assert cfg.hardware.name == "sm100" and cfg.hardware.kernels.ops["sparse_attention"] == "flash_mla"
    assert cfg.features.swa_replay.mode.value == "compact" and cfg.features.swa_replay.keep_tokens == 256
    assert cfg.features.dspark.adaptive is False
    assert cfg.suite.name == "64k"
    assert ctx.legacy_translation == {
        "DEEPINFER_ACCELERATOR": "hardware=sm100",
        "DEEPINFER_ENABLE_MTP_VARLEN": "features.dspark.adaptive=false",
        "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "features.swa_replay.mode=compact",
        "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "features.swa_replay.keep_tokens=256"}
    assert "hardware=sm100" in ctx.overrides
    assert "name: sm100" in ctx.config_yaml


def test_command_line_wins_over_a_translated_variable(resolved):
    ctx = resolved("legacy_env=translate", "hardware=cpu",
                   environ={"DEEPINFER_ACCELERATOR": "b200", "DEEPINFER_BATCH_INVARIANT": "1"})
    assert ctx.cfg.hardware.name == "cpu" and ctx.cfg.features.batch_invariant.enabled is True
    assert ctx.legacy_translation["DEEPINFER_ACCELERATOR"] == "(overridden on the command line)"


def test_model_dir_selects_the_flash_model(resolved, tmp_path):
    ctx = resolved("legacy_env=translate", environ={"DEEPINFER_HF_MODEL_DIR": "/ckpt/flash"})
    assert ctx.cfg.model.name == "deepseek-v4-flash" and ctx.cfg.model.path == "/ckpt/flash"


def test_translated_values_are_validated_like_any_override(resolved):
    with pytest.raises(ConfigError) as err:
        resolved("legacy_env=translate", environ={"DEEPINFER_ACCELERATOR": "npu", "DEEPINFER_BATCH_INVARIANT": "1"})
    assert "hardware=ascend950 has no batch-invariant kernels" in str(err.value)


def test_untranslatable_values_name_variable_value_and_choices():
    with pytest.raises(ConfigError) as err:
        find_legacy({"DEEPINFER_BATCH_INVARIANT": "maybe", "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": "lots"})
    message = str(err.value)
    assert "DEEPINFER_BATCH_INVARIANT=maybe: expected one of ['0', '1', 'false', 'no', 'off', 'on', 'true', 'yes']" \
        in message
    assert "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS=lots: expected an integer" in message


def test_empty_and_absent_variables_are_ignored(resolved):
    assert find_legacy({"DEEPINFER_BATCH_INVARIANT": "", "HOME": "/root"}) == []
    assert resolved(environ={"DEEPINFER_USE_NEXTN_DECODE": ""}).legacy_translation == {}


def test_the_printed_command_is_shell_safe():
    from redknot.config.legacy import stop_message

    message = stop_message(find_legacy({"DEEPINFER_HF_MODEL_DIR": "/ckpt/v4 flash"}), ["prompt=hi there"])
    assert "python -m redknot 'prompt=hi there' model=deepseek-v4-flash 'model.path=/ckpt/v4 flash'" in message
