"""Native C++/CUDA ops from ``csrc/``, compiled on first use with ``torch.utils.cpp_extension.load``.

Triton covers the registry's ops (``redknot.kernels.triton``); native code is kept for what is awkward
there. Today that is ``kv_fp8``: packing 512-dim K=V rows into the compact FP8 cache row format
(448 e4m3 values with one power-of-two scale per 64-value tile + 64 bf16 rope values, 584 bytes), the
layout an FP8 ``kv_cache_dtype`` will store — byte-level packing with per-tile exponents is plain
CUDA. No registry op uses it yet (the model's caches are bf16), so this backend registers no op;
``pack_rows`` / ``unpack_rows`` are called directly and checked against :func:`pack_rows_reference`.

Builds land in ``outputs/cache/native/<op>`` (under the working directory) unless ``build_root`` says
otherwise. A machine without a CUDA build of PyTorch, a CUDA toolkit or a C++ compiler gets a
:class:`~redknot.kernels.registry.KernelBackendError` that names what is missing.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional

import torch

from redknot.kernels.registry import KernelBackendError

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES: Dict[str, List[str]] = {"kv_fp8": ["kv_fp8.cu"]}
ROW_BYTES, NOPE, ROPE, TILE = 584, 448, 64, 64
_MODULES: Dict[str, ModuleType] = {}


def _nvcc() -> Optional[str]:
    """nvcc on PATH, else under the CUDA home torch found (a CUDA runtime without the toolkit has none)."""
    found = shutil.which("nvcc")
    if found:
        return found
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    candidate = Path(home) / "bin" / "nvcc" if home else None
    return str(candidate) if candidate is not None and candidate.is_file() else None


def missing_toolchain() -> List[str]:
    """What this machine lacks to build the CUDA sources (empty when it can). The CUDA wheel of PyTorch
    that pip installs by default ships the CUDA runtime but neither nvcc nor, on a CPU machine, a GPU."""
    missing = []
    if torch.version.cuda is None:
        missing.append(f"a CUDA build of PyTorch (this one, {torch.__version__}, is CPU-only)")
    if _nvcc() is None:
        missing.append("the CUDA toolkit's compiler nvcc (not on PATH, not under CUDA_HOME; install the CUDA "
                       "toolkit or set CUDA_HOME)")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++ on PATH)")
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        missing.append("a visible CUDA GPU to build for (or TORCH_CUDA_ARCH_LIST naming the architectures, "
                       "e.g. '9.0')")
    return missing


def load(name: str, build_root: Optional[Path] = None, verbose: bool = False) -> ModuleType:
    """Compile (once per process; cached on disk across processes) and import native op ``name``."""
    if name in _MODULES:
        return _MODULES[name]
    if name not in SOURCES:
        raise KernelBackendError(f"unknown native op {name!r}; known: {sorted(SOURCES)}")
    missing = missing_toolchain()
    if missing:
        raise KernelBackendError(f"native op {name!r} is compiled from csrc/{', '.join(SOURCES[name])} on first use "
                                 f"and needs " + "; ".join(missing))
    from torch.utils.cpp_extension import load as build

    build_dir = Path(build_root or Path("outputs") / "cache" / "native") / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        mod = build(name=f"redknot_{name}", sources=[str(CSRC / s) for s in SOURCES[name]],
                    extra_cuda_cflags=["-O3", "-std=c++17"], build_directory=str(build_dir), verbose=verbose)
    except Exception as exc:  # compiler output is in the message; keep it
        raise KernelBackendError(f"building native op {name!r} from {CSRC} failed: {exc}") from exc
    _MODULES[name] = mod
    return mod


def pack_rows(rows: torch.Tensor) -> torch.Tensor:
    """bf16 ``[N, 512]`` K=V rows → packed FP8 rows ``[N, 584]`` uint8 (CUDA)."""
    return load("kv_fp8").kv_fp8_pack(rows)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP8 rows ``[N, 584]`` → bf16 ``[N, 512]`` (CUDA)."""
    return load("kv_fp8").kv_fp8_unpack(packed)


def _tile_exponents(nope: torch.Tensor) -> torch.Tensor:
    """Per 64-value tile, the smallest e with amax / 2^e <= 448 (0 for all-zero tiles), as the kernel."""
    amax = nope.float().view(nope.shape[0], -1, TILE).abs().amax(-1)
    mant, exp = torch.frexp(amax / 448.0)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)


def pack_rows_reference(rows: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch statement of :func:`pack_rows` (the byte layout is documented in csrc/kv_fp8.cu)."""
    n = rows.shape[0]
    nope = rows[:, :NOPE]
    exp = _tile_exponents(nope)  # [N, 7]
    q = torch.ldexp(nope.float().view(n, -1, TILE), -exp[..., None].float()).to(torch.float8_e4m3fn)
    out = torch.zeros(n, ROW_BYTES, dtype=torch.uint8, device=rows.device)
    out[:, :NOPE] = q.view(n, NOPE).view(torch.uint8)
    out[:, NOPE:NOPE + 2 * ROPE] = rows[:, NOPE:].contiguous().view(torch.uint8)
    out[:, NOPE + 2 * ROPE:NOPE + 2 * ROPE + NOPE // TILE] = (exp + 127).to(torch.uint8)
    return out


def unpack_rows_reference(packed: torch.Tensor) -> torch.Tensor:
    n = packed.shape[0]
    q = packed[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(n, -1, TILE)
    exp = packed[:, NOPE + 2 * ROPE:NOPE + 2 * ROPE + NOPE // TILE].float() - 127
    nope = torch.ldexp(q, exp[..., None]).view(n, NOPE).to(torch.bfloat16)
    return torch.cat([nope, packed[:, NOPE:NOPE + 2 * ROPE].contiguous().view(torch.bfloat16)], dim=1)
