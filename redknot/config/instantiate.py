"""Building RedKnot's swappable parts from the ``_target_`` entries of the config.

``build(node, key, **kwargs)`` wraps :func:`hydra.utils.instantiate` with two
rules of the house:

* only targets inside the ``redknot`` package are built; anything else (or a
  target that does not import) is an error naming the key, the target and the
  targets RedKnot ships for that key;
* a part takes its typed config section whole: when the target has a parameter
  named after the section (``engine`` for ``redknot.engine.build_engine``), the
  typed section is passed there and ``kwargs`` are passed as they are (objects
  are never converted to ``DictConfig``). Otherwise the node's fields are the
  keyword arguments, as in plain Hydra (``KernelSet(default=..., ops=...)``).

Example: ``build(cfg.engine, "engine", model=cfg.model, hardware=cfg.hardware,
features=cfg.features, kernels=kernels)`` calls
``build_engine(engine=cfg.engine, model=..., hardware=..., features=..., kernels=...)``.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

from redknot.config.rules import KNOWN_TARGETS, TARGET_PACKAGE


class BuildError(ValueError):
    """A ``_target_`` that may not or cannot be built; names the key and the allowed targets."""


def build(node: Any, key: str, **kwargs: Any) -> Any:
    """Instantiate ``node`` (a typed section, a dict or a ``DictConfig`` with ``_target_``)."""
    from hydra.utils import instantiate

    target = _target_of(node, key)
    fn = _locate(target, key)
    section = key.rsplit(".", 1)[-1]
    if section in _parameters(fn):
        # The whole typed section goes in as one argument; _partial_ keeps Hydra from
        # converting (or recursively instantiating) the objects passed in kwargs.
        partial = instantiate({"_target_": target, "_partial_": True})
        return partial(**{section: node}, **kwargs)
    fields = _fields(node)
    return instantiate({"_target_": target, **fields}, _convert_="all", **kwargs)


def allowed_targets(key: str) -> list:
    return list(KNOWN_TARGETS.get(key, ())) or [f"{TARGET_PACKAGE}*"]


def _target_of(node: Any, key: str) -> str:
    target = node.get("_target_") if isinstance(node, Mapping) else getattr(node, "_target_", None)
    if not target:
        raise BuildError(f"{key}: no _target_ to build; allowed targets for {key}: {allowed_targets(key)}")
    if not str(target).startswith(TARGET_PACKAGE):
        raise BuildError(f"{key}._target_={target}: only targets inside the redknot package are built; "
                         f"allowed targets for {key}: {allowed_targets(key)}")
    return str(target)


def _locate(target: str, key: str):
    from hydra._internal.utils import _locate  # what instantiate uses; get_object also logs the failure

    try:
        return _locate(target)
    except Exception as err:  # ImportError or AttributeError inside Hydra's locator
        raise BuildError(f"{key}._target_={target} cannot be imported ({err}); "
                         f"allowed targets for {key}: {allowed_targets(key)}") from err


def _parameters(fn: Any) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def _fields(node: Any) -> dict:
    if dataclasses.is_dataclass(node):
        data = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    else:
        from omegaconf import DictConfig, OmegaConf

        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    data.pop("_target_", None)
    return data
