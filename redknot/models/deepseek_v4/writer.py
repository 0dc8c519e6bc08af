"""Write a native V4 checkpoint (the layout :mod:`weights` reads), optionally FP8/FP4-quantised.

Used by the tiny synthetic model and by tests. Quantisation follows the config:
``cfg.quant`` set -> dense linears FP8 e4m3 with 128x128 ue8m0 block scales and
routed experts FP8 or FP4 (``expert_dtype``); unquantised tensors are written in
``float_dtype`` (bf16 like the released checkpoints) and fp32-kept ones in fp32.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch

from redknot.kernels.ref_quant import quantize_fp4, quantize_fp8_block
from redknot.models.checkpoint_files import write_shards
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.params import FP4, FP8, FP32, FLOAT, INT, TensorSpec, checkpoint_spec
from redknot.models.deepseek_v4.weights import INDEX_FILE


def native_tensors(cfg: V4Config, params: Mapping[str, torch.Tensor], float_dtype: torch.dtype = torch.bfloat16,
                   include_mtp: bool = True, specs: Optional[List[TensorSpec]] = None
                   ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(native name, stored tensor) for every checkpoint tensor, from dequantised model values
    keyed by model parameter name (``DeepseekV4.state_dict()``); ``specs``: other tensors than the
    target model's (the DSpark draft stages)."""
    for spec in (checkpoint_spec(cfg, include_mtp=include_mtp) if specs is None else specs):
        value = params[spec.param]
        if spec.expert is not None:
            value = value[spec.expert]
        value = value.detach().cpu()
        if spec.fmt == FP8:
            q, s = quantize_fp8_block(value)
            yield spec.name, q
            yield spec.scale_name, s.to(torch.float8_e8m0fnu)
        elif spec.fmt == FP4:
            q, s = quantize_fp4(value)
            yield spec.name, q
            yield spec.scale_name, s.to(torch.float8_e8m0fnu)
        elif spec.fmt == INT:
            yield spec.name, value.to(torch.int32).contiguous()
        elif spec.fmt == FP32:
            yield spec.name, value.float().contiguous()
        else:
            assert spec.fmt == FLOAT
            yield spec.name, value.to(float_dtype).contiguous()


def write_checkpoint(out_dir: str, cfg: V4Config, tensors: Iterator[Tuple[str, torch.Tensor]],
                     max_shard_bytes: int = 1 << 30, extra_config: Optional[Dict[str, Any]] = None) -> List[str]:
    """Write shards ``model-0000i-of-0000N.safetensors``, the index file and ``config.json``
    (``cfg.to_hf_dict()`` updated with ``extra_config``: e.g. the DSpark keys)."""
    return write_shards(out_dir, tensors, max_shard_bytes, INDEX_FILE, {**cfg.to_hf_dict(), **(extra_config or {})})
