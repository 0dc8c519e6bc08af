"""Layering of the redknot package (DESIGN §4), checked on the real imports of every module.

Imports are read with ``ast`` from every scope (function-level imports included), so neither an
import hidden inside a function nor a module path that only appears in a string or a docstring
fools the check (see ``tests/import_graph.py``).
"""
from typing import Callable, List, Tuple

import pytest

from import_graph import package_imports, parse_imports, resolve

# The packages that must reach a model only through the family registry and interface.
ENGINE_SIDE = ("engine", "cache", "sample", "speculative", "parallel", "bench")
FAMILY_SEAM = ("redknot.models", "redknot.models.registry", "redknot.models.family")


def _under(module: str, *packages: str) -> bool:
    return any(module == f"redknot.{p}" or module.startswith(f"redknot.{p}.") for p in packages)


def is_model_family(module: str) -> bool:
    """A module of a model family's folder (anything under redknot.models but the seam)."""
    return _under(module, "models") and module not in FAMILY_SEAM


def _top(module: str) -> str:
    return module.split(".")[0]


# (importing package, forbidden import, why)
RULES: List[Tuple[Tuple[str, ...], Callable[[str], bool], str]] = [
    (ENGINE_SIDE, is_model_family, "engine-side code reaches a model only through redknot.models.registry/family"),
    (("kernels",), lambda m: _under(m, "models"), "kernels sit below the models"),
    (("sample",), lambda m: _under(m, "engine"), "the sampler sits below the engine"),
    (("step",), lambda m: _under(m, "models", "kernels", "engine", "speculative", "parallel", "sample", "cache",
                                 "bench"), "the step contract is neutral: it imports neither models nor kernels"),
    (("models",), lambda m: _under(m, "engine", "speculative", "parallel", "sample", "cache", "bench", "tracking"),
     "models hold math: they never import the engine side"),
    (("engine", "cache", "sample", "speculative", "parallel", "kernels", "models", "step"),
     lambda m: _top(m) in ("hydra", "mlflow") or _under(m, "bench"), "the engine never imports bench, hydra or mlflow"),
    (("config", "bench", "engine", "cache", "sample", "speculative", "parallel", "kernels", "models", "step"),
     lambda m: _top(m) == "mlflow", "mlflow is imported only in redknot.tracking"),
]

# Modules that import a module named at run time, and why that is safe; any other is reported.
DYNAMIC_IMPORTS = {
    "redknot._lazy": "lazy package exports: the modules named in each package's _EXPORTS table (checked)",
    "redknot.kernels.registry": "kernel backends: the modules of its BACKENDS table (all under redknot.kernels)",
    "redknot.kernels.bindings": "third-party kernel packages by name (flash_mla, deep_gemm, torch_npu)",
    "redknot.models.registry": "model families: the modules of its FAMILIES table",
    "redknot.config.modes": "the harness's mode bodies (redknot.bench.app)",
}


def violations(modules) -> List[str]:
    found = []
    for mod in modules.values():
        for importers, forbidden, why in RULES:
            if not _under(mod.module, *importers):
                continue
            targets = sorted({resolve(name, modules) for name in mod.imports})
            found += [f"{mod.module} imports {target}: {why}" for target in targets if forbidden(target)]
    return found


@pytest.fixture(scope="module")
def modules():
    return package_imports()


def test_the_package_keeps_its_layers(modules):
    assert violations(modules) == []


def test_no_import_by_computed_name_outside_the_known_places(modules):
    dynamic = {name: mod.dynamic for name, mod in modules.items() if mod.dynamic}
    assert sorted(dynamic) == sorted(DYNAMIC_IMPORTS), dynamic


def test_kernel_backends_and_families_live_where_their_tables_say():
    from redknot.kernels.registry import BACKENDS
    from redknot.models.registry import FAMILIES

    assert all(_under(info.module, "kernels") for info in BACKENDS.values())
    assert all(is_model_family(entry.module) for entry in FAMILIES)


CHECKER_CASES = {
    "function-level import": ("def f():\n    from redknot.models.deepseek_v4 import build\n", True),
    "package attribute import": ("from redknot.models import deepseek_v4\n", True),
    "relative import": ("from ..models.deepseek_v4.state import V4State\n", True),
    "import_module with a constant": ("import importlib\nimportlib.import_module('redknot.models.deepseek_v4')\n",
                                      True),
    "lazy export table": ("_EXPORTS = {'X': 'redknot.models.deepseek_v4.model'}\n", True),
    "through the registry": ("from redknot.models.registry import family_for\n", False),
    "a string is not an import": ("NAME = 'redknot.models.' + 'deepseek_v4'\nDOC = f'{NAME}.build'\n", False),
    "a docstring is not an import": ('"""See redknot.models.deepseek_v4.state."""\n', False),
}


@pytest.mark.parametrize("case", sorted(CHECKER_CASES))
def test_the_checker_sees_real_imports_only(modules, case):
    source, bad = CHECKER_CASES[case]
    probe = {**modules, "redknot.engine.probe": parse_imports(source, "redknot.engine.probe")}
    found = [v for v in violations(probe) if v.startswith("redknot.engine.probe ")]
    assert bool(found) == bad, found
