"""DeepSeek-V4 architecture config, parsed from a checkpoint's ``config.json``.

Pure Python (no torch): the cache manager derives its state layout from it.

Both spellings real files use are accepted:

* modern (transformers): ``layer_types`` + ``compress_rates``, ``mlp_layer_types``,
  ``partial_rotary_factor``, ``rope_parameters`` {"main", "compress"};
* legacy (the released checkpoints): ``compress_ratios`` (one int per layer plus a
  trailing entry for the MTP layer), ``num_hash_layers``, ``qk_rope_head_dim``,
  ``rope_scaling`` (YaRN), top-level ``expert_dtype``.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from redknot.models.registry import family_entry

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
# What the family registry says V4 checkpoints declare; written into the config.json of checkpoints made here.
ENTRY = family_entry("deepseek_v4")
ARCHITECTURE, MODEL_TYPE = ENTRY.architectures[0], ENTRY.model_types[0]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency scaling of the "compress" RoPE (no attention-magnitude factor)."""
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint stores linear weights: FP8 e4m3 + ue8m0 128x128 block scales,
    routed experts optionally FP4 (e2m1, per-32 ue8m0 scales)."""
    method: str = "fp8"
    fmt: str = "e4m3"
    scale_fmt: str = "ue8m0"
    weight_block_size: Tuple[int, int] = (128, 128)
    expert_dtype: str = "fp8"  # "fp8" | "fp4"


@dataclass(frozen=True)
class V4Config:
    """Every architecture number the V4 model math needs (reference §1)."""
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_layers: int = 43
    num_heads: int = 64
    head_dim: int = 512
    rope_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    layer_types: Tuple[str, ...] = ()
    csa_ratio: int = 4
    hca_ratio: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    mlp_layer_types: Tuple[str, ...] = ()
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: Optional[YarnScaling] = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    num_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    quant: Optional[QuantConfig] = None
    torch_dtype: str = "bfloat16"
    # Layers in the checkpoint; larger than num_layers for a cut model (layers past the cut are skipped).
    source_num_layers: Optional[int] = None

    # ----------------------------------------------------------------- derived
    def compress_ratio(self, layer: int) -> int:
        """0 for sliding-window-only layers, else the layer's compression ratio m."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else (self.csa_ratio if kind == CSA else self.hca_ratio)

    def is_hash_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == HASH_MOE

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def ratios(self) -> Tuple[int, ...]:
        """Compression ratios present in the model (ascending)."""
        return tuple(sorted({self.compress_ratio(i) for i in range(self.num_layers)} - {0}))

    def layers_of(self, kind: str) -> List[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @property
    def num_trailing_sliding_layers(self) -> int:
        """Sliding-window-only layers above the last CSA/HCA layer. Their prefix state is only
        ever read through the window, so compact SWA replay may skip its early rows."""
        count = 0
        for kind in reversed(self.layer_types):
            if kind != SLIDING:
                break
            count += 1
        return count

    # ----------------------------------------------------------------- constructors
    @classmethod
    def flash(cls) -> "V4Config":
        """DeepSeek-V4-Flash (reference §1): 43 layers = 2 SWA, then CSA/HCA alternating."""
        return cls.from_hf_dict(flash_config_dict())

    @classmethod
    def from_pretrained(cls, path: str, num_layers: Optional[int] = None) -> "V4Config":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model.path={path!r} has no config.json")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = cls.from_hf_dict(json.load(f))
        return cfg.cut(num_layers) if num_layers is not None else cfg

    @classmethod
    def from_hf_dict(cls, d: Dict[str, Any]) -> "V4Config":
        """Parse modern or legacy config.json keys; a bad or inconsistent field raises
        ValueError naming the field, its value and what is allowed."""
        from redknot.models.deepseek_v4.config_parse import parse_hf_dict
        from redknot.models.deepseek_v4.dspark_config import target_view
        return parse_hf_dict(cls, target_view(d))  # a DSpark checkpoint's mtp.* are draft stages (dspark_config)

    def cut(self, num_layers: Optional[int]) -> "V4Config":
        """Keep the first ``num_layers`` layers (real-dimension cut models)."""
        if num_layers is None or num_layers == self.num_layers:
            return self
        if not 1 <= num_layers <= self.num_layers:
            raise ValueError(f"model.num_layers={num_layers} must be in [1, {self.num_layers}] "
                             f"(the checkpoint has {self.num_layers} layers)")
        return replace(self, num_layers=num_layers, layer_types=self.layer_types[:num_layers],
                       mlp_layer_types=self.mlp_layer_types[:num_layers],
                       source_num_layers=self.source_num_layers or self.num_layers)

    def with_overrides(self, overrides: Dict[str, Any]) -> "V4Config":
        """Re-parse with config.json-style keys replaced (synthetic architectures)."""
        d = self.to_hf_dict()
        if "layer_types" in overrides or "compress_ratios" in overrides:
            d.pop("compress_ratios", None)
        if "mlp_layer_types" in overrides or "num_hash_layers" in overrides:
            d.pop("num_hash_layers", None)
        if "partial_rotary_factor" in overrides:
            d.pop("qk_rope_head_dim", None)
        overrides = dict(overrides)
        if "expert_dtype" in overrides and isinstance(d.get("quantization_config"), dict):
            d["quantization_config"]["expert_dtype"] = overrides.pop("expert_dtype")
        d.update(overrides)
        return type(self).from_hf_dict(d)

    def to_hf_dict(self) -> Dict[str, Any]:
        """config.json in the legacy layout the released checkpoints use."""
        ratio = {SLIDING: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}
        num_hash = sum(1 for t in self.mlp_layer_types if t == HASH_MOE)
        d: Dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1, "head_dim": self.head_dim, "qk_rope_head_dim": self.rope_dim,
            "q_lora_rank": self.q_lora_rank, "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.sliding_window,
            "compress_ratios": [ratio[t] for t in self.layer_types] + [0] * self.num_mtp_layers,
            "compress_rate_csa": self.csa_ratio, "compress_rate_hca": self.hca_ratio,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_shared_experts": 1,
            "moe_intermediate_size": self.moe_intermediate_size, "scoring_func": "sqrtsoftplus",
            "topk_method": "noaux_tc", "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor, "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult, "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_mtp_layers, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id, "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
        }
        if any(t != HASH_MOE for t in self.mlp_layer_types[:num_hash]):
            d["mlp_layer_types"] = list(self.mlp_layer_types)
        else:
            d["num_hash_layers"] = num_hash
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **asdict(self.yarn)}
        if self.quant is not None:
            q = asdict(self.quant)
            d["quantization_config"] = {
                "quant_method": q["method"], "fmt": q["fmt"], "scale_fmt": q["scale_fmt"],
                "weight_block_size": list(q["weight_block_size"]), "activation_scheme": "dynamic",
                "expert_dtype": q["expert_dtype"]}
        return d


def flash_config_dict() -> Dict[str, Any]:
    """The published V4-Flash config.json values (legacy key layout)."""
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": 129280,
        "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
        "moe_intermediate_size": 2048, "num_hash_layers": 3, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "num_nextn_predict_layers": 1,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    }
