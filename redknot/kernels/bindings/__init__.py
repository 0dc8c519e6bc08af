"""Thin, lazily imported bindings of vendor kernel libraries to the registry's ops.

``sm100``: FlashMLA (sparse attention), DeepGEMM (FP8 GEMMs, grouped MoE GEMMs); ``ascend``: torch_npu.
A vendor package is imported on the first call that needs it; a missing package raises
:class:`~redknot.kernels.registry.KernelBackendError` naming the package and the pip extra.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Dict

from redknot.kernels.registry import BACKENDS, KernelBackendError

_LOADED: Dict[str, ModuleType] = {}


def require(package: str, backend: str) -> ModuleType:
    """Import ``package`` for ``backend`` once, or explain how to install it."""
    mod = _LOADED.get(package)
    if mod is not None:
        return mod
    extra = BACKENDS[backend].extra if backend in BACKENDS else None
    try:
        mod = importlib.import_module(package)
    except ImportError as exc:
        hint = f"pip install -e '.[{extra}]'" if extra else f"pip install {package}"
        raise KernelBackendError(
            f"kernel backend {backend!r} needs the Python package {package!r}, which could not be imported "
            f"({exc}); install it with: {hint}") from exc
    _LOADED[package] = mod
    return mod
