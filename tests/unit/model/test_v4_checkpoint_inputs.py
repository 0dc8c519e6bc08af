"""Checkpoints as users bring them: a config.json without quantization_config over FP8 tensors, a shard
cut short by an interrupted download."""
import json
import shutil

import pytest

from redknot.config.schema import HardwareConfig, ModelConfig
from redknot.models.deepseek_v4.build import build_model
from redknot.models.deepseek_v4.synthetic import ensure_synthetic_checkpoint
from redknot.models.deepseek_v4.weights import CheckpointError

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "compress_ratios": [4, 128, 0], "num_attention_heads": 2,
        "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "index_n_heads": 2, "index_head_dim": 32, "index_topk": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "num_hash_layers": 1, "vocab_size": 512, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return ensure_synthetic_checkpoint("fp8", TINY, 0, True, str(cache))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_fp8_tensors_without_quantization_config_are_recognised(fp8_checkpoint, tmp_path, caplog):
    path = _copy(fp8_checkpoint, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    assert config.pop("quantization_config")["fmt"] == "e4m3"
    (path / "config.json").write_text(json.dumps(config))
    model = build_model(ModelConfig(path=str(path)), HardwareConfig(), str(tmp_path), progress=False)
    assert model.cfg.quant is not None and model.cfg.quant.fmt == "e4m3"
    assert "has no quantization_config, but its tensors are FP8 e4m3" in caplog.text
    reference = build_model(ModelConfig(path=str(fp8_checkpoint)), HardwareConfig(), str(tmp_path), progress=False)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert a.equal(b), name  # exactly what the checkpoint with its quantization_config loads


def test_a_truncated_shard_is_named(fp8_checkpoint, tmp_path):
    path = _copy(fp8_checkpoint, tmp_path / "ckpt")
    (shard,) = path.glob("*.safetensors")
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        build_model(ModelConfig(path=str(path)), HardwareConfig(), str(tmp_path), progress=False)
    assert shard.name in str(err.value) and "truncated or corrupt" in str(err.value)
