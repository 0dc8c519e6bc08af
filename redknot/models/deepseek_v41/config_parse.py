"""config.json (released nested layout or flat reference names) -> :class:`V41Config`,
and every field check in one place (:func:`validate`, run by the dataclass itself)."""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from redknot.models.deepseek_v41.config import (
    ARCHITECTURE, COMPRESS_RATIOS, ENTRY, MODEL_TYPE, TEXT_MODEL_TYPE, V41Quant)

# Released ``text_config`` / HF key -> flat reference key (§2.2 column 3).
HF_TO_REF: Dict[str, str] = {
    "hidden_size": "dim", "moe_intermediate_size": "moe_inter_dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "qk_rope_head_dim": "rope_head_dim", "rms_norm_eps": "norm_eps",
    "num_experts_per_tok": "n_activated_experts", "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale", "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer", "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers", "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "torch_dtype": "dtype",
}
REF_TO_HF = {v: k for k, v in HF_TO_REF.items() if k != "torch_dtype"}
# YaRN keys inside ``rope_scaling`` / ``rope_parameters`` -> flat reference key.
_YARN = {"factor": "rope_factor", "beta_fast": "beta_fast", "beta_slow": "beta_slow",
         "original_max_position_embeddings": "original_seq_len"}
# Flat-config keys that describe the runtime or the vision tower, not the text backbone.
_IGNORED_FLAT = ("max_batch_size", "max_seq_len", "temperature")

_TUPLES = ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
           "engram_num_embeddings", "dspark_target_layer_ids")


def _fail(field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"config.json field {field!r}={value!r}: {allowed}")


def _short(v: Any) -> Any:
    return f"<{len(v)} entries>" if isinstance(v, (list, tuple)) and len(v) > 12 else v


# ---------------------------------------------------------------- parsing
def _quant(q: Any, flat: Dict[str, Any]) -> Optional[V41Quant]:
    """``quantization_config`` (released) or the flat ``dtype: fp8`` / ``expert_dtype``."""
    if q is None:
        if flat.get("dtype") == "fp8":
            return V41Quant(expert_dtype=flat.get("expert_dtype") or "fp8")
        return None
    if not isinstance(q, dict):
        raise _fail("quantization_config", q, "must be a mapping")
    wbs = q.get("weight_block_size", [32, 32])
    if (not isinstance(wbs, (list, tuple)) or len(wbs) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in wbs)):
        raise _fail("quantization_config.weight_block_size", wbs, "must be two positive integers, e.g. [32, 32]")
    return V41Quant(quant_method=q.get("quant_method", "fp8"), activation_scheme=q.get("activation_scheme", "dynamic"),
                    weight_block_size=(wbs[0], wbs[1]), scale_fmt=q.get("scale_fmt", "ue8m0"),
                    expert_dtype=q.get("expert_dtype", flat.get("expert_dtype", "fp4")))


def _flatten(d: Dict[str, Any]) -> Dict[str, Any]:
    """One flat dict of reference names from either layout; conflicting spellings are an error."""
    ENTRY.check_identity(d)
    text = d.get("text_config")
    if text is not None:
        if not isinstance(text, dict):
            raise _fail("text_config", type(text).__name__, "must be a mapping")
        tmt = text.get("model_type")
        if tmt is not None and tmt != TEXT_MODEL_TYPE:
            raise _fail("text_config.model_type", tmt, f"must be {TEXT_MODEL_TYPE!r}")
        # Root keys (token ids, quantization) and text keys; text wins for backbone numbers.
        src = {k: v for k, v in d.items() if k not in ("text_config", "vision_config")}
        src.update(text)
    else:
        src = dict(d)
    out: Dict[str, Any] = {}
    origin: Dict[str, str] = {}
    for key, value in src.items():
        if key.startswith("vision_") or key in _IGNORED_FLAT:
            continue
        if key in ("rope_scaling", "rope_parameters"):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise _fail(key, value, "must be a mapping")
            rtype = value.get("rope_type", value.get("type", "yarn"))
            if rtype not in ("yarn", "default"):
                raise _fail(f"{key}.rope_type", rtype, "V4.1 uses 'yarn' (on ratio != 0 layers)")
            pairs = [(f"{key}.{k}", _YARN[k], v) for k, v in value.items() if k in _YARN]
            if "rope_theta" in value:
                pairs.append((f"{key}.rope_theta", "rope_theta", value["rope_theta"]))
        else:
            pairs = [(key, HF_TO_REF.get(key, key), value)]
        for name, ref, v in pairs:
            if ref in out and out[ref] != v:
                raise _fail(name, v, f"contradicts {origin[ref]}={out[ref]!r} (the same field)")
            out[ref], origin[ref] = v, name
    return out


def flat_overrides(overrides: Dict[str, Any]) -> Dict[str, Any]:
    """Override keys (released or flat names, ``rope_scaling`` included) -> flat reference names."""
    d = dict(overrides)
    q = d.pop("quantization_config", None)
    out = _flatten(d)
    if q is not None:
        out["quantization_config"] = q
    return out


def parse_dict(cls, d: Dict[str, Any]):
    """The released nested config.json or the flat reference one -> ``cls`` (validated)."""
    if not isinstance(d, dict):
        raise ValueError(f"config.json must be a JSON object, got {type(d).__name__}")
    flat = _flatten(d)
    quant = _quant(flat.pop("quantization_config", None), flat)
    known = {f for f in cls.__dataclass_fields__ if f not in ("quant", "source_n_layers")}
    kwargs: Dict[str, Any] = {}
    for key in known & set(flat):
        v = flat[key]
        if key == "engram_num_embeddings" and v is None:
            pass   # derived from the primes (validate)
        elif key in _TUPLES:
            if not isinstance(v, (list, tuple)):
                raise _fail(REF_TO_HF.get(key, key), v, "must be a list of integers")
            v = tuple(v)
        kwargs[key] = v
    if "dtype" in kwargs and kwargs["dtype"] in ("fp8", "fp4"):
        kwargs["dtype"] = "bfloat16"   # the flat config's "dtype" is the weight format, read above
    if "engram_num_embeddings" not in kwargs and "engram_layer_ids" in kwargs:
        kwargs["engram_num_embeddings"] = None   # derived from the primes (validate)
    kwargs.pop("expert_dtype", None)
    return cls(quant=quant, **kwargs)


def to_hf_dict(cfg) -> Dict[str, Any]:
    """The released nested layout: root keys, ``text_config`` (HF names), ``quantization_config``."""
    flat = cfg.to_flat_dict()
    q = flat.pop("quantization_config")
    text: Dict[str, Any] = {"model_type": TEXT_MODEL_TYPE}
    root_keys = ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id", "dtype")
    yarn = {}
    for key, v in flat.items():
        if key in root_keys:
            continue
        if key in _YARN.values():
            yarn[{r: h for h, r in _YARN.items()}[key]] = v
            continue
        text[REF_TO_HF.get(key, key)] = v
    text["rope_scaling"] = {"rope_type": "yarn", **yarn}
    text["num_key_value_heads"] = 1
    text["tie_word_embeddings"] = False
    d: Dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
                         **{k: flat[k] for k in root_keys}, "text_config": text}
    if q is not None:
        d["quantization_config"] = q
    return d


# ---------------------------------------------------------------- validation
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pos_int(name: str, v: Any, minimum: int = 1) -> None:
    if not _is_int(v) or v < minimum:
        raise _fail(REF_TO_HF.get(name, name), v, f"must be an integer >= {minimum}")


def _pos_num(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise _fail(REF_TO_HF.get(name, name), v, "must be a positive number")


def _layer_list(name: str, v: Sequence[int], n: int) -> None:
    """Sorted (strictly ascending) layer ids in [0, n)."""
    hf = REF_TO_HF.get(name, name)
    if any(not _is_int(x) for x in v):
        raise _fail(hf, list(v), "entries must be integers")
    if list(v) != sorted(set(v)):
        raise _fail(hf, list(v), "must be sorted ascending without repeats")
    bad = [x for x in v if not 0 <= x < n]
    if bad:
        raise _fail(hf, list(v), f"layer ids must be in [0, {n}) (num_hidden_layers={n}); {bad} are not")


def validate(cfg) -> None:
    """Every field of a :class:`V41Config`; raises ValueError naming the field, value and rule."""
    _check_numbers(cfg)
    _check_schedule(cfg)
    _check_engram(cfg)
    _check_tokens(cfg)


def _check_numbers(cfg) -> None:
    """Sizes, rates, MoE and the quantisation groups."""
    ints = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "head_dim", "rope_head_dim",
            "q_lora_rank", "o_lora_rank", "o_groups", "max_position_embeddings", "n_routed_experts",
            "n_activated_experts", "window_size", "index_n_heads", "index_head_dim", "index_topk",
            "candidate_topk_blocks", "candidate_block_size", "hc_mult", "hc_sinkhorn_iters",
            "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads", "engram_head_dim",
            "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
            "dspark_n_routed_experts", "dspark_n_activated_experts")
    for name in ints:
        _pos_int(name, getattr(cfg, name))
    for name in ("n_mtp_layers", "original_seq_len", "bos_token_id", "eos_token_id", "pad_token_id",
                 "engram_pad_id", "dspark_noise_token_id", "image_token_id"):
        _pos_int(name, getattr(cfg, name), minimum=0)
    for name in ("swiglu_limit", "norm_eps", "rope_theta", "compress_rope_theta", "rope_factor", "beta_fast",
                 "beta_slow", "route_scale", "gate_temp", "hc_eps"):
        _pos_num(name, getattr(cfg, name))
    if cfg.n_shared_experts != 1:
        raise _fail("n_shared_experts", cfg.n_shared_experts, "V4.1 has exactly 1 shared expert")
    if cfg.score_func != "sqrtsoftplus":
        raise _fail("scoring_func", cfg.score_func, "V4.1 routes with 'sqrtsoftplus'")
    if cfg.n_activated_experts > cfg.n_routed_experts:
        raise _fail("num_experts_per_tok", cfg.n_activated_experts,
                    f"must be <= n_routed_experts ({cfg.n_routed_experts})")
    if cfg.dspark_n_activated_experts > cfg.dspark_n_routed_experts:
        raise _fail("dspark_num_experts_per_tok", cfg.dspark_n_activated_experts,
                    f"must be <= dspark_n_routed_experts ({cfg.dspark_n_routed_experts})")
    if not 0 < cfg.rope_head_dim < cfg.head_dim or cfg.rope_head_dim % 2:
        raise _fail("qk_rope_head_dim", cfg.rope_head_dim, f"must be even and in (0, head_dim={cfg.head_dim})")
    if cfg.n_heads % cfg.o_groups:
        raise _fail("o_groups", cfg.o_groups, f"must divide num_attention_heads ({cfg.n_heads})")
    if cfg.index_head_dim <= cfg.rope_head_dim:
        raise _fail("index_head_dim", cfg.index_head_dim, f"must exceed qk_rope_head_dim ({cfg.rope_head_dim})")
    # Quantisation groups (§7.2): per-32 activation / window / index-key groups, per-16 latent groups.
    for name, v, g in (("head_dim", cfg.head_dim, 32), ("index_head_dim", cfg.index_head_dim, 32),
                       ("dim", cfg.dim, 32), ("engram_head_dim", cfg.engram_head_dim, 32)):
        if v % g:
            raise _fail(REF_TO_HF.get(name, name), v, f"must be a multiple of {g} (the quantisation group)")
    if cfg.quant is not None:
        q = cfg.quant
        if q.quant_method != "fp8":
            raise _fail("quantization_config.quant_method", q.quant_method, "must be 'fp8'")
        if q.scale_fmt != "ue8m0":
            raise _fail("quantization_config.scale_fmt", q.scale_fmt, "must be 'ue8m0'")
        if q.expert_dtype not in ("fp4", "fp8"):
            raise _fail("quantization_config.expert_dtype", q.expert_dtype, "must be 'fp4' or 'fp8'")
        for name, v in (("moe_intermediate_size", cfg.moe_inter_dim), ("q_lora_rank", cfg.q_lora_rank),
                        ("o_lora_rank", cfg.o_lora_rank)):
            if v % 32:
                raise _fail(name, v, "must be a multiple of 32 (FP8/FP4 activation groups)")



def _check_schedule(cfg) -> None:
    """compress_ratios and the kv / index / candidate sources (reference §2.5)."""
    n, total = cfg.n_layers, cfg.n_layers + cfg.n_mtp_layers
    ratios = cfg.compress_ratios
    if len(ratios) != total:
        raise _fail("compress_ratios", _short(ratios),
                    f"needs {total} entries: num_hidden_layers ({n}) + num_nextn_predict_layers ({cfg.n_mtp_layers})")
    bad = [r for r in ratios if r not in COMPRESS_RATIOS]
    if bad:
        raise _fail("compress_ratios", _short(ratios), f"entries must be in {list(COMPRESS_RATIOS)}; got {bad}")
    if any(ratios[n:]):
        raise _fail("compress_ratios", _short(ratios), "the DSpark stages (entries past num_hidden_layers) must be 0")

    _layer_list("kv_source_layers", cfg.kv_source_layers, n)
    _layer_list("index_source_layers", cfg.index_source_layers, n)
    for name, srcs in (("kv_source_layers", cfg.kv_source_layers), ("index_source_layers", cfg.index_source_layers)):
        zero = [s for s in srcs if ratios[s] == 0]
        if zero:
            raise _fail(REF_TO_HF[name], list(srcs), f"layers {zero} have compress ratio 0 (a source needs one)")
    for layer in range(n):
        r = ratios[layer]
        if r == 0:
            continue
        kv = [s for s in cfg.kv_source_layers if s <= layer]
        if not kv:
            raise _fail("kv_source_layer_ids", list(cfg.kv_source_layers),
                        f"layer {layer} reads a compressed cache (ratio {r}) but no kv source is at or below it")
        if ratios[kv[-1]] != r:
            raise _fail("compress_ratios", _short(ratios),
                        f"layer {layer} has ratio {r} but reads kv source {kv[-1]}, whose ratio is {ratios[kv[-1]]}")
        idx = [s for s in cfg.index_source_layers if s <= layer]
        if not idx:
            raise _fail("index_source_layer_ids", list(cfg.index_source_layers),
                        f"layer {layer} reads a compressed cache but no index source is at or below it")
        if idx[-1] < kv[-1]:
            raise _fail("index_source_layer_ids", list(cfg.index_source_layers),
                        f"layer {layer} would take top-k from index source {idx[-1]}, below its kv source "
                        f"{kv[-1]} (each kv source must also be an index source)")
    c = cfg.candidate_source_layer
    if not _is_int(c) or c < -1:
        raise _fail("candidate_source_layer_id", c, "must be -1 (no candidate level) or a layer id")
    if c >= 0 and not (cfg.is_index_source(c) and cfg.is_kv_source(c)):
        raise _fail("candidate_source_layer_id", c,
                    "must be a layer that is both a kv source and an index source, or -1")


def _check_engram(cfg) -> None:
    """Engram layers and table rows (each layer's rows = the sum of its primes, §2.6)."""
    _layer_list("engram_layer_ids", cfg.engram_layer_ids, cfg.n_layers)
    if cfg.engram_layer_ids:
        from redknot.models.deepseek_v41.engram_hash import check_num_embeddings, engram_primes, table_rows

        primes = engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                               cfg.engram_vocab_size)
        if cfg.engram_num_embeddings is None:
            object.__setattr__(cfg, "engram_num_embeddings", tuple(table_rows(p) for p in primes))
        if len(cfg.engram_num_embeddings) != len(cfg.engram_layer_ids):
            raise _fail("engram_num_embeddings", list(cfg.engram_num_embeddings),
                        f"needs one entry per engram layer ({len(cfg.engram_layer_ids)})")
        msg = check_num_embeddings(cfg.engram_num_embeddings, primes, cfg.engram_layer_ids)
        if msg:
            raise _fail("engram_num_embeddings", list(cfg.engram_num_embeddings), msg)
        if cfg.engram_max_ngram_size < 2:
            raise _fail("engram_max_ngram_size", cfg.engram_max_ngram_size, "must be >= 2")
        if cfg.engram_pad_id >= cfg.vocab_size:
            raise _fail("engram_pad_token_id", cfg.engram_pad_id, f"must be < vocab_size ({cfg.vocab_size})")
        if cfg.engram_compressed_vocab_size > cfg.vocab_size:
            raise _fail("engram_compressed_vocab_size", cfg.engram_compressed_vocab_size,
                        f"must be <= vocab_size ({cfg.vocab_size})")
    elif cfg.engram_num_embeddings:
        raise _fail("engram_num_embeddings", list(cfg.engram_num_embeddings), "must be empty without engram layers")
    else:
        object.__setattr__(cfg, "engram_num_embeddings", ())


def _check_tokens(cfg) -> None:
    """DSpark targets and the special token ids."""
    if cfg.n_mtp_layers:
        _layer_list("dspark_target_layer_ids", cfg.dspark_target_layer_ids, cfg.n_layers)
        if not cfg.dspark_target_layer_ids:
            raise _fail("dspark_target_layer_ids", [], "needs at least one layer when DSpark stages exist")
        if cfg.dspark_noise_token_id >= cfg.vocab_size:
            raise _fail("dspark_noise_token_id", cfg.dspark_noise_token_id, f"must be < vocab_size ({cfg.vocab_size})")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(cfg, name) >= cfg.vocab_size:
            raise _fail(name, getattr(cfg, name), f"must be < vocab_size ({cfg.vocab_size})")
