"""Shared helpers for the Triton kernels: interpreter detection, launch sizing, checks."""
from __future__ import annotations

import functools
import os

import torch

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(t: torch.Tensor) -> int:
    """Multiprocessors of the tensor's device (a nominal 8 on CPU, so split heuristics stay exercised)."""
    if t.is_cuda:
        return num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 8


def dot_precision(dtype: torch.dtype):
    """fp32 operands use exact FMA dots (tf32 would cost ~1e-3 relative); 16-bit ones the tensor cores."""
    return "ieee" if dtype == torch.float32 else None


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {tuple(t.stride())}")


def as_i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _patch_interpreter_scalars() -> None:
    """Triton 3.6's CPU interpreter turns scalars into 1-element arrays and calls ``int()`` on them for
    ``range`` bounds, which numpy >= 2.4 rejects. Read the element explicitly instead (interpreter only)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_redknot_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._redknot_patched = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_scalars()
