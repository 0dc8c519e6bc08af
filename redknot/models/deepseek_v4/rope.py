"""RoPE frequency tables of V4: "main" (plain, SWA-only layers and MTP) and "compress"
(YaRN-scaled, every CSA/HCA layer and its compressors/indexer), reference §4.3."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from redknot.models.deepseek_v4.config import V4Config, YarnScaling

MAIN, COMPRESS = "main", "compress"


def inv_freq(theta: float, dim: int, yarn: Optional[YarnScaling]) -> torch.Tensor:
    """θ_i = theta^(-2i/dim) for the dim/2 interleaved pairs, YaRN-blended when given
    (frequency blend only: V4 applies no attention-magnitude factor)."""
    half = dim // 2
    freqs = [theta ** (-2.0 * i / dim) for i in range(half)]
    if yarn is not None:
        def corr(beta: float) -> float:  # pair index completing `beta` rotations over the original length
            return dim * math.log(yarn.original_max_position_embeddings / (2 * math.pi * beta)) / (2 * math.log(theta))
        low = max(math.floor(corr(yarn.beta_fast)), 0)
        high = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
        span = (high - low) if high != low else 0.001
        out = []
        for i, f in enumerate(freqs):
            keep = 1.0 - min(max((i - low) / span, 0.0), 1.0)  # 1: extrapolate (unchanged), 0: interpolate
            out.append(f / yarn.factor * (1.0 - keep) + f * keep)
        freqs = out
    return torch.tensor(freqs, dtype=torch.float64).float()


class RopeTables:
    """Per-kind inverse frequencies; cos/sin are made per step for the positions it needs."""

    def __init__(self, cfg: V4Config, device=None):
        self.inv = {MAIN: inv_freq(cfg.rope_theta, cfg.rope_dim, None).to(device),
                    COMPRESS: inv_freq(cfg.compress_rope_theta, cfg.rope_dim, cfg.yarn).to(device)}
        self.kernels = None  # the model's kernel set: cos / sin by its ``rope_cos_sin`` op (one launch)

    def to(self, device) -> "RopeTables":
        self.inv = {k: v.to(device) for k, v in self.inv.items()}
        return self

    def cos_sin(self, kind: str, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rope_dim/2] fp32 (angle = position · θ_i in fp32)."""
        if self.kernels is not None:
            return self.kernels.rope_cos_sin(positions, self.inv[kind])
        angles = positions.float()[:, None] * self.inv[kind][None, :]
        return angles.cos(), angles.sin()


def rope_kind(compress_ratio: int) -> str:
    return MAIN if compress_ratio == 0 else COMPRESS
