"""What differs on a fresh CPU machine where ``pip install -e ".[test]"`` picked PyTorch's CUDA wheel:
``torch.__version__`` carries ``+cu130`` while the wheel's metadata says ``2.13.0``, the CUDA runtime is
there but no GPU and no nvcc. The facts are changed where they come from (the version file, the package
metadata, ``shutil.which``, torch's device queries), never in the code under test."""
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
import torch

from redknot.kernels import KernelBackendError


def test_recorded_torch_version_keeps_the_local_build_tag(monkeypatch):
    from redknot.tracking import facts

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0" if name == "torch" else real(name))
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert facts.versions()["version.torch"] == "2.13.0+cu130"


def test_torch_version_is_read_from_its_version_file_without_importing_torch(tmp_path):
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('torch must not be imported for a tag')\n")
    (site / "torch" / "version.py").write_text("__version__ = '2.13.0+cu130'\ncuda = '13.0'\n")
    (site / "torch-2.13.0.dist-info").mkdir()
    (site / "torch-2.13.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(site)!r})
        from redknot.tracking.facts import versions
        print(versions()["version.torch"], "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.13.0+cu130", "False"]


def test_native_build_says_what_is_missing_with_the_cuda_wheel_on_a_cpu_machine(monkeypatch, tmp_path):
    import shutil

    from torch.utils import cpp_extension

    from redknot.kernels import native

    runtime_only = tmp_path / "cuda"  # a CUDA home with the runtime but no bin/nvcc
    runtime_only.mkdir()
    real_which = shutil.which
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "nvcc" else real_which(name, *a, **k))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(runtime_only))
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)

    def torch_build(*args, **kwargs):  # what torch's builder does with no GPU to take the architecture from
        raise IndexError("list index out of range")

    monkeypatch.setattr(cpp_extension, "load", torch_build)
    native._MODULES.pop("kv_fp8", None)
    with pytest.raises(KernelBackendError) as err:
        native.load("kv_fp8", build_root=tmp_path / "build")
    message = str(err.value)
    assert "kv_fp8" in message and "nvcc" in message and "visible CUDA GPU" in message
    assert "TORCH_CUDA_ARCH_LIST" in message and "list index out of range" not in message


def test_ci_runs_the_readme_commands_as_written():
    from redknot.config.hardware_fit import CONF_DIR

    repo = CONF_DIR.parent
    readme = (repo / "README.md").read_text()
    block = readme.split("## Set up", 1)[1].split("```", 2)[1]
    commands = [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]
    assert commands == ['pip install -e ".[test]" && python -m redknot', "pytest"]
    ci = (repo / ".ci" / "run").read_text()
    assert 'python -m pip install -e ".[test]"' in ci and "\npytest\n" in ci
    assert "python -m redknot\n" in ci  # the embedded default run, as a fresh machine would do it
