"""Triton kernel tests run on the GPU when there is one, else through Triton's CPU interpreter
(``TRITON_INTERPRET`` is set by the root conftest before any kernel module is imported)."""
import pytest
import torch


@pytest.fixture(scope="session")
def kernel_device():
    """Where the kernel tests run: the GPU, or the CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels_v41_main():
    """``benchmarks/kernels_v41.py``'s ``main``, loaded from its file (the benchmarks folder on ``sys.path`` and
    the module registered while it runs, both removed after): call it with the script's arguments."""
    import importlib.util
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[3] / "benchmarks"
    name = "kernels_v41_smoke"

    def run(args):
        sys.path.insert(0, str(bench))
        try:
            spec = importlib.util.spec_from_file_location(name, bench / "kernels_v41.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod  # its dataclasses look their module up
            spec.loader.exec_module(mod)
            return mod.main(args)
        finally:
            sys.path.remove(str(bench))
            sys.modules.pop(name, None)
    return run
