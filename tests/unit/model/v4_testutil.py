"""Helpers for the V4 model tests: transformers oracle models with randomised parameters and
the transformers -> native checkpoint name mapping."""
from __future__ import annotations

import re
from typing import Dict

import torch

PARITY_CONFIG = {  # reference §11
    "vocab_size": 512, "hidden_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64,
    "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 4,
    "sliding_window": 8,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "norm_topk_prob": True, "swiglu_limit": 1.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 32, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 4096, "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
}

# A second shape: other widths, window, ratios (CSA 2 / HCA 16), more experts and heads, top-3 routing,
# layer order HCA first, one hash layer.
VARIANT_CONFIG = {
    "vocab_size": 700, "hidden_size": 96, "moe_intermediate_size": 48, "num_hidden_layers": 5,
    "num_attention_heads": 6, "num_key_value_heads": 1, "head_dim": 48, "qk_rope_head_dim": 8, "q_lora_rank": 40,
    "o_groups": 3, "o_lora_rank": 24, "index_n_heads": 20, "index_head_dim": 24, "index_topk": 6,
    "sliding_window": 12,
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 16},
    "layer_types": ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "num_hash_layers": 1,
    "n_routed_experts": 12, "num_experts_per_tok": 3, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "swiglu_limit": 0.8,
    "hc_mult": 3, "hc_sinkhorn_iters": 12, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 20000.0, "compress_rope_theta": 80000.0,
    "rope_scaling": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 48, "beta_fast": 24,
                     "beta_slow": 2},
    "max_position_embeddings": 4096, "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def hf_model(config: Dict, seed: int):
    """transformers DeepseekV4ForCausalLM in fp32 with every parameter randomised (reference §11)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    cfg = DeepseekV4Config(**config)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "scale" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2 and "position_bias" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = torch.rand(b.shape[0], cfg.n_routed_experts, generator=gen).argsort(-1)[:, :b.shape[1]]
                b.copy_(rows)
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    return model


_RENAMES = [
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.(\d+)\.", r"layers.\1."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.compressor\.", ".attn.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.q_a_proj\.", ".wq_a."), (r"\.q_a_norm\.", ".q_norm."), (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."), (r"\.sinks$", ".attn_sink"), (r"\.position_bias$", ".ape"),
    (r"compressor\.kv_norm\.", "compressor.norm."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.", ".ffn."),
]


def hf_to_native(state: Dict[str, torch.Tensor], num_experts: int) -> Dict[str, torch.Tensor]:
    """transformers DeepseekV4ForCausalLM state_dict -> native checkpoint tensors (reference §8)."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = _rename(name[:-len("experts.gate_up_proj")])
            inter = t.shape[1] // 2
            for e in range(num_experts):
                out[f"{prefix}experts.{e}.w1.weight"] = t[e, :inter]
                out[f"{prefix}experts.{e}.w3.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            prefix = _rename(name[:-len("experts.down_proj")])
            for e in range(num_experts):
                out[f"{prefix}experts.{e}.w2.weight"] = t[e]
        elif ".shared_experts." in name:
            shared = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
            m = re.search(r"shared_experts\.(\w+)\.weight$", name)
            out[_rename(name[:m.start()]) + f"shared_experts.{shared[m.group(1)]}.weight"] = t
        else:
            out[_rename(name)] = t
    return out


def _rename(name: str) -> str:
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def native_model_from_hf(hf, tmp_dir: str, with_mtp: bool = False):
    """Write the transformers model's weights as a native checkpoint and load it with our loader."""
    from redknot.models.deepseek_v4.config import V4Config
    from redknot.models.deepseek_v4.model import DeepseekV4
    from redknot.models.deepseek_v4.weights import load_checkpoint
    from redknot.models.deepseek_v4.writer import write_checkpoint

    cfg = V4Config.from_hf_dict(hf.config.to_dict())
    native = hf_to_native(hf.state_dict(), cfg.n_routed_experts)
    write_checkpoint(tmp_dir, cfg, iter(native.items()))
    model = DeepseekV4(cfg, torch.float32, device="meta", with_mtp=with_mtp)
    model.to_empty(device="cpu")
    load_checkpoint(model, tmp_dir, progress=False)
    return model.eval()
