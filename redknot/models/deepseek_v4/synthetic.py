"""Synthetic V4 models: weights made from a seed, written once in the native layout.

:func:`randomize_` fills a model with values that exercise every path: unlike a
training init it randomises sinks, ape, mHC base/scale, norm weights and router
biases (zeros and ones hide bugs) and gives every token distinct hash experts.
:func:`write_synthetic_checkpoint` writes the checkpoint ``model.synthetic`` describes under
``<cache_dir>/models/<name>-<hash>/`` (temp dir, then rename) so that loading
takes the same path as a real checkpoint.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import replace
from typing import Any, Dict, Optional

import torch

from redknot.models.checkpoint_files import publish_once, synthetic_args
from redknot.models.deepseek_v4.config import QuantConfig, V4Config

FORMAT_VERSION = 1

# The embedded ``model=tiny``: real vocabulary, window 128, ratios 4/128, all three layer types,
# hash and learned routing, MTP; toy widths.
TINY_ARCHITECTURE: Dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0],
    "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64,
    "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 16, "index_head_dim": 32, "index_topk": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "num_hash_layers": 2,
}

_HALF_NORMAL = ("attn_sink", "ape", "_base", "gate.bias")  # 1-D-like offsets: 0.5·N(0,1)
_NEAR_ONE = ("norm.weight", "hc_attn_scale", "hc_ffn_scale", "hc_head_scale")  # 1 + 0.1·N(0,1)


def _fill(t: torch.Tensor, gen: torch.Generator, kind: str) -> None:
    """Fill t in slices along dim 0 (bounded temporary memory for stacked experts)."""
    fan_in = t.shape[-1] if t.dim() >= 2 else 1
    step = max(1, (1 << 24) // max(1, t[0].numel())) if t.dim() >= 2 else t.shape[0]
    for i in range(0, t.shape[0], step):
        part = t[i:i + step]
        r = torch.randn(part.shape, generator=gen, device=t.device, dtype=torch.float32)
        if kind == "half":
            r = 0.5 * r
        elif kind == "one":
            r = 1.0 + 0.1 * r
        else:
            r = r / fan_in ** 0.5
        part.copy_(r)


@torch.no_grad()
def randomize_(model, seed: int) -> None:
    """Deterministically (per device type) fill every parameter and buffer of a float model."""
    device = model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() and not name.endswith("tid2eid"):
            raise ValueError(f"randomize_: {name} is stored quantised ({t.dtype}); build the model in float")
        if name.endswith("tid2eid"):
            n_exp = model.cfg.n_routed_experts
            for i in range(0, t.shape[0], 1 << 14):
                rows = t[i:i + (1 << 14)]
                noise = torch.rand(rows.shape[0], n_exp, generator=gen, device=device)
                rows.copy_(noise.argsort(dim=-1)[:, :rows.shape[1]].to(t.dtype))  # distinct experts per row
        elif any(name.endswith(s) for s in _NEAR_ONE):
            _fill(t, gen, "one")
        elif any(name.endswith(s) for s in _HALF_NORMAL) or t.dim() == 1:
            _fill(t, gen, "half")
        else:
            _fill(t, gen, "scaled")


def synthetic_config(architecture: Dict[str, Any], quantize_fp8: bool, num_layers: Optional[int] = None
                     ) -> V4Config:
    """V4-Flash with ``architecture`` keys overridden; FP8 layout only when asked."""
    cfg = V4Config.flash().with_overrides(dict(architecture))
    quant = (cfg.quant or QuantConfig()) if quantize_fp8 else None
    return replace(cfg, quant=quant).cut(num_layers)


def checkpoint_key(cfg: V4Config, seed: int, extra: Optional[Dict[str, Any]] = None) -> str:
    """Content key of a synthetic checkpoint; ``extra``: config keys beyond the target's (DSpark)."""
    content = {"config": cfg.to_hf_dict(), "seed": seed, "format": FORMAT_VERSION}
    if extra:
        content["extra"] = extra
    blob = json.dumps(content, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def ensure_synthetic_checkpoint(name: str, architecture: Dict[str, Any], seed: int, quantize_fp8: bool,
                                cache_dir: str) -> str:
    """Directory of the synthetic checkpoint, written on first use."""
    from redknot.models.deepseek_v4.model import DeepseekV4
    from redknot.models.deepseek_v4.weights import INDEX_FILE
    from redknot.models.deepseek_v4.writer import native_tensors, write_checkpoint

    cfg = synthetic_config(architecture, quantize_fp8)
    root = os.path.join(cache_dir, "models")
    dspark = {k: v for k, v in architecture.items() if k.startswith("dspark_") or k == "n_mtp_layers"}
    final = os.path.join(root, f"{name}-{checkpoint_key(cfg, seed, dspark)}")

    def write(tmp: str) -> None:
        model = DeepseekV4(cfg, torch.float32, device="cpu")
        randomize_(model, seed)
        tensors = native_tensors(cfg, model.state_dict(), float_dtype=torch.bfloat16)
        extra = _dspark_stages(cfg, architecture, seed)
        if extra is not None:
            draft_tensors, extra_config = extra
            tensors = itertools.chain(tensors, draft_tensors)
        write_checkpoint(tmp, cfg, tensors, extra_config=None if extra is None else extra_config)

    return publish_once(root, name, final, INDEX_FILE, write,
                        {"name": name, "seed": seed, "architecture": architecture, "quantize_fp8": quantize_fp8,
                         "format": FORMAT_VERSION})


def _dspark_stages(cfg: V4Config, architecture: Dict[str, Any], seed: int):
    """(tensors, config.json keys) of seeded DSpark draft stages when ``architecture`` states
    ``dspark_block_size`` (V4-Flash-0731 layout: ``mtp.0..N-1``, no classic MTP), else None."""
    from redknot.models.deepseek_v4.dspark_config import dspark_config_keys, parse_dspark
    from redknot.models.deepseek_v4.dspark_draft import DSparkDraft, draft_checkpoint_spec
    from redknot.models.deepseek_v4.writer import native_tensors

    dcfg = parse_dspark({**cfg.to_hf_dict(), **architecture})
    if dcfg is None:
        return None
    draft = DSparkDraft(cfg, dcfg, torch.float32, device="cpu")
    randomize_(draft, seed + 1)
    tensors = native_tensors(cfg, draft.state_dict(), float_dtype=torch.bfloat16,
                             specs=draft_checkpoint_spec(cfg, dcfg))
    keys = dspark_config_keys(dcfg)
    # Like the released checkpoint: one compress ratio (0) per stage after the main layers.
    keys["compress_ratios"] = cfg.to_hf_dict()["compress_ratios"] + [0] * dcfg.num_stages
    keys["num_nextn_predict_layers"] = dcfg.num_stages
    return tensors, keys


def write_synthetic_checkpoint(model_cfg, cache_dir: str) -> str:
    """Directory of the checkpoint ``model.synthetic`` describes (``ModelConfig``), written on first use."""
    return ensure_synthetic_checkpoint(*synthetic_args(model_cfg), cache_dir)
