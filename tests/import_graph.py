"""The redknot package's imports, read from the source with ``ast`` (every scope, not only the top).

An import is an ``import`` / ``from ... import`` statement anywhere in a module (relative ones
resolved), an ``importlib.import_module`` / ``__import__`` call with a constant module name, or a
module named in a lazy-export table (``_EXPORTS = {name: module}``). Calls that compute the module
name at run time are listed apart (:attr:`ModuleImports.dynamic`): no static check can see where
they go. Strings elsewhere (docstrings, messages, config targets) are not imports.

``python tests/import_graph.py`` prints the package-level graph as a markdown table.
"""
from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "redknot"


@dataclass
class ModuleImports:
    """What one module imports. A ``from a import b`` is recorded as ``a.b`` (``b`` may be a module
    or a name inside ``a``: :func:`resolve` tells)."""
    module: str
    path: Path
    imports: Set[str] = field(default_factory=set)
    dynamic: List[int] = field(default_factory=list)  # line numbers of computed-name imports


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def parse_imports(source: str, module: str, is_package: bool = False, path: Path = Path("<string>")) -> ModuleImports:
    """The imports of one module's source (see the module docstring)."""
    found = ModuleImports(module, path)
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.imports.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.imports.update(target if alias.name == "*" else f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_call(node) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.imports.add(arg.value)
            else:
                found.dynamic.append(node.lineno)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                found.imports.update(v.value for v in node.value.values
                                     if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return found


def package_imports(package_dir: Path = PACKAGE_DIR) -> Dict[str, ModuleImports]:
    """Every module of the package by name."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        name = module_name(path, package_dir.parent)
        out[name] = parse_imports(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", path)
    return out


def resolve(name: str, modules: Dict[str, ModuleImports]) -> str:
    """The longest prefix of an imported name that is a module of the package (``name`` itself
    for anything outside it: ``torch.nn``, ``hydra``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return name


def part_of(module: str) -> str:
    """The package-level node of a ``redknot`` module: ``engine``, ``models.registry``,
    ``models.deepseek_v4`` (one node per model family), ...; '' for modules outside redknot."""
    parts = module.split(".")
    if parts[0] != "redknot":
        return ""
    if len(parts) == 1:
        return "redknot"
    if parts[1] == "models" and len(parts) > 2:
        return "models." + parts[2]
    return parts[1]


def package_graph(modules: Dict[str, ModuleImports]) -> Dict[str, Set[str]]:
    """part -> the other redknot parts it imports (the top-level ``redknot`` package left out)."""
    graph: Dict[str, Set[str]] = defaultdict(set)
    for mod in modules.values():
        src = part_of(mod.module)
        for name in mod.imports:
            dst = part_of(resolve(name, modules))
            if dst and dst not in (src, "redknot"):
                graph[src].add(dst)
    return graph


def markdown(graph: Dict[str, Set[str]]) -> str:
    lines = ["| package | imports |", "|---|---|"]
    lines += [f"| {src} | {', '.join(sorted(graph[src]))} |" for src in sorted(graph)]
    return "\n".join(lines)


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() / "redknot" if len(sys.argv) > 1 else PACKAGE_DIR
    print(markdown(package_graph(package_imports(root))))
