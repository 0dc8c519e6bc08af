"""The resolved config as MLflow params, within MLflow's limits, never silently cut.

MLflow caps a param key at 250 characters and a value at 6,000 (tags: 8,000).
:func:`fit` keeps every key and value that fits unchanged; a value that does not
fit is replaced by a marker that says so and where the whole value is (the full
resolved YAML, ``config/resolved.yaml``, is always logged as an artifact, and
each replaced value is also logged on its own under ``params/``); a key that does
not fit is shortened with a hash suffix and the mapping recorded. The caller
turns :class:`FittedParams` ``.elided`` / ``.renamed`` into tags and artifacts.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

# MLflow's limits (mlflow.utils.validation; a test checks they still agree).
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

_BAD_KEY_CHARS = re.compile(r"[^\w./\- :]")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> Dict[str, str]:
    """``{"a": {"b": 1, "c": [1, 2]}}`` -> ``{"a.b": "1", "a.c": "[1, 2]"}``.

    Scalars keep their YAML/override spelling (``true``, ``null``); lists are one
    JSON value (a sweep over ``suite.datasets`` compares as one param); an empty
    mapping is kept as ``{}`` so that the key still shows.
    """
    flat: Dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = to_text(value)
    return flat


def to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) or isinstance(value, (list, tuple, bool)) or value is None:
        return json.dumps(value, default=str)
    return str(value)


@dataclass
class FittedParams:
    """Params ready for MLflow plus what had to change to get there."""
    params: Dict[str, str] = field(default_factory=dict)
    elided: Dict[str, str] = field(default_factory=dict)   # key -> full value (replaced by a marker)
    renamed: Dict[str, str] = field(default_factory=dict)  # logged key -> original key


def short_key(key: str, limit: int = MAX_KEY_LENGTH) -> str:
    safe = _BAD_KEY_CHARS.sub("_", key)
    if len(safe) <= limit and safe == key:
        return key
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return safe if len(safe) <= limit else f"{safe[:limit - 11]}~{digest}"


def elided_marker(value: str, artifact: str) -> str:
    return f"<{len(value)} characters, over MLflow's limit: full value in artifact {artifact}>"


def fit(flat: Mapping[str, str], value_limit: int = MAX_PARAM_VALUE_LENGTH,
        key_limit: int = MAX_KEY_LENGTH, artifact_dir: str = "params") -> FittedParams:
    out = FittedParams()
    for key, value in flat.items():
        logged = short_key(key, key_limit)
        if logged != key:
            out.renamed[logged] = key
        if len(value) > value_limit:
            out.elided[logged] = value
            value = elided_marker(value, f"{artifact_dir}/{logged}.txt")
        out.params[logged] = value
    return out


def batches(items: Mapping[str, Any], size: int):
    """Successive dicts of at most ``size`` items."""
    keys = list(items)
    for start in range(0, len(keys), size):
        yield {k: items[k] for k in keys[start:start + size]}
