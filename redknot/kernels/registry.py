"""Op registry: op name -> {backend name -> implementation}.

Model files never import a kernel directly. They call ops on a :class:`KernelSet`
(``kernels.rms_norm(x, w, eps)``), which resolves each op to the backend the
hardware config chose. Every op has a ``reference`` (plain PyTorch) backend; a
fast backend must keep the reference's signature and is tested against it.

Backends are registered by modules that are imported lazily: the reference
module is always loaded; others are loaded only when a KernelSet asks for them,
so a missing vendor package is an error at engine start that names the package
and the pip extra that installs it, never a silent fallback.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional

from redknot.config.schema import Accelerator

_OPS: Dict[str, Dict[str, Callable]] = {}


@dataclass(frozen=True)
class BackendInfo:
    module: str                 # module whose import registers the backend's ops
    packages: tuple = ()        # third-party packages it needs
    extra: Optional[str] = None  # pip extra that installs them
    accelerator: Optional[Accelerator] = None  # the one accelerator it runs on; None: any


# Known backends, where they live and what they run on. Importing the module registers its ops.
BACKENDS: Dict[str, BackendInfo] = {
    "reference": BackendInfo("redknot.kernels.reference"),
    # Shape-independent-of-batch versions of the reference ops (features.batch_invariant).
    "batch_invariant": BackendInfo("redknot.kernels.batch_invariant"),
    "triton": BackendInfo("redknot.kernels.triton", ("triton",), "sm90", Accelerator.cuda),
    "native": BackendInfo("redknot.kernels.native", (), "sm90", Accelerator.cuda),
    "flash_mla": BackendInfo("redknot.kernels.bindings.sm100", ("flash_mla",), "sm100", Accelerator.cuda),
    "deep_gemm": BackendInfo("redknot.kernels.bindings.sm100", ("deep_gemm",), "sm100", Accelerator.cuda),
    "deep_ep": BackendInfo("redknot.kernels.bindings.sm100", ("deep_ep",), "sm100", Accelerator.cuda),
    "tilelang": BackendInfo("redknot.kernels.bindings.sm100", ("tilelang",), "sm100", Accelerator.cuda),
    "torch_npu": BackendInfo("redknot.kernels.bindings.ascend", ("torch_npu",), "ascend950", Accelerator.npu),
}


class KernelBackendError(RuntimeError):
    pass


def register(op: str, backend: str = "reference"):
    """Decorator: ``@register("rms_norm")`` adds the function as ``op``'s ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; known: {sorted(BACKENDS)}")

    def deco(fn: Callable) -> Callable:
        _OPS.setdefault(op, {})[backend] = fn
        return fn

    return deco


def registered_ops() -> Dict[str, Dict[str, Callable]]:
    _load_backend("reference")
    return {op: dict(impls) for op, impls in _OPS.items()}


def _load_backend(backend: str) -> None:
    info = BACKENDS.get(backend)
    if info is None:
        raise KernelBackendError(f"unknown kernel backend {backend!r}; known backends: {sorted(BACKENDS)}")
    for pkg in info.packages:
        if importlib.util.find_spec(pkg) is None:
            raise KernelBackendError(
                f"kernel backend {backend!r} needs the Python package {pkg!r}, which is not installed; "
                f"install it with: pip install -e '.[{info.extra}]'")
    importlib.import_module(info.module)


class KernelSet:
    """The ops one engine uses, resolved once from the hardware config.

    ``KernelSet(default="reference", ops={"sparse_attention": "triton"})``;
    attribute access returns the bound implementation: ``ks.sparse_attention``.
    """

    def __init__(self, default: str = "reference", ops: Optional[Mapping[str, str]] = None):
        ops = dict(ops or {})
        _load_backend("reference")
        for backend in {default, *ops.values()}:
            _load_backend(backend)
        unknown = sorted(set(ops) - set(_OPS))
        if unknown:
            raise KernelBackendError(
                f"hardware.kernels.ops names unknown ops {unknown}; known ops: {sorted(_OPS)}")
        self.default = default
        self.choice: Dict[str, str] = {}
        self._impl: Dict[str, Callable] = {}
        for op, impls in _OPS.items():
            backend = ops.get(op, default)
            if backend not in impls:
                if op in ops:
                    raise KernelBackendError(
                        f"hardware.kernels.ops.{op}={backend!r}: op {op!r} has no {backend!r} implementation; "
                        f"available: {sorted(impls)}")
                backend = "reference"  # the default backend does not cover this op
            self.choice[op] = backend
            self._impl[op] = impls[backend]

    def __getattr__(self, op: str) -> Callable:
        impl = self.__dict__.get("_impl", {}).get(op)
        if impl is None:
            raise AttributeError(f"no kernel op {op!r}; known ops: {sorted(self.__dict__.get('_impl', {}))}")
        return impl

    def __repr__(self) -> str:
        fast = {op: b for op, b in self.choice.items() if b != "reference"}
        return f"KernelSet(default={self.default!r}, non_reference={fast})"
