"""The DSpark draft stages' config keys of a V4 checkpoint (V4-Flash-0731; reference dspark.md
§2.3), pure Python.

A DSpark checkpoint states ``dspark_block_size`` (gamma), ``dspark_target_layer_ids`` (the
target layers whose outputs feed the draft), ``dspark_markov_rank``, ``dspark_noise_token_id``
and its number of stages (``n_mtp_layers``, else ``num_nextn_predict_layers``). Its ``mtp.*``
namespace holds the stages, not a classic MTP layer, so the target config is parsed without
them (:func:`target_view`): no MTP layer, and ``compress_ratios`` without the stages' entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

BLOCK_KEY = "dspark_block_size"


@dataclass(frozen=True)
class DSparkDraftConfig:
    """What the draft model needs beyond the target's V4Config."""
    block_size: int = 5                              # gamma: draft positions per block
    target_layer_ids: Tuple[int, ...] = (40, 41, 42)  # target layers whose outputs are tapped (hc mean)
    markov_rank: int = 256
    noise_token_id: int = 128799
    num_stages: int = 3
    n_routed_experts: Optional[int] = None           # per stage; None = the target's (V4: 256)
    num_experts_per_tok: Optional[int] = None        # None = the target's (UNCONFIRMED for V4-Flash, §8 item 9)


def is_dspark(config: Mapping[str, Any]) -> bool:
    return config.get(BLOCK_KEY) is not None


def _fail(key: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"config.json {key}={value!r}: {rule}")


def parse_dspark(config: Mapping[str, Any]) -> Optional[DSparkDraftConfig]:
    """The draft config of a DSpark checkpoint's config.json, None when it has no DSpark keys;
    a bad value raises ValueError naming the key."""
    if not is_dspark(config):
        return None
    layers = int(config.get("num_hidden_layers", 0))
    vocab = int(config.get("vocab_size", 0))
    block = config[BLOCK_KEY]
    if not isinstance(block, int) or block < 1:
        raise _fail(BLOCK_KEY, block, "must be an integer >= 1")
    taps = config.get("dspark_target_layer_ids")
    if not isinstance(taps, (list, tuple)) or not taps or any(not isinstance(t, int) for t in taps):
        raise _fail("dspark_target_layer_ids", taps, "must be a non-empty list of layer indices")
    if layers and any(not 0 <= t < layers for t in taps):
        raise _fail("dspark_target_layer_ids", list(taps), f"entries must be in [0, num_hidden_layers={layers})")
    rank = config.get("dspark_markov_rank", 256)
    if not isinstance(rank, int) or rank < 1:
        raise _fail("dspark_markov_rank", rank, "must be an integer >= 1")
    noise = config.get("dspark_noise_token_id", 128799)
    if not isinstance(noise, int) or not 0 <= noise < (vocab or noise + 1):
        raise _fail("dspark_noise_token_id", noise, f"must be a token id in [0, vocab_size={vocab})")
    stages = config.get("n_mtp_layers", config.get("num_nextn_predict_layers", 3))
    if not isinstance(stages, int) or stages < 1:
        raise _fail("n_mtp_layers", stages, "a DSpark checkpoint needs >= 1 draft stage")
    experts = config.get("dspark_n_routed_experts")
    top_k = config.get("dspark_num_experts_per_tok")
    return DSparkDraftConfig(block_size=block, target_layer_ids=tuple(taps), markov_rank=rank,
                             noise_token_id=noise, num_stages=stages, n_routed_experts=experts,
                             num_experts_per_tok=top_k)


def target_view(config: Mapping[str, Any]) -> Dict[str, Any]:
    """config.json as the target model reads it: for a DSpark checkpoint, without the stages
    (no classic MTP layer; ``compress_ratios`` cut to the main layers)."""
    out = dict(config)
    if not is_dspark(config):
        return out
    out["num_nextn_predict_layers"] = 0
    ratios = out.get("compress_ratios")
    layers = out.get("num_hidden_layers")
    if isinstance(ratios, (list, tuple)) and isinstance(layers, int) and len(ratios) > layers:
        out["compress_ratios"] = list(ratios[:layers])
    return out


def dspark_config_keys(d: DSparkDraftConfig) -> Dict[str, Any]:
    """The config.json keys that state ``d`` (the writer of synthetic checkpoints)."""
    keys: Dict[str, Any] = {BLOCK_KEY: d.block_size, "dspark_target_layer_ids": list(d.target_layer_ids),
                            "dspark_markov_rank": d.markov_rank, "dspark_noise_token_id": d.noise_token_id,
                            "n_mtp_layers": d.num_stages}
    if d.n_routed_experts is not None:
        keys["dspark_n_routed_experts"] = d.n_routed_experts
    if d.num_experts_per_tok is not None:
        keys["dspark_num_experts_per_tok"] = d.num_experts_per_tok
    return keys
