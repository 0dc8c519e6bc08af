"""The native DeepSeek-V4.1 checkpoint schema (reference §4): every tensor's name, stored
shape and safetensors dtype, derived from a :class:`V41Config`. Pure Python.

Names have no ``model.`` prefix. A quantised weight carries a ``<name>.scale`` sibling:

* ``FP8``     -- dense linear, F8_E4M3 ``[N, K]`` + F8_E8M0 ``[ceil(N/b0), ceil(K/b1)]``,
  one scale per ``weight_block_size`` tile (V4.1: 32x32);
* ``FP4``     -- routed expert, MXFP4: I8 ``[N, K/2]`` (element 2i in the low nibble) +
  F8_E8M0 ``[N, K/32]``;
* ``ENGRAM``  -- Engram table, F8_E4M3 ``[rows, head_dim]`` + F8_E8M0 ``[rows, head_dim/32]``
  (per row, per 32 columns);
* ``BF16`` / ``F32`` -- plain tensors (norms BF16; ``hc_*``, ``attn_sink``, gate biases F32).

A checkpoint without ``quantization_config`` stores every FP8/FP4 weight as BF16 without
scales. The vision tower (``vision.*``, ``aligner.*``, ``image_*``) is not part of the
text schema; the loader ignores it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

FP8, FP4, ENGRAM, BF16, F32 = "fp8", "fp4", "engram", "bf16", "f32"
MX_GROUP = 32

# Header dtype strings a tensor of each kind may have (E8M0 scales may also be raw bytes, U8).
WEIGHT_DTYPES = {FP8: ("F8_E4M3",), FP4: ("I8", "U8"), ENGRAM: ("F8_E4M3",), BF16: ("BF16",), F32: ("F32",)}
SCALE_DTYPES = ("F8_E8M0", "U8")
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}

VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint weight (and its scale, when quantised).

    ``shape`` is the logical (dequantised) shape; ``stored_shape`` and ``scale_shape`` are
    what the shard headers hold. ``component`` groups tensors for the census; ``expert``
    is the routed-expert id (None otherwise); ``draft`` marks DSpark (``mtp.*``) tensors.
    """
    name: str
    kind: str
    shape: Tuple[int, ...]
    component: str
    layer: Optional[int] = None
    expert: Optional[int] = None
    draft: bool = False
    block: Tuple[int, int] = (32, 32)

    @property
    def quantized(self) -> bool:
        return self.kind in (FP8, FP4, ENGRAM)

    @property
    def scale_name(self) -> Optional[str]:
        if not self.quantized:
            return None
        return self.name[: -len(".weight")] + ".scale" if self.name.endswith(".weight") else self.name + ".scale"

    @property
    def stored_shape(self) -> Tuple[int, ...]:
        if self.kind == FP4:
            return (self.shape[0], self.shape[1] // 2)
        return self.shape

    @property
    def scale_shape(self) -> Optional[Tuple[int, ...]]:
        n, k = self.shape[0], self.shape[1] if len(self.shape) > 1 else 1
        if self.kind == FP8:
            return (_cdiv(n, self.block[0]), _cdiv(k, self.block[1]))
        if self.kind in (FP4, ENGRAM):
            return (n, k // MX_GROUP)
        return None

    @property
    def dtypes(self) -> Tuple[str, ...]:
        return WEIGHT_DTYPES[self.kind]

    @property
    def numel(self) -> int:
        """Logical parameters (elements of the dequantised tensor)."""
        out = 1
        for d in self.shape:
            out *= d
        return out

    @property
    def scale_numel(self) -> int:
        s = self.scale_shape
        return 0 if s is None else s[0] * s[1]

    @property
    def nbytes(self) -> int:
        """Stored bytes of the weight (without its scale)."""
        if self.kind == FP4:
            return self.numel // 2
        if self.kind in (FP8, ENGRAM):
            return self.numel
        return self.numel * (2 if self.kind == BF16 else 4)


# Census components.
EMBED, HEAD, NORMS, HC, ATTN, INDEXER, COMPRESSOR, ROUTER, SHARED, ROUTED, ENGRAM_TABLE, ENGRAM_PROJ, DSPARK_EXTRA = (
    "embed", "head", "norms", "hc", "attention", "indexer", "compressor", "router", "shared_expert",
    "routed_experts", "engram_table", "engram_proj", "dspark_heads")


class _Builder:
    def __init__(self, cfg):
        self.cfg = cfg
        q = cfg.quant
        self.block = tuple(q.weight_block_size) if q is not None else (32, 32)
        self.dense = FP8 if q is not None else BF16
        self.expert = (FP4 if q.expert_dtype == "fp4" else FP8) if q is not None else BF16
        self.out: List[TensorSpec] = []

    def add(self, name: str, kind: str, shape: Tuple[int, ...], component: str, layer=None, expert=None,
            draft=False) -> None:
        self.out.append(TensorSpec(name, kind, tuple(shape), component, layer, expert, draft, self.block))

    def block_tensors(self, p: str, layer: int, n_experts: int, draft: bool) -> None:
        c = self.cfg
        d, hc = c.dim, c.hc_mult
        mix = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.add(f"{p}hc_{site}_fn", F32, (mix, hc * d), HC, layer, draft=draft)
            self.add(f"{p}hc_{site}_base", F32, (mix,), HC, layer, draft=draft)
            self.add(f"{p}hc_{site}_scale", F32, (3,), HC, layer, draft=draft)
        self.add(f"{p}attn_norm.weight", BF16, (d,), NORMS, layer, draft=draft)
        self.add(f"{p}ffn_norm.weight", BF16, (d,), NORMS, layer, draft=draft)
        a = f"{p}attn."
        self.add(f"{a}attn_sink", F32, (c.n_heads,), ATTN, layer, draft=draft)
        self.add(f"{a}wq_a.weight", self.dense, (c.q_lora_rank, d), ATTN, layer, draft=draft)
        self.add(f"{a}q_norm.weight", BF16, (c.q_lora_rank,), NORMS, layer, draft=draft)
        self.add(f"{a}wq_b.weight", self.dense, (c.n_heads * c.head_dim, c.q_lora_rank), ATTN, layer, draft=draft)
        self.add(f"{a}wkv.weight", self.dense, (c.head_dim, d), ATTN, layer, draft=draft)
        self.add(f"{a}kv_norm.weight", BF16, (c.head_dim,), NORMS, layer, draft=draft)
        self.add(f"{a}wo_a.weight", self.dense, (c.o_groups * c.o_lora_rank, c.n_heads * c.head_dim // c.o_groups),
                 ATTN, layer, draft=draft)
        self.add(f"{a}wo_b.weight", self.dense, (d, c.o_groups * c.o_lora_rank), ATTN, layer, draft=draft)
        if not draft and c.is_kv_source(layer):
            self.add(f"{a}compressor.wkv.weight", BF16, (c.head_dim, d), COMPRESSOR, layer)
            if c.compress_ratios[layer] > 1:
                self.add(f"{a}compressor.wgate.weight", BF16, (c.head_dim, d), COMPRESSOR, layer)
            self.add(f"{a}compressor.norm.weight", BF16, (c.head_dim,), NORMS, layer)
            self.add(f"{a}indexer.wk.weight", BF16, (c.index_head_dim, c.head_dim), INDEXER, layer)
            self.add(f"{a}indexer.k_norm.weight", BF16, (c.index_head_dim,), NORMS, layer)
        if not draft and c.is_index_source(layer):
            self.add(f"{a}indexer.wq_b.weight", self.dense, (c.index_n_heads * c.index_head_dim, c.q_lora_rank),
                     INDEXER, layer)
            self.add(f"{a}indexer.weights_proj.weight", BF16, (c.index_n_heads, d), INDEXER, layer)
        f = f"{p}ffn."
        self.add(f"{f}gate.weight", BF16, (n_experts, d), ROUTER, layer, draft=draft)
        self.add(f"{f}gate.bias", F32, (n_experts,), ROUTER, layer, draft=draft)
        self.add(f"{f}gate.bias_vl", F32, (n_experts,), ROUTER, layer, draft=draft)
        inter = c.moe_inter_dim
        for e in range(n_experts):
            x = f"{f}experts.{e}."
            self.add(f"{x}w1.weight", self.expert, (inter, d), ROUTED, layer, e, draft)
            self.add(f"{x}w2.weight", self.expert, (d, inter), ROUTED, layer, e, draft)
            self.add(f"{x}w3.weight", self.expert, (inter, d), ROUTED, layer, e, draft)
        s = f"{f}shared_experts."
        self.add(f"{s}w1.weight", self.dense, (inter, d), SHARED, layer, draft=draft)
        self.add(f"{s}w2.weight", self.dense, (d, inter), SHARED, layer, draft=draft)
        self.add(f"{s}w3.weight", self.dense, (inter, d), SHARED, layer, draft=draft)

    def engram(self, layer: int) -> None:
        c = self.cfg
        p = f"layers.{layer}.engram."
        rows = c.engram_num_embeddings[c.engram_index(layer)]
        table = ENGRAM if c.quant is not None else BF16
        self.add(f"{p}embed.weight", table, (rows, c.engram_head_dim), ENGRAM_TABLE, layer)
        self.add(f"{p}wkv.weight", self.dense, ((c.hc_mult + 1) * c.dim, c.n_engram_cols * c.engram_head_dim),
                 ENGRAM_PROJ, layer)
        self.add(f"{p}q_weight", BF16, (c.hc_mult, c.dim), ENGRAM_PROJ, layer)
        self.add(f"{p}k_weight", BF16, (c.hc_mult, c.dim), ENGRAM_PROJ, layer)


def checkpoint_spec(cfg, include_draft: bool = True) -> List[TensorSpec]:
    """Every text tensor of a V4.1 checkpoint for ``cfg``, in a fixed order."""
    b = _Builder(cfg)
    c = cfg
    b.add("embed.weight", BF16, (c.vocab_size, c.dim), EMBED)
    for layer in range(c.n_layers):
        if c.is_engram(layer):
            b.engram(layer)
        b.block_tensors(f"layers.{layer}.", layer, c.n_routed_experts, draft=False)
    b.add("norm.weight", BF16, (c.dim,), NORMS)
    b.add("head.weight", BF16, (c.vocab_size, c.dim), HEAD)
    if include_draft:
        for m in range(c.n_mtp_layers):
            p = f"mtp.{m}."
            layer = c.n_layers + m
            if m == 0:
                b.add(f"{p}main_proj.weight", b.dense, (c.dim, len(c.dspark_target_layer_ids) * c.dim),
                      DSPARK_EXTRA, layer, draft=True)
                b.add(f"{p}main_norm.weight", BF16, (c.dim,), NORMS, layer, draft=True)
            b.block_tensors(p, layer, c.dspark_n_routed_experts, draft=True)
            if m == c.n_mtp_layers - 1:
                b.add(f"{p}norm.weight", BF16, (c.dim,), NORMS, layer, draft=True)
                b.add(f"{p}markov_head.embed.weight", BF16, (c.vocab_size, c.dspark_markov_rank), DSPARK_EXTRA,
                      layer, draft=True)
                b.add(f"{p}markov_head.head.weight", BF16, (c.vocab_size, c.dspark_markov_rank), DSPARK_EXTRA,
                      layer, draft=True)
                b.add(f"{p}confidence_head.proj.weight", BF16, (1, c.dim + c.dspark_markov_rank), DSPARK_EXTRA,
                      layer, draft=True)
    return b.out


def stored_tensors(specs: List[TensorSpec]) -> Iterator[Tuple[str, Tuple[int, ...], Tuple[str, ...], TensorSpec]]:
    """(header name, stored shape, allowed dtypes, owning spec) of every stored tensor, scales included."""
    for s in specs:
        yield s.name, s.stored_shape, s.dtypes, s
        if s.scale_name:
            yield s.scale_name, s.scale_shape, SCALE_DTYPES, s


def by_name(specs: List[TensorSpec]) -> Dict[str, TensorSpec]:
    return {s.name: s for s in specs}


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)
