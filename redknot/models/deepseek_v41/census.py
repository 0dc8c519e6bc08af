"""Parameter and byte census of a V4.1 checkpoint, by component, from the schema alone
(pure shape arithmetic over :func:`checkpoint.checkpoint_spec`; no tensor is made).

:data:`PUBLISHED` is the memory table of the vLLM recipe for DeepSeek-V4.1-Flash
(entries and stored GiB per row); :func:`recipe_rows` groups this census the same way
so the two can be compared. The recipe's "Embedding + LM head, norms" row includes the
vision tower, which the text schema leaves out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from redknot.models.deepseek_v41.checkpoint import (
    BF16, ENGRAM, F32, FP4, FP8, ROUTED, TensorSpec, checkpoint_spec)

GIB = 1 << 30

# vLLM recipe "Memory" table for DeepSeek-V4.1-Flash: row -> (entries, stored GiB).
PUBLISHED: Dict[str, Tuple[float, float]] = {
    "Routed + DSpark experts (MXFP4)": (557.2e9, 259.5),
    "Engram tables (FP8)": (196.6e9, 183.1),
    "Attention, dense projections, routers (FP8)": (7.4e9, 6.9),
    "Embedding + LM head (BF16), norms (FP32)": (2.0e9, 3.9),
    "UE8M0 block scales": (23.6e9, 21.9),
}
PUBLISHED_TENSORS = 96085       # all 48 shards, vision included
PUBLISHED_BACKBONE = 552e9      # "552B backbone": routed experts, attention, embeddings
PUBLISHED_DRAFT = 14e9          # "the drafter adds about 14B parameters"


@dataclass
class Count:
    """Parameters, stored bytes (weights, scales apart) and stored tensors (scales included)."""
    params: int = 0
    weight_bytes: int = 0
    scales: int = 0
    tensors: int = 0

    def add(self, s: TensorSpec) -> None:
        self.params += s.numel
        self.weight_bytes += s.nbytes
        self.scales += s.scale_numel
        self.tensors += 1 + (1 if s.scale_name else 0)

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.scales   # E8M0 scales are one byte each


def census(cfg, include_draft: bool = True) -> Dict[str, Count]:
    """Counts by component; DSpark components are prefixed ``dspark.``."""
    out: Dict[str, Count] = {}
    for s in checkpoint_spec(cfg, include_draft=include_draft):
        key = ("dspark." if s.draft else "") + s.component
        out.setdefault(key, Count()).add(s)
    return out


def total(counts: Dict[str, Count]) -> Count:
    t = Count()
    for c in counts.values():
        t.params += c.params
        t.weight_bytes += c.weight_bytes
        t.scales += c.scales
        t.tensors += c.tensors
    return t


def recipe_rows(cfg) -> List[Tuple[str, int, float]]:
    """(recipe row, entries, stored GiB) of this config, grouped as the recipe's table."""
    rows = {k: [0, 0] for k in PUBLISHED}
    for s in checkpoint_spec(cfg, include_draft=True):
        if s.component == ROUTED:
            key = "Routed + DSpark experts (MXFP4)"
        elif s.kind == ENGRAM:
            key = "Engram tables (FP8)"
        elif s.kind in (FP8, FP4):
            key = "Attention, dense projections, routers (FP8)"
        else:
            assert s.kind in (BF16, F32)
            key = "Embedding + LM head (BF16), norms (FP32)"
        rows[key][0] += s.numel
        rows[key][1] += s.nbytes
        rows["UE8M0 block scales"][0] += s.scale_numel
        rows["UE8M0 block scales"][1] += s.scale_numel
    return [(k, n, b / GIB) for k, (n, b) in rows.items()]


def backbone_params(cfg) -> int:
    """The recipe's "backbone": everything of the text model except Engram tables and DSpark."""
    return sum(s.numel for s in checkpoint_spec(cfg, include_draft=False) if s.kind != ENGRAM)


def draft_params(cfg) -> int:
    return sum(s.numel for s in checkpoint_spec(cfg, include_draft=True) if s.draft)


def active_params(cfg, layers=None) -> int:
    """Weights one token multiplies (routed: its top-k experts; shared expert, attention,
    indexer, compressor, router, Engram projection; embedding row and head excluded)
    over ``layers`` (default: all backbone layers)."""
    layers = range(cfg.n_layers) if layers is None else layers
    keep = set(layers)
    n = 0
    for s in checkpoint_spec(cfg, include_draft=False):
        if s.layer is None or s.layer not in keep or s.kind == ENGRAM:
            continue
        if s.component == ROUTED:
            if s.expert < cfg.n_activated_experts:   # any k experts: all have the same size
                n += s.numel
        elif len(s.shape) == 2 and not s.name.endswith(("_fn",)):
            n += s.numel
    return n


def meta_tensors(cfg, include_draft: bool = True):
    """Every stored tensor of the checkpoint as a ``meta``-device tensor of its stored dtype and
    shape (scales included): the real model's storage, built without memory."""
    import torch

    dtypes = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "BF16": torch.bfloat16, "F32": torch.float32,
              "F8_E8M0": torch.float8_e8m0fnu}
    from redknot.models.deepseek_v41.checkpoint import SCALE_DTYPES, stored_tensors

    out = {}
    for name, shape, allowed, spec in stored_tensors(checkpoint_spec(cfg, include_draft=include_draft)):
        dtype = dtypes[SCALE_DTYPES[0]] if allowed == SCALE_DTYPES else dtypes[allowed[0]]
        out[name] = torch.empty(shape, dtype=dtype, device="meta")
    return out


def vision_params(layers: int = 32, width: int = 1024, inter: int = 2816, patch: int = 14, dim: int = 5120,
                  downsample: int = 3) -> int:
    """The vision tower and aligner of reference §2.3 / §4.7 (not loaded: text-only serving):
    per block wqkv + wo (with biases), SwiGLU w1 [2·inter, width] and w2 [width, inter], two norms;
    patch embedding; aligner w1 [dim, width·downsample²], w2 [dim, dim]; image_* vectors."""
    block = 4 * width * width + 4 * width + 3 * width * inter + 2 * width
    patch_embed = width * 3 * patch * patch + width
    aligner = dim * width * downsample * downsample + dim * dim
    return layers * block + patch_embed + width + aligner + 3 * dim


def describe(cfg) -> str:
    """The census against the recipe's table, one line per row."""
    lines = [f"{'component':46s} {'entries':>10s} {'published':>10s} {'GiB':>8s} {'published':>9s}"]
    for (name, n, gib) in recipe_rows(cfg):
        pub_n, pub_gib = PUBLISHED[name]
        lines.append(f"{name:46s} {n / 1e9:9.2f}B {pub_n / 1e9:9.1f}B {gib:8.1f} {pub_gib:9.1f}")
    t = total(census(cfg))
    lines.append(f"text tensors {t.tensors:,} (published {PUBLISHED_TENSORS:,} incl. vision); "
                 f"backbone {backbone_params(cfg) / 1e9:.1f}B (published {PUBLISHED_BACKBONE / 1e9:.0f}B); "
                 f"DSpark {draft_params(cfg) / 1e9:.1f}B (published ~{PUBLISHED_DRAFT / 1e9:.0f}B); the vision "
                 f"tower (not in the text schema) adds ~{vision_params() / 1e9:.2f}B BF16 to the embedding row")
    return "\n".join(lines)
