"""Triton kernel tests run on the GPU when there is one, else through Triton's CPU interpreter.

The interpreter is chosen when a kernel is decorated, so ``TRITON_INTERPRET`` is set here, at collection
(only on machines without CUDA), and kernel modules imported earlier without it are re-imported.
"""
import importlib
import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

_ORDER = ["_common", "attention", "indexer", "fp8", "moe", "norm", "mhc", "oracle", "ops", "checks.common",
          "checks.attention", "checks.dense", "checks"]


def _reimport_interpreted() -> None:
    prefix = "redknot.kernels.triton."
    common = sys.modules.get(prefix + "_common")
    if HAS_CUDA or common is None or getattr(common, "_INTERPRETED_AT_IMPORT", False):
        return
    for name in _ORDER:
        if prefix + name in sys.modules:
            importlib.reload(sys.modules[prefix + name])


_reimport_interpreted()


@pytest.fixture(scope="session")
def kernel_device():
    """Where the kernel tests run: the GPU, or the CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
