"""``build_model``: the one way a V4 model is made from the typed config sections."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from redknot.kernels import KernelSet
from redknot.kernels.dtypes import torch_dtype
from redknot.models.checkpoint_files import check_model_keys
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.synthetic import write_synthetic_checkpoint
from redknot.models.deepseek_v4.weights import load_checkpoint
from redknot.models.family import ExpertRows

log = logging.getLogger(__name__)


def checkpoint_path(model_cfg, cache_dir: str) -> str:
    """The checkpoint directory: ``model.path``, or the synthetic model written under the cache."""
    if model_cfg.path:
        if not os.path.isdir(model_cfg.path):
            raise FileNotFoundError(f"model.path={model_cfg.path!r} is not a directory")
        return model_cfg.path
    if model_cfg.synthetic is None:
        raise ValueError(f"model {model_cfg.name!r}: model.path is null and model.synthetic is not set; "
                         f"give model.path=/path/to/checkpoint or choose model=tiny")
    return write_synthetic_checkpoint(model_cfg, cache_dir)


def _with_inferred_quantization(cfg: V4Config, path: str, num_layers: Optional[int]) -> V4Config:
    """config.json without ``quantization_config`` but FP8 tensors with scales: take the format from the tensors."""
    from redknot.models.deepseek_v4.weights import infer_quantization

    quant = infer_quantization(path)
    if quant is None:
        return cfg
    log.warning("%s/config.json has no quantization_config, but its tensors are FP8 e4m3 with .scale "
                "siblings: loading it as quantization_config=%s", path, quant)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    parsed = V4Config.from_hf_dict({**raw, "quantization_config": quant})
    return parsed.cut(num_layers) if num_layers is not None else parsed


def build_model(model, hardware, cache_dir: str, kernels: Optional[KernelSet] = None, device="cpu",
                with_mtp: bool = True, progress: Optional[bool] = None,
                expert_rows: Optional[ExpertRows] = None) -> DeepseekV4:
    """Load (for ``model.synthetic``: first generate and write) the checkpoint and return the model.
    With ``expert_rows`` (expert parallel) each main layer allocates and reads only the routed experts
    it returns, one stacked row each (repeats: replicas); None keeps every expert."""
    path = checkpoint_path(model, cache_dir)
    cfg = V4Config.from_pretrained(path, num_layers=model.num_layers)
    if cfg.quant is None:
        cfg = _with_inferred_quantization(cfg, path, model.num_layers)
    check_model_keys(model, cfg.max_position_embeddings, cfg.sliding_window)
    if kernels is None:
        kernels = KernelSet(hardware.kernels.default, dict(hardware.kernels.ops))
    keep = hardware.weight_format == "keep"  # WeightFormat is a str enum: members equal their values
    net = DeepseekV4(cfg, torch_dtype(hardware.dtype), keep_quantized=keep, device="meta", kernels=kernels,
                     with_mtp=with_mtp and cfg.num_mtp_layers > 0)
    if expert_rows is not None:
        for i, layer in enumerate(net.layers):
            layer.ffn.experts.keep_only(expert_rows(i, cfg.n_routed_experts))
    net.to_empty(device=device)
    load_checkpoint(net, path, progress=bool(model.path) if progress is None else progress)
    net.fuse_projections()
    return net.eval()
