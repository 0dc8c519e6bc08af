"""Compile, on a machine without a GPU, every Triton kernel a set of tests launches, for SM90.

Triton's CPU interpreter (what the default test run uses) executes a kernel's Python body; it does not run
the compiler's front end, so a kernel that the interpreter runs can still be refused by ``triton.compile``
on the H200 (a ``tl.constexpr`` reassigned inside ``tl.static_range``, a dtype a ``tl.dot`` does not take,
a layout the backend cannot lower). This tool runs the named tests with Triton's driver replaced by one that
answers "CUDA, compute capability 9.0, warp size 32" and with every kernel launch turned into a compile
without a launch (``warmup``), so each launch goes through the real compiler for ``sm_90a``: front end,
TTGIR passes, LLVM, and the ``ptxas`` shipped in the Triton wheel. Kernels write nothing, so the tests' own
assertions fail; the tool reports only what the compiler said: every kernel compiled (name, constexprs) and
every compile error with its test.

Usage (a Triton of the version the GPU runs, e.g. ``pip install triton==3.6.0`` next to a CPU torch)::

    python tools/sm90_compile.py tests/unit/kernels/test_radix_select.py [more pytest args]

Exit status: 0 when every launch compiled, 1 when any compile failed, 2 when nothing was launched.
The compiled binaries go to a temporary Triton cache (removed at exit), never to ``~/.triton``.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

COMPILED: Dict[str, int] = {}
ERRORS: List[Tuple[str, str, str]] = []     # (test id, kernel, first lines of the message)
_CURRENT = {"test": "?"}


class _SM90Driver:
    """The active-driver surface ``JITFunction.run`` reads before a launch, answering for an SM90 device."""

    def __init__(self) -> None:
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int = 0) -> int:
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def get_device_interface(self):
        import torch
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("sm90_compile: kernels are compiled, not timed")

    def is_active(self) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("sm90_compile: no launcher is built")


class Plugin:
    """pytest plugin: patch the driver and the launch, record compiles and compile errors per test."""

    def pytest_configure(self, config) -> None:
        import triton
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction
        from triton.compiler.errors import CompilationError

        driver.set_active(_SM90Driver())
        run = JITFunction.run

        def compile_only(fn, *args, grid=None, warmup=False, **kwargs):
            name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
            try:
                out = run(fn, *args, grid=grid, warmup=True, **kwargs)
            except (CompilationError, RuntimeError, ValueError, TypeError, AssertionError) as e:
                msg = str(e)
                if isinstance(e, CompilationError) or "ptxas" in msg or "PassManager" in msg or "compil" in msg.lower():
                    ERRORS.append((_CURRENT["test"], name, "\n".join(msg.strip().splitlines()[-8:])))
                raise
            COMPILED[name] = COMPILED.get(name, 0) + 1
            return out

        JITFunction.run = compile_only
        from redknot.kernels.triton import _common
        _common.interpreting = lambda: True      # the wrappers launch Triton on CPU tensors, as under the interpreter
        triton.__sm90_compile__ = True

    def pytest_runtest_setup(self, item) -> None:
        _CURRENT["test"] = item.nodeid


def main(argv: List[str]) -> int:
    os.environ["TRITON_INTERPRET"] = "0"                         # real JIT functions, not interpreted ones
    cache = tempfile.TemporaryDirectory(prefix="sm90_compile_")
    os.environ["TRITON_CACHE_DIR"] = cache.name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import pytest

    pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "-o", "addopts=", "-rN", "--tb=no",
                 "-m", "not gpu and not slow",
                 *argv], plugins=[Plugin()])
    print(f"\nsm90 compile: {sum(COMPILED.values())} launches compiled over {len(COMPILED)} kernels, "
          f"{len(ERRORS)} compile errors")
    for name, n in sorted(COMPILED.items()):
        print(f"  ok   {name} ({n})")
    for test, name, msg in ERRORS:
        print(f"  FAIL {name} in {test}:\n    " + msg.replace("\n", "\n    "))
    cache.cleanup()
    if ERRORS:
        return 1
    return 0 if COMPILED else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
