"""Kernel registry and backends (reference PyTorch ops, Triton/native SM90 ops, vendor wrappers)."""
from redknot.kernels.registry import KernelBackendError, KernelSet, register, registered_ops

__all__ = ["KernelSet", "KernelBackendError", "register", "registered_ops"]
