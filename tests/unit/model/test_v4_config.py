"""V4Config parsing: legacy and modern config.json keys, cuts, and field-named errors."""
import copy

import pytest

from redknot.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config, flash_config_dict


def test_flash_values_match_reference_table():
    cfg = V4Config.flash()
    assert cfg.num_layers == 43 and cfg.hidden_size == 4096 and cfg.vocab_size == 129280
    assert cfg.layer_types[:2] == (SLIDING, SLIDING)
    assert cfg.layers_of(CSA) == list(range(2, 43, 2)) and cfg.layers_of(HCA) == list(range(3, 42, 2))
    assert cfg.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert cfg.rope_dim == 64 and cfg.nope_dim == 448
    assert cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert cfg.quant.expert_dtype == "fp8" and cfg.num_mtp_layers == 1
    assert [cfg.compress_ratio(i) for i in (0, 1, 2, 3)] == [0, 0, 4, 128]


def test_modern_keys_written_by_transformers_parse_to_the_same_config():
    from transformers import DeepseekV4Config
    legacy = flash_config_dict()
    hf = DeepseekV4Config(**{k: v for k, v in legacy.items() if k not in ("architectures", "model_type")})
    modern = hf.to_dict()
    assert "layer_types" in modern and "rope_parameters" in modern and "compress_ratios" not in modern
    assert V4Config.from_hf_dict(modern) == V4Config.flash()


def test_round_trip_through_legacy_dict():
    cfg = V4Config.flash().with_overrides({"hidden_size": 256, "num_hidden_layers": 3,
                                           "compress_ratios": [0, 4, 128, 0]})
    assert V4Config.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.layer_types == (SLIDING, CSA, HCA)


def test_top_level_expert_dtype_moves_into_quantization():
    d = flash_config_dict()
    d["expert_dtype"] = "fp4"
    assert V4Config.from_hf_dict(d).quant.expert_dtype == "fp4"


def test_cut_keeps_first_layers_and_remembers_source():
    cfg = V4Config.flash().cut(3)
    assert cfg.layer_types == (SLIDING, SLIDING, CSA) and cfg.source_num_layers == 43
    with pytest.raises(ValueError, match="model.num_layers=50"):
        V4Config.flash().cut(50)


@pytest.mark.parametrize("key,value,needle", [
    ("architectures", ["LlamaForCausalLM"], "'architectures'"),
    ("compress_ratios", [0, 4, 128], "'compress_ratios'"),
    ("compress_ratios", [0, 0] + [4, 128] * 20 + [4] + [8], "'compress_ratios'"),
    ("o_groups", 7, "'o_groups'"),
    ("scoring_func", "softmax", "'scoring_func'"),
    ("num_key_value_heads", 8, "'num_key_value_heads'"),
    ("qk_rope_head_dim", 63, "'qk_rope_head_dim'"),
    ("num_experts_per_tok", 300, "'num_experts_per_tok'"),
    ("hidden_size", "4096", "'hidden_size'"),
    ("tie_word_embeddings", True, "'tie_word_embeddings'"),
])
def test_bad_fields_are_named(key, value, needle):
    d = copy.deepcopy(flash_config_dict())
    d[key] = value
    with pytest.raises(ValueError, match=needle):
        V4Config.from_hf_dict(d)


def test_bad_quantization_and_rope_are_named():
    d = flash_config_dict()
    d["quantization_config"] = dict(d["quantization_config"], weight_block_size=[64, 64])
    with pytest.raises(ValueError, match="weight_block_size"):
        V4Config.from_hf_dict(d)
    d = flash_config_dict()
    d["rope_scaling"] = {"type": "linear", "factor": 2}
    with pytest.raises(ValueError, match="rope_scaling.type"):
        V4Config.from_hf_dict(d)
    d = flash_config_dict()
    del d["compress_ratios"]
    with pytest.raises(ValueError, match="layer_types"):
        V4Config.from_hf_dict(d)


def test_from_pretrained_reads_config_json(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps(flash_config_dict()))
    assert V4Config.from_pretrained(str(tmp_path), num_layers=5).num_layers == 5
    with pytest.raises(FileNotFoundError, match="config.json"):
        V4Config.from_pretrained(str(tmp_path / "missing"))


def test_config_module_does_not_import_torch():
    import subprocess
    import sys
    code = ("import sys; from redknot.models.deepseek_v4 import V4Config; V4Config.flash(); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
