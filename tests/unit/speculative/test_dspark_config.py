"""``features.dspark``: the replaced keys name their replacement, the legacy DeepInfer variables
translate to the new keys, and the rules refuse what the drafter cannot do."""
from pathlib import Path

import pytest

from redknot.config.hardware_fit import CONF_DIR
from redknot.config.legacy import find_legacy
from redknot.config.precheck import precheck
from redknot.config.resolve import unknown_keys
from redknot.config.schema import RedKnotConfig


@pytest.mark.parametrize("override, new_key", [
    ("features.dspark.enabled=false", "features.dspark.method=auto|dspark|mtp|none"),
    ("features.dspark.varlen=true", "features.dspark.adaptive=true|false"),
    ("features.dspark.confidence_threshold=0.3", "features.dspark.budget=profile|file|fixed"),
    ("features.verification.method=greedy", "features.dspark.verification=token|block"),
])
def test_old_spellings_name_the_new_key(tmp_path, override, new_key):
    found = precheck([override, f"output.root={tmp_path}"], CONF_DIR, cwd=tmp_path, environ={})
    (violation,) = found.violations
    assert violation.key == override.split("=")[0] and new_key in str(violation)
    assert "replaced by" in str(violation)


def test_an_old_key_in_a_yaml_file_names_the_new_key():
    (violation,) = unknown_keys({"features": {"dspark": {"varlen": True}}}, RedKnotConfig)
    assert str(violation).startswith("features.dspark.varlen=true: replaced by features.dspark.adaptive")


@pytest.mark.parametrize("value, overrides", [
    ("0", ("features.dspark.method=none",)),
    ("false", ("features.dspark.method=none",)),
    ("true", ("features.dspark.method=auto",)),
    ("5", ("features.dspark.method=auto", "features.dspark.max_draft=5")),
    ("1", ("features.dspark.method=auto", "features.dspark.max_draft=1")),
])
def test_nextn_decode_translates_to_method_and_draft_count(value, overrides):
    (setting,) = find_legacy({"DEEPINFER_USE_NEXTN_DECODE": value})
    assert setting.overrides == overrides


def test_varlen_variable_translates_to_adaptive():
    (setting,) = find_legacy({"DEEPINFER_ENABLE_MTP_VARLEN": "0"})
    assert setting.overrides == ("features.dspark.adaptive=false",)


def test_bad_nextn_value_is_refused_with_the_replacement():
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE=maybe: expected one of .* or a draft count"):
        find_legacy({"DEEPINFER_USE_NEXTN_DECODE": "maybe"})


def test_default_features_document_every_dspark_key():
    from dataclasses import fields

    from redknot.config.schema import DSparkConfig
    text = (Path(CONF_DIR) / "features" / "default.yaml").read_text()
    block = text.split("dspark:", 1)[1].split("swa_replay:", 1)[0]
    for f in fields(DSparkConfig):
        assert f"  {f.name}:" in block, f.name


def test_effective_values_of_dspark_keys():
    from redknot.config.effective import effective_values
    cfg = RedKnotConfig()
    assert "features.dspark.adaptive" not in effective_values(cfg)
    cfg.features.parallel.ep = 2
    assert effective_values(cfg)["features.dspark.adaptive"].startswith("false (budget=profile with a parallel")
    cfg.features.parallel.ep = 1
    cfg.features.dspark.method, cfg.features.dspark.draft_sampling = "mtp", "probabilistic"
    assert effective_values(cfg)["features.dspark.draft_sampling"].startswith("greedy")
    cfg.features.dspark.method = "none"
    assert effective_values(cfg)["features.dspark.max_draft"].startswith("0 (features.dspark.method=none")
