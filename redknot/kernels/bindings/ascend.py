"""Ascend 950 (``torch_npu``) bindings. Fused NPU ops where torch_npu has one with the same semantics;
the rest of the registry runs the reference ops on the NPU through PyTorch."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from redknot.kernels import reference as ref
from redknot.kernels.bindings import require
from redknot.kernels.registry import register


@register("rms_norm", "torch_npu")
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    torch_npu = require("torch_npu", "torch_npu")
    gamma = weight if weight is not None else torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
    return torch_npu.npu_rms_norm(x.float(), gamma.float(), epsilon=eps)[0].to(x.dtype)


@register("linear", "torch_npu")
def linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    require("torch_npu", "torch_npu")  # registers the NPU device with PyTorch
    if weight.is_floating_point() and weight.dtype != torch.float8_e4m3fn:
        return F.linear(x, weight.to(x.dtype))
    return ref.linear(x, weight, scale)
