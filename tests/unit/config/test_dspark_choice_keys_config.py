"""``features.dspark.block_attention`` and ``features.dspark.confidence_activation`` compose with
their documented defaults, take the other allowed value, and refuse anything else with a message
naming the key, the value and the allowed values."""
import pytest
from hydra.errors import ConfigCompositionException

from config_testutil import compose_cfg


def test_defaults_are_the_reference_behaviour():
    cfg = compose_cfg()
    assert cfg.features.dspark.block_attention == "bidirectional"
    assert cfg.features.dspark.confidence_activation == "sigmoid"


def test_the_other_values_compose():
    cfg = compose_cfg("features.dspark.block_attention=causal", "features.dspark.confidence_activation=clamp")
    assert (cfg.features.dspark.block_attention, cfg.features.dspark.confidence_activation) == ("causal", "clamp")


@pytest.mark.parametrize("override, allowed", [("features.dspark.block_attention=causual", "[bidirectional, causal]"),
                                               ("features.dspark.confidence_activation=tanh", "[sigmoid, clamp]")])
def test_a_bad_value_names_key_value_and_allowed(override, allowed):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(override)
    text = f"{err.value} {err.value.__cause__}"
    key, value = override.split("=")
    assert key in text and f"Invalid value '{value}'" in text and allowed in text
