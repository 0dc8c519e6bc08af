"""Small parameter-holding building blocks; their math goes through the kernel set ``ks``."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from redknot.models.deepseek_v4.params import FLOAT, ParamFactory


class Linear(nn.Module):
    """y = x · Wᵀ; W is stored as the factory decides (float, or FP8/FP4 with ``scale``)."""

    def __init__(self, f: ParamFactory, out_features: int, in_features: int, fmt: str = FLOAT):
        super().__init__()
        self.weight, scale = f.weight((out_features, in_features), fmt)
        if scale is not None:
            self.scale = scale
        else:
            self.register_parameter("scale", None)

    def forward(self, ks, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return ks.linear(x.reshape(-1, x.shape[-1]), self.weight, self.scale).view(*lead, -1)


class Norm(nn.Module):
    """Weighted RMSNorm; the weight is kept in fp32."""

    def __init__(self, f: ParamFactory, dim: int, eps: float):
        super().__init__()
        self.weight = f.fp32(dim)
        self.eps = eps

    def forward(self, ks, x: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        y = ks.rms_norm(x, self.weight, self.eps)
        return y if out_dtype is None else y.to(out_dtype)


class Embedding(nn.Module):
    """Token embedding table [vocab, D]."""

    def __init__(self, f: ParamFactory, vocab: int, dim: int):
        super().__init__()
        self.weight = f.plain(vocab, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]
