"""V4.1 config: the released nested config.json and the flat reference names, the derived
per-layer schedule of reference §2.5, and errors that name the field."""
import copy

import pytest

from redknot.models.deepseek_v41.config import (
    CANDIDATE_INDEX_SOURCE, CANDIDATE_SOURCE, CONSUMER, KV_INDEX_SOURCE, SWA_ONLY, V41Config, tiny_v41_config)

# The released config.json, as transcribed in reference §2 (root + text_config + quantization_config).
RELEASED = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
    "transformers_version": "5.6.0", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
        "moe_intermediate_size": 2304, "num_hidden_layers": 40, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "tie_word_embeddings": False, "max_position_embeddings": 1048576, "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "compress_rope_theta": 160000, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3},
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024},
}

# The flat reference inference/config.json (reference §1 REF-cfg).
FLAT = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3, "n_heads": 64,
    "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280, "head_dim": 512, "rope_head_dim": 64,
    "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4",
    "compress_rope_theta": 160000, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "vision_n_layers": 32, "vision_dim": 1024, "image_token_id": 129264, "engram_n_heads": 8,
    "engram_head_dim": 256, "max_batch_size": 1, "max_seq_len": 4096,
}


def test_released_and_flat_parse_to_the_same_config():
    released, flat = V41Config.from_dict(RELEASED), V41Config.from_dict(FLAT)
    assert released == flat == V41Config.flash()
    assert released.dim == 5120 and released.n_layers == 40 and released.window_size == 128
    assert released.quant.weight_block_size == (32, 32) and released.quant.expert_dtype == "fp4"
    assert released.rope_factor == 16 and released.original_seq_len == 65536


def test_round_trips():
    cfg = V41Config.flash()
    assert V41Config.from_dict(cfg.to_hf_dict()) == cfg
    assert V41Config.from_dict(cfg.to_flat_dict()) == cfg
    tiny = tiny_v41_config()
    assert V41Config.from_dict(tiny.to_hf_dict()) == tiny


def test_schedule_of_the_released_model_matches_the_table():
    """Reference §2.5, row by row."""
    cfg = V41Config.flash()
    roles = {0: SWA_ONLY, 1: SWA_ONLY, 2: KV_INDEX_SOURCE, 8: KV_INDEX_SOURCE, 14: KV_INDEX_SOURCE,
             20: CANDIDATE_SOURCE, 24: CANDIDATE_INDEX_SOURCE, 28: CANDIDATE_INDEX_SOURCE,
             32: CANDIDATE_INDEX_SOURCE, 36: CANDIDATE_INDEX_SOURCE}
    for layer in range(40):
        assert cfg.layer_role(layer) == roles.get(layer, CONSUMER), layer
    kv_from = {**{i: 2 for i in range(2, 8)}, **{i: 8 for i in range(8, 14)}, **{i: 14 for i in range(14, 20)},
               **{i: 20 for i in range(20, 40)}}
    for layer in range(40):
        assert cfg.kv_source_of(layer) == kv_from.get(layer), layer
    topk_from = dict(kv_from)
    for layer in range(24, 40):
        topk_from[layer] = 24 + 4 * ((layer - 24) // 4)
    for layer in range(40):
        assert cfg.index_source_of(layer) == topk_from.get(layer), layer
    assert [layer for layer in range(40) if cfg.is_engram(layer)] == [1, 14]
    assert [layer for layer in range(40) if cfg.reads_candidates(layer)] == [24, 28, 32, 36]
    assert [layer for layer in range(40) if cfg.is_dspark_target(layer)] == [37, 38, 39]
    for layer in range(43):
        rope = cfg.rope_of(layer)
        if layer in (0, 1) or layer >= 40:
            assert (rope.theta, rope.yarn) == (10000, False), layer
        else:
            assert (rope.theta, rope.yarn, rope.factor, rope.original_seq_len) == (160000, True, 16, 65536), layer
    assert cfg.ratios == (1, 2) and cfg.n_engram_cols == 24 and cfg.num_trailing_sliding_layers == 0


def test_tiny_config_has_every_layer_type():
    cfg = tiny_v41_config()
    assert [cfg.layer_role(i) for i in range(6)] == [
        SWA_ONLY, KV_INDEX_SOURCE, CONSUMER, CANDIDATE_SOURCE, CONSUMER, CANDIDATE_INDEX_SOURCE]
    assert cfg.is_engram(0) and cfg.is_engram(1) and cfg.compress_ratios[1] == 2 and cfg.compress_ratios[3] == 1
    assert cfg.n_mtp_layers == 1 and cfg.vocab_size == 129280 and cfg.dim <= 256
    assert cfg.kv_source_of(4) == 3 and cfg.index_source_of(4) == 3 and cfg.reads_candidates(5)


def _released(**text):
    d = copy.deepcopy(RELEASED)
    d["text_config"].update(text)
    return d


@pytest.mark.parametrize("text, field, words", [
    ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20}, "compress_ratios", "needs 43 entries"),
    ({"compress_ratios": [0, 0] + [4] * 18 + [1] * 20 + [0, 0, 0]}, "compress_ratios", "entries must be in"),
    ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 1, 0]}, "compress_ratios", "DSpark"),
    ({"kv_source_layer_ids": [8, 2, 14, 20]}, "kv_source_layer_ids", "sorted"),
    ({"kv_source_layer_ids": [3, 8, 14, 20]}, "kv_source_layer_ids", "layer 2"),
    ({"kv_source_layer_ids": [2, 8, 14, 20, 40]}, "kv_source_layer_ids", "[0, 40)"),
    ({"kv_source_layer_ids": [2, 8, 14, 21]}, "compress_ratios", "kv source 14"),
    ({"index_source_layer_ids": [2, 14, 20, 24, 28, 32, 36]}, "index_source_layer_ids", "below its kv source"),
    ({"index_source_layer_ids": [1, 2, 8, 14, 20]}, "index_source_layer_ids", "ratio 0"),
    ({"candidate_source_layer_id": 24}, "candidate_source_layer_id", "both a kv source"),
    ({"engram_num_embeddings": [384006168, 384016683]}, "engram_num_embeddings", "sum of"),
    ({"engram_num_embeddings": [384006168]}, "engram_num_embeddings", "one entry per engram layer"),
    ({"engram_layer_ids": [14, 1]}, "engram_layer_ids", "sorted"),
    ({"hidden_size": 5000}, "hidden_size", "multiple of 32"),
    ({"num_attention_heads": 60}, "o_groups", "divide"),
    ({"n_shared_experts": 2}, "n_shared_experts", "exactly 1"),
    ({"num_experts_per_tok": 400}, "num_experts_per_tok", "<= n_routed_experts"),
    ({"dspark_target_layer_ids": [37, 38, 40]}, "dspark_target_layer_ids", "[0, 40)"),
    ({"sliding_window": 0}, "sliding_window", ">= 1"),
    ({"text_config_dummy": 1, "model_type": "deepseek_v4"}, "text_config.model_type", "deepseek_v41_text"),
])
def test_bad_fields_are_named(text, field, words):
    with pytest.raises(ValueError) as err:
        V41Config.from_dict(_released(**text))
    msg = str(err.value)
    assert repr(field) in msg and words in msg, msg


def test_root_and_quantization_errors():
    d = copy.deepcopy(RELEASED)
    d["architectures"] = ["DeepseekV4ForCausalLM"]
    with pytest.raises(ValueError, match="'architectures'"):
        V41Config.from_dict(d)
    d = copy.deepcopy(RELEASED)
    d["quantization_config"]["weight_block_size"] = [32]
    with pytest.raises(ValueError, match="weight_block_size"):
        V41Config.from_dict(d)
    d = copy.deepcopy(RELEASED)
    d["text_config"]["sliding_window"] = 128
    d["text_config"]["window_size"] = 64
    with pytest.raises(ValueError, match="contradicts"):
        V41Config.from_dict(d)


def test_vision_config_is_ignored_and_num_embeddings_derived():
    d = copy.deepcopy(RELEASED)
    d["vision_config"] = {"anything": "at all"}
    del d["text_config"]["engram_num_embeddings"]
    assert V41Config.from_dict(d).engram_num_embeddings == (384006168, 384016682)


def test_cut_keeps_a_valid_prefix():
    cfg = V41Config.flash().cut(21)
    assert cfg.kv_source_layers == (2, 8, 14, 20) and cfg.index_source_layers == (2, 8, 14, 20)
    assert cfg.n_mtp_layers == 0 and len(cfg.compress_ratios) == 21 and cfg.source_n_layers == 40
    assert V41Config.flash().cut(3).candidate_source_layer == -1
    with pytest.raises(ValueError, match="model.num_layers"):
        V41Config.flash().cut(41)


def test_override_keys_must_be_config_keys():
    with pytest.raises(ValueError, match=r"architecture override keys \['hiden_size'\]: not DeepSeek-V4.1 config"):
        V41Config.flash().with_overrides({"hiden_size": 256})
    assert V41Config.flash().with_overrides({"hidden_size": 1024}).dim == 1024
