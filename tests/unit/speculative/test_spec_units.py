"""Pure pieces of DSpark and compact replay: draft limits, counters,
the keep_tokens rule (configuration validation and its documentation)."""
import pathlib

import pytest

from redknot.speculative.metrics import SpecDecodeStats
from redknot.speculative.replay import CompactReplay, required_keep_tokens
from redknot.speculative.schedule import draft_limit

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_draft_limits():
    # 10 outputs after this step, max_tokens 12: the next step may verify 1 draft (+1 token) -> 12
    assert draft_limit(5, num_outputs_after=10, max_tokens=12, next_position=50, max_model_len=1000) == 1
    assert draft_limit(5, num_outputs_after=11, max_tokens=12, next_position=50, max_model_len=1000) == 0
    # last fed position 50 + k must leave room for the sampled token: 50 + k <= 62 - 2
    assert draft_limit(5, num_outputs_after=1, max_tokens=100, next_position=50, max_model_len=62) == 5
    assert draft_limit(5, num_outputs_after=1, max_tokens=100, next_position=57, max_model_len=62) == 3
    assert draft_limit(5, num_outputs_after=1, max_tokens=100, next_position=61, max_model_len=62) == 0


def test_spec_decode_stats():
    s = SpecDecodeStats(max_draft=3)
    s.record_verify(3, 1)
    s.record_verify(2, 2)
    s.record_verify(1, 0)
    assert (s.num_proposed, s.num_accepted) == (6, 3)
    assert s.verified_per_position == [3, 2, 1] and s.accepted_per_position == [2, 1, 0]
    assert s.acceptance_by_position() == [2 / 3, 0.5, 0.0]
    s.record_step(True, 0.02)
    s.record_step(True, 0.04)
    s.record_step(False, 0.01)
    s.num_decode_request_steps, s.num_decode_tokens = 4, 7
    m = s.as_metrics()
    assert m["spec.mean_accept_len"] == 7 / 4 and m["spec.acceptance_rate"] == 0.5
    assert m["spec.verify_step_ms"] == pytest.approx(30.0) and m["spec.plain_step_ms"] == pytest.approx(10.0)
    assert m["spec.acceptance.pos1"] == 2 / 3 and "spec.acceptance.pos3" in m
    snap = s.snapshot()
    s.record_verify(1, 1)
    assert snap.verified_per_position == [3, 2, 1]


def test_required_keep_tokens():
    assert required_keep_tokens(128, 5, 0) == 134  # V4-Flash: the MTP layer is the only window-only top layer
    assert required_keep_tokens(128, 0, 0) == 129
    assert required_keep_tokens(16, 4, 2) == 16 + 4 + 1 + 2 * 15
    assert CompactReplay(keep_tokens=21).starts([type("S", (), {"seq_len": n})() for n in (5, 21, 30)]) == [0, 0, 9]


def test_configuration_enforces_and_documents_the_keep_tokens_rule():
    """The rule lives in the configuration validation (one message naming the key, the value and
    the bound) and beside the key in conf/features/default.yaml."""
    from redknot.config.rules import swa_replay_window
    from redknot.config.schema import RedKnotConfig, SwaReplayMode
    cfg = RedKnotConfig()
    cfg.features.swa_replay.mode = SwaReplayMode.compact
    cfg.features.dspark.method, cfg.features.dspark.max_draft = "auto", 5
    cfg.model.sliding_window = 128
    cfg.features.swa_replay.keep_tokens = 133
    (violation,) = swa_replay_window(cfg)
    assert "features.swa_replay.keep_tokens" in str(violation) and "134" in str(violation)
    cfg.features.swa_replay.keep_tokens = 134
    assert swa_replay_window(cfg) == []
    text = (ROOT / "conf" / "features" / "default.yaml").read_text()
    assert "keep_tokens >= model.sliding_window + dspark.max_draft + 1" in text


def test_effective_draft_length_and_a_checkpoint_without_drafter():
    from redknot.config.schema import DSparkConfig, FeaturesConfig
    from redknot.speculative.dspark import DSparkSpeculator as DSpark

    assert DSparkConfig(max_draft=3).effective_max_draft == 3
    assert DSparkConfig(method="none", max_draft=3).effective_max_draft == 0
    assert DSparkConfig(method="mtp", max_draft=0).effective_max_draft == 0
    with pytest.raises(AttributeError):  # the old switch is derived now; setting it is an error, not a no-op
        DSparkConfig().enabled = False
    features = FeaturesConfig()
    assert DSpark.create({}, None, None, features, max_model_len=64) is None  # auto: no drafter, plain decoding
    for method in ("mtp", "dspark"):
        features.dspark.method = method
        with pytest.raises(ValueError, match=f"features.dspark.method={method} but the checkpoint has no"):
            DSpark.create({}, None, None, features, max_model_len=64)  # the family found no drafter
    features.dspark.method = "none"
    assert DSpark.create({}, None, None, features, max_model_len=64) is None


def test_pure_modules_import_without_torch():
    import subprocess
    import sys
    code = ("import sys; import redknot.speculative.schedule, redknot.speculative.replay, redknot.speculative.metrics; "
            "import redknot.engine.scheduler, redknot.engine.outputs; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
