"""Config dtypes (``hardware.dtype``, ``hardware.kv_cache_dtype``) -> torch dtypes.

Shared by the engine (state, activations) and the model builders, which both sit above the kernels.
"""
from __future__ import annotations

import torch

from redknot.config.schema import DType

TORCH_DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16,
                DType.float64: torch.float64}


def torch_dtype(dtype) -> torch.dtype:
    """A :class:`DType` (or its value, e.g. ``"bfloat16"``) -> the torch dtype; anything else raises
    ValueError listing the allowed values."""
    try:
        return TORCH_DTYPES[DType(dtype)]
    except ValueError:
        raise ValueError(f"hardware.dtype={dtype!r}: must be one of {[d.value for d in DType]}") from None
