"""Triton kernel tests run on the GPU when there is one, else through Triton's CPU interpreter
(``TRITON_INTERPRET`` is set by the root conftest before any kernel module is imported)."""
import pytest
import torch


@pytest.fixture(scope="session")
def kernel_device():
    """Where the kernel tests run: the GPU, or the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"
