"""Write a native DeepSeek-V4.1 checkpoint (the layout :mod:`weights` reads).

Used for ``model=tiny-v41`` and by tests. Values are given in logical (float) form per
native name; :func:`native_tensors` stores them as the released checkpoint does:
dense linears FP8 e4m3 with one E8M0 scale per ``weight_block_size`` tile, routed
experts MXFP4 (packed I8, low nibble = even element, E8M0 per 32), Engram tables FP8
with per-row E8M0 per 32 columns, norms and other plain weights BF16, ``hc_*`` /
``attn_sink`` / gate biases F32. Without ``quantization_config`` every linear is BF16.

:func:`synthetic_tensors` makes the values from a seed (each tensor from its own
generator, seeded by the name, so the values do not depend on the order or the shard
split); unlike a training init it randomises sinks, mHC base/scale, norm weights and
router biases (zeros and ones hide bugs).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from redknot.kernels import mx_formats as mx
from redknot.models.checkpoint_files import publish_once, synthetic_args, write_shards
from redknot.models.deepseek_v41.checkpoint import BF16, ENGRAM, F32, FP4, FP8, TensorSpec, checkpoint_spec
from redknot.models.deepseek_v41.config import V41Config, synthetic_config
from redknot.models.deepseek_v41.weights import INDEX_FILE

FORMAT_VERSION = 1
EMBED_STD = 0.12
_NEAR_ONE = ("norm.weight", "_scale", "q_weight", "k_weight")      # 1 + 0.1·N(0,1)
_HALF_NORMAL = ("attn_sink", "_base", "gate.bias", "gate.bias_vl")  # 0.5·N(0,1)
_UNIT = ("engram.embed.weight",)                                    # N(0,1): table rows
_EMBED = ("embed.weight",)                                          # EMBED_STD·N(0,1)


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def synthetic_value(spec: TensorSpec, seed: int) -> torch.Tensor:
    """The float32 value of one tensor of the seeded synthetic checkpoint."""
    r = torch.randn(spec.shape, generator=_generator(seed, spec.name), dtype=torch.float32)
    name = spec.name
    if name.endswith(_UNIT):
        return r
    if name.endswith(_EMBED):
        return EMBED_STD * r
    if name.endswith(_NEAR_ONE):
        return 1.0 + 0.1 * r
    if name.endswith(_HALF_NORMAL) or len(spec.shape) == 1:
        return 0.5 * r
    return r / spec.shape[-1] ** 0.5


def synthetic_tensors(cfg: V41Config, seed: int, include_draft: bool = True
                      ) -> Iterator[Tuple[TensorSpec, torch.Tensor]]:
    for spec in checkpoint_spec(cfg, include_draft=include_draft):
        yield spec, synthetic_value(spec, seed)


def store(spec: TensorSpec, value: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """The stored tensor(s) of one logical value: the weight, and its scale when quantised."""
    value = value.detach().cpu()
    if tuple(value.shape) != spec.shape:
        raise ValueError(f"{spec.name}: value has shape {list(value.shape)}, the schema says {list(spec.shape)}")
    if spec.kind == FP8:
        q, s = mx.quant_fp8_blocks(value.float(), spec.block[0])
        return [(spec.name, q), (spec.scale_name, s.view(torch.float8_e8m0fnu))]
    if spec.kind == FP4:
        q, s = mx.quant_mxfp4(value.float())
        return [(spec.name, q.view(torch.int8)), (spec.scale_name, s.view(torch.float8_e8m0fnu))]
    if spec.kind == ENGRAM:
        q, s = mx.quant_fp8_groups(value.float(), mx.MX_GROUP, mx.E4M3_MAX * 2.0 ** -126)
        return [(spec.name, q.contiguous()), (spec.scale_name, s.contiguous().view(torch.float8_e8m0fnu))]
    if spec.kind == F32:
        return [(spec.name, value.float().contiguous())]
    assert spec.kind == BF16
    return [(spec.name, value.to(torch.bfloat16).contiguous())]


def native_tensors(items: Iterable[Tuple[TensorSpec, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    for spec, value in items:
        yield from store(spec, value)


def write_checkpoint(out_dir: str, cfg: V41Config, tensors: Iterable[Tuple[str, torch.Tensor]],
                     max_shard_bytes: int = 1 << 30, tokenizer_file: Optional[str] = None) -> List[str]:
    """Shards ``model-0000i-of-0000N.safetensors``, the index, ``config.json`` (the released
    nested layout) and, when given, a copy of ``tokenizer.json``."""
    files = write_shards(out_dir, tensors, max_shard_bytes, INDEX_FILE, cfg.to_hf_dict())
    if tokenizer_file:
        shutil.copyfile(tokenizer_file, os.path.join(out_dir, "tokenizer.json"))
    return files


# ---------------------------------------------------------------------------- the synthetic model
def checkpoint_key(cfg: V41Config, seed: int) -> str:
    blob = json.dumps({"config": cfg.to_hf_dict(), "seed": seed, "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_synthetic_checkpoint(name: str, architecture: Mapping[str, Any], seed: int, quantize_fp8: bool,
                                cache_dir: str, max_shard_bytes: int = 64 << 20) -> str:
    """Directory of the seeded checkpoint under ``<cache_dir>/models/``, written on first use
    (temporary directory, then rename)."""
    from redknot.models.deepseek_v41.weights import checkpoint_tokenizer_file

    cfg = synthetic_config(architecture, quantize_fp8)
    root = os.path.join(cache_dir, "models")
    final = os.path.join(root, f"{name}-{checkpoint_key(cfg, seed)}")

    def write(tmp: str) -> None:
        write_checkpoint(tmp, cfg, native_tensors(synthetic_tensors(cfg, seed)), max_shard_bytes=max_shard_bytes,
                         tokenizer_file=checkpoint_tokenizer_file(None, None))

    return publish_once(root, name, final, INDEX_FILE, write,
                        {"name": name, "seed": seed, "architecture": dict(architecture),
                         "quantize_fp8": quantize_fp8, "format": FORMAT_VERSION})


def write_synthetic_checkpoint(model_cfg, cache_dir: str) -> str:
    """Directory of the checkpoint ``model.synthetic`` describes, written on first use."""
    return ensure_synthetic_checkpoint(*synthetic_args(model_cfg), cache_dir)
