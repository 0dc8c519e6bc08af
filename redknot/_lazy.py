"""Lazy package exports (PEP 562): a name is imported from its module on first access, so importing
a package does not import torch or anything else its heavy modules need."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, MutableMapping


def lazy_getattr(package: str, exports: Dict[str, str], namespace: MutableMapping[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: ``exports`` maps each name to the module defining it;
    a resolved name is cached in ``namespace`` (the package's globals)."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    return __getattr__
