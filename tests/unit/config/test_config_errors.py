"""Bad input fails with a message naming the key, the value and what is allowed."""
import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException

from config_testutil import compose_cfg
from redknot.config.violations import ConfigError


def test_bad_enum_lists_allowed_values():
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("features.swa_replay.mode=full")
    text = f"{err.value} {err.value.__cause__}"
    assert "features.swa_replay.mode" in text
    assert "Invalid value 'full'" in text
    assert "[off, compact]" in text


def test_bad_mode_lists_every_mode():
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("mode=serve")
    assert "[run, prepare, catalog, validate, generate, compare]" in str(err.value.__cause__)


def test_unknown_key_fails_while_composing():
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("features.dspark.max_drafts=3")
    text = f"{err.value} {err.value.__cause__}"
    assert "max_drafts" in text and "DSparkConfig" in text


def test_appended_unknown_key_is_caught_by_the_resolver(resolved):
    # `+key=value` opens Hydra's struct mode; the resolver still refuses keys the schema lacks.
    with pytest.raises(ConfigError) as err:
        resolved("+model.quantization=fp8")
    message = str(err.value)
    assert "model.quantization=fp8: unknown key" in message
    assert "sliding_window" in message and "max_position" in message  # lists the keys ModelConfig has


def test_bad_group_option_lists_available_options():
    with pytest.raises(MissingConfigException) as err:
        compose_cfg("hardware=h100")
    text = str(err.value)
    for option in ("ascend950", "cpu", "sm100", "sm90-port"):
        assert option in text


def test_out_of_range_value(resolved):
    with pytest.raises(ConfigError) as err:
        resolved("features.dspark.max_draft=-1")
    assert "features.dspark.max_draft=-1: must be >= 0" in str(err.value)


def test_wrong_type_fails_while_composing():
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg("suite.context_tokens=lots")
    assert "suite.context_tokens" in str(err.value.__cause__)


def test_two_cross_field_violations_reported_together(resolved):
    with pytest.raises(ConfigError) as err:
        resolved("model=tiny", "features.swa_replay.mode=compact", "features.swa_replay.keep_tokens=120",
                 "features.deterministic=true", "features.batch_invariant.enabled=true")
    message = str(err.value)
    assert message.startswith("invalid configuration (2 problems):")
    assert ("features.swa_replay.keep_tokens=120: must be >= model.sliding_window (128) + "
            "features.dspark.max_draft (5) + 1 = 134 when features.swa_replay.mode=compact") in message
    assert ("features.dspark.adaptive=true: features.deterministic=true needs features.dspark.adaptive=false"
            in message)
    assert len(err.value.violations) == 2


def test_range_and_cross_field_violations_in_one_message(resolved):
    with pytest.raises(ConfigError) as err:
        resolved("hardware=ascend950", "features.batch_invariant.enabled=true",
                 "features.dspark.budget_tokens=-1", "suite.admission_batch_size=0")
    keys = [v.key for v in err.value.violations]
    assert keys == ["features.dspark.budget_tokens", "suite.admission_batch_size",
                    "features.batch_invariant.enabled"]
    assert "hardware=ascend950 has no batch-invariant kernels" in str(err.value)


def test_a_typo_in_a_group_file_fails_naming_file_and_key(tmp_path):
    import shutil

    from hydra import compose, initialize_config_dir

    from redknot.config.hardware_fit import CONF_DIR

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    suite = conf / "suite" / "64k.yaml"
    suite.write_text(suite.read_text().replace("admission_batch_size:", "admision_batch_size:"))
    with initialize_config_dir(str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as err:
            compose("config", overrides=["suite=64k"])
    text = f"{err.value} {err.value.__cause__}"
    assert "suite/64k" in text and "admision_batch_size" in text and "SuiteConfig" in text
