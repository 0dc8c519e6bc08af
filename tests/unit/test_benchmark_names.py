"""A script under ``benchmarks/`` runs with that folder first on ``sys.path``, so a module there named like an
installed package shadows it for everything the script imports (``kernels.py`` once hid Hugging Face's ``kernels``,
which transformers imports when it is installed, breaking every transformers import in the scripts)."""
import importlib.metadata
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_no_benchmark_module_shadows_an_installed_package():
    installed = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    mine = {p.stem for p in BENCH.glob("*.py")} | {p.name for p in BENCH.iterdir() if (p / "__init__.py").exists()}
    assert mine, BENCH
    assert not mine & installed, sorted(mine & installed)
