"""config.json (modern or legacy keys) -> :class:`V4Config`, with every check in one place."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from redknot.models.deepseek_v4.config import (
    CSA, ENTRY, HASH_MOE, HCA, LAYER_TYPES, MOE, SLIDING, QuantConfig, YarnScaling)


def _fail(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.json field {field!r}={value!r}: {allowed}")


def _int(d: Dict[str, Any], key: str, default: Any = None, minimum: int = 1) -> int:
    v = d.get(key, default)
    if v is None:
        raise _fail(key, v, "required (an integer)")
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise _fail(key, v, f"must be an integer >= {minimum}")
    return v


def _float(d: Dict[str, Any], key: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise _fail(key, v, "must be a positive number")
    return float(v)


def _ratios(d: Dict[str, Any]) -> Tuple[int, int]:
    rates = d.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise _fail("compress_rates", rates, "must be a mapping {layer type: ratio}")
    unknown = sorted(set(rates) - {CSA, HCA})
    if unknown:
        raise _fail("compress_rates", rates, f"keys must be among {[CSA, HCA]}")
    csa = rates.get(CSA, d.get("compress_rate_csa", 4))
    hca = rates.get(HCA, d.get("compress_rate_hca", 128))
    for name, v in (("compress_rates.csa", csa), ("compress_rates.hca", hca)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _fail(name, v, "must be a positive integer")
    if csa == hca:
        raise _fail("compress_rates", rates, "CSA and HCA ratios must differ")
    return csa, hca


def _layer_types(d: Dict[str, Any], n: int, csa: int, hca: int) -> Tuple[Tuple[str, ...], int]:
    """Per-layer attention types and the MTP layer's compress ratio."""
    mtp_ratio = 0
    if d.get("layer_types") is not None:
        types = list(d["layer_types"])
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise _fail("layer_types", bad, f"entries must be one of {list(LAYER_TYPES)}")
    elif d.get("compress_ratios") is not None:
        raw = list(d["compress_ratios"])
        by_ratio = {0: SLIDING, csa: CSA, hca: HCA}
        bad = [r for r in raw if r not in by_ratio]
        if bad:
            raise _fail("compress_ratios", raw, f"entries must be in {sorted(by_ratio)}")
        n_mtp = d.get("num_nextn_predict_layers", 1) or 0
        if len(raw) == n + n_mtp and n_mtp:
            mtp_ratio = raw[n]
        elif len(raw) != n:
            raise _fail("compress_ratios", f"<{len(raw)} entries>",
                        f"needs num_hidden_layers ({n}) entries, or {n + n_mtp} with the MTP slot last")
        types = [by_ratio[r] for r in raw[:n]]
    else:
        raise _fail("layer_types", None, "config.json needs `layer_types` or legacy `compress_ratios`")
    if len(types) != n:
        raise _fail("layer_types", f"<{len(types)} entries>", f"must have num_hidden_layers={n} entries")
    if mtp_ratio != 0:
        raise _fail("compress_ratios", d["compress_ratios"], "the MTP slot (last entry) must be 0 (sliding only)")
    return tuple(types), mtp_ratio


def _mlp_types(d: Dict[str, Any], n: int) -> Tuple[str, ...]:
    if d.get("mlp_layer_types") is not None:
        types = list(d["mlp_layer_types"])[:n]
        bad = [t for t in types if t not in (HASH_MOE, MOE)]
        if bad or len(types) != n:
            raise _fail("mlp_layer_types", d["mlp_layer_types"],
                        f"needs {n} entries, each {HASH_MOE!r} or {MOE!r}")
        return tuple(types)
    n_hash = d.get("num_hash_layers", 3)
    if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
        raise _fail("num_hash_layers", n_hash, "must be an integer >= 0")
    return tuple([HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash))


def _rope(d: Dict[str, Any], head_dim: int) -> Tuple[int, float, float, Optional[YarnScaling]]:
    """(rope_dim, main theta, compress theta, YaRN) from either key layout."""
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = _int(d, "qk_rope_head_dim")
    else:
        prf = d.get("partial_rotary_factor", 64 / 512)
        rope_dim = int(round(head_dim * float(prf)))
        if abs(rope_dim - head_dim * float(prf)) > 1e-6:
            raise _fail("partial_rotary_factor", prf, f"head_dim ({head_dim}) * factor must be an integer")
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise _fail("qk_rope_head_dim", rope_dim, f"must be even and in (0, head_dim={head_dim}]")
    rp = d.get("rope_parameters") or {}
    main, comp = rp.get("main"), rp.get("compress")
    if isinstance(main, dict) and isinstance(comp, dict):
        theta, ctheta, scaling = main.get("rope_theta", 10000.0), comp.get("rope_theta", 160000.0), comp
        if main.get("rope_type", "default") != "default":
            raise _fail("rope_parameters.main.rope_type", main.get("rope_type"), "must be 'default'")
    else:
        theta = d.get("rope_theta", 10000.0)
        ctheta = d.get("compress_rope_theta", 160000.0)
        scaling = d.get("rope_scaling") or (rp if rp else None)
    yarn = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "yarn":
            yarn = YarnScaling(
                factor=float(scaling.get("factor", 16.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 65536)),
                beta_fast=float(scaling.get("beta_fast") or 32.0),
                beta_slow=float(scaling.get("beta_slow") or 1.0))
            if yarn.factor <= 0 or yarn.original_max_position_embeddings <= 0:
                raise _fail("rope_scaling", scaling, "factor and original_max_position_embeddings must be > 0")
        elif kind != "default":
            raise _fail("rope_scaling.type", kind, "must be 'yarn' (or absent)")
    return rope_dim, float(theta), float(ctheta), yarn


def _quant(d: Dict[str, Any]) -> Optional[QuantConfig]:
    q = d.get("quantization_config")
    expert_dtype = d.get("expert_dtype")
    if q is None:
        if expert_dtype is not None:
            raise _fail("expert_dtype", expert_dtype, "needs a quantization_config")
        return None
    if not isinstance(q, dict):
        raise _fail("quantization_config", q, "must be a mapping")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise _fail("quantization_config.quant_method", method, "must be 'fp8'")
    fmt, scale_fmt = q.get("fmt", "e4m3"), q.get("scale_fmt", "ue8m0")
    if fmt != "e4m3":
        raise _fail("quantization_config.fmt", fmt, "must be 'e4m3'")
    if scale_fmt not in ("ue8m0", None):
        raise _fail("quantization_config.scale_fmt", scale_fmt, "must be 'ue8m0'")
    block = tuple(q.get("weight_block_size") or (128, 128))
    if block != (128, 128):
        raise _fail("quantization_config.weight_block_size", list(block), "must be [128, 128]")
    ed = q.get("expert_dtype", expert_dtype) or "fp8"
    if ed not in ("fp8", "fp4"):
        raise _fail("quantization_config.expert_dtype", ed, "must be 'fp8' or 'fp4'")
    return QuantConfig(method="fp8", fmt="e4m3", scale_fmt="ue8m0", weight_block_size=(128, 128),
                       expert_dtype=ed)


def _check_consistency(cfg_kwargs: Dict[str, Any]) -> None:
    k = cfg_kwargs
    if k["num_heads"] % k["o_groups"]:
        raise _fail("o_groups", k["o_groups"], f"must divide num_attention_heads={k['num_heads']}")
    if k["num_experts_per_tok"] > k["n_routed_experts"]:
        raise _fail("num_experts_per_tok", k["num_experts_per_tok"],
                    f"must be <= n_routed_experts={k['n_routed_experts']}")
    if k["rope_dim"] > k["index_head_dim"]:
        raise _fail("index_head_dim", k["index_head_dim"], f"must be >= qk_rope_head_dim={k['rope_dim']}")
    if not 0 <= k["bos_token_id"] < k["vocab_size"] or not 0 <= k["eos_token_id"] < k["vocab_size"]:
        raise _fail("bos_token_id/eos_token_id", (k["bos_token_id"], k["eos_token_id"]),
                    f"must be in [0, vocab_size={k['vocab_size']})")


def parse_hf_dict(cls, d: Dict[str, Any]):
    if not isinstance(d, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
    ENTRY.check_identity(d)
    n = _int(d, "num_hidden_layers")
    if d.get("num_key_value_heads", 1) != 1:
        raise _fail("num_key_value_heads", d["num_key_value_heads"], "must be 1 (one shared K=V head)")
    if d.get("n_shared_experts", 1) != 1:
        raise _fail("n_shared_experts", d["n_shared_experts"], "must be 1")
    if d.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
        raise _fail("scoring_func", d["scoring_func"], "must be 'sqrtsoftplus'")
    if d.get("topk_method", "noaux_tc") != "noaux_tc":
        raise _fail("topk_method", d["topk_method"], "must be 'noaux_tc'")
    if d.get("norm_topk_prob", True) is not True:
        raise _fail("norm_topk_prob", d["norm_topk_prob"], "must be true")
    if d.get("tie_word_embeddings", False):
        raise _fail("tie_word_embeddings", d["tie_word_embeddings"], "must be false (embed and head are separate)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key, False):
            raise _fail(key, d[key], "must be false")
    hidden_act = d.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise _fail("hidden_act", hidden_act, "must be 'silu'")
    head_dim = _int(d, "head_dim", 512)
    csa, hca = _ratios(d)
    layer_types, _ = _layer_types(d, n, csa, hca)
    rope_dim, theta, ctheta, yarn = _rope(d, head_dim)
    eos = d.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    kwargs: Dict[str, Any] = dict(
        vocab_size=_int(d, "vocab_size", 129280), hidden_size=_int(d, "hidden_size", 4096),
        num_layers=n, num_heads=_int(d, "num_attention_heads", 64), head_dim=head_dim, rope_dim=rope_dim,
        q_lora_rank=_int(d, "q_lora_rank", 1024), o_groups=_int(d, "o_groups", 8),
        o_lora_rank=_int(d, "o_lora_rank", 1024), sliding_window=_int(d, "sliding_window", 128),
        layer_types=layer_types, csa_ratio=csa, hca_ratio=hca,
        index_n_heads=_int(d, "index_n_heads", 64), index_head_dim=_int(d, "index_head_dim", 128),
        index_topk=_int(d, "index_topk", 512), n_routed_experts=_int(d, "n_routed_experts", 256),
        num_experts_per_tok=_int(d, "num_experts_per_tok", 6),
        moe_intermediate_size=_int(d, "moe_intermediate_size", 2048), mlp_layer_types=_mlp_types(d, n),
        routed_scaling_factor=_float(d, "routed_scaling_factor", 1.5),
        swiglu_limit=_float(d, "swiglu_limit", 10.0), hc_mult=_int(d, "hc_mult", 4),
        hc_sinkhorn_iters=_int(d, "hc_sinkhorn_iters", 20), hc_eps=_float(d, "hc_eps", 1e-6),
        rms_norm_eps=_float(d, "rms_norm_eps", 1e-6), rope_theta=theta, compress_rope_theta=ctheta,
        yarn=yarn, max_position_embeddings=_int(d, "max_position_embeddings", 1048576),
        num_mtp_layers=_int(d, "num_nextn_predict_layers", 1, minimum=0),
        bos_token_id=_int(d, "bos_token_id", 0, minimum=0), eos_token_id=eos if isinstance(eos, int) else -1,
        quant=_quant(d), torch_dtype=str(d.get("torch_dtype", d.get("dtype", "bfloat16"))))
    if kwargs["num_mtp_layers"] > 1:
        raise _fail("num_nextn_predict_layers", kwargs["num_mtp_layers"], "must be 0 or 1")
    _check_consistency(kwargs)
    return cls(**kwargs)


def describe(cfg) -> List[str]:
    """Short human summary lines (used by the catalog and progress output)."""
    kinds = {SLIDING: "SWA", CSA: "CSA", HCA: "HCA"}
    sched = ",".join(kinds[t] for t in cfg.layer_types)
    return [f"D={cfg.hidden_size} H={cfg.num_heads}x{cfg.head_dim} layers={cfg.num_layers} [{sched}]",
            f"experts={cfg.n_routed_experts} top{cfg.num_experts_per_tok} I={cfg.moe_intermediate_size} "
            f"window={cfg.sliding_window} ratios={cfg.csa_ratio}/{cfg.hca_ratio} mtp={cfg.num_mtp_layers}"]
