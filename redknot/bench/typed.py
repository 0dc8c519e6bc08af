"""Typed config sections from plain data (JSON records of a run, YAML options for the catalog).

The harness never sees Hydra's ``DictConfig``: where it needs a section that did
not come through the resolver (the suite a past run used, the options listed by
``mode=catalog``) it reads plain data and builds the schema dataclass here.
"""
from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Dict, Type, TypeVar

T = TypeVar("T")


def _convert(kind: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(kind)
    if origin is typing.Union:
        options = [a for a in typing.get_args(kind) if a is not type(None)]
        return _convert(options[0], value) if len(options) == 1 else value
    if dataclasses.is_dataclass(kind) and isinstance(value, dict):
        return from_dict(kind, value)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return kind(value)
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        return list(value)
    if origin is dict and isinstance(value, dict):
        return dict(value)
    return value


def from_dict(cls: Type[T], data: Dict[str, Any]) -> T:
    """``cls(**data)`` with nested dataclasses and enums converted; unknown keys are an error naming them."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; allowed: {sorted(names)}")
    return cls(**{name: _convert(hints[name], value) for name, value in data.items()})


def load_yaml_option(path: Path, cls: Type[T]) -> T:
    """One config-group option file (plain values, no interpolation) as its typed section."""
    import yaml

    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    data = {k: v for k, v in data.items() if not k.startswith("defaults")}
    return from_dict(cls, data)
