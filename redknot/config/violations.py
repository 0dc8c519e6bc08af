"""The one cross-field validation step.

:func:`validate` runs every rule in :mod:`redknot.config.rules` over a typed
:class:`RedKnotConfig` and returns *all* violations, so a user fixes a config in
one round trip instead of one error at a time. Each violation names the key (as
the override a user would type), its value and the rule it breaks.

Nothing here touches the filesystem or a device: ``hardware=sm100`` validates on
a laptop. What only the running engine can know (the device, the world size) is
checked at engine start with :func:`check_parallel_layout` and
:mod:`redknot.config.hardware_fit`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any, List, Optional, Sequence

from redknot.config.schema import ParallelConfig, RedKnotConfig


@dataclass(frozen=True)
class Violation:
    """One broken rule: ``key=value: rule``."""
    key: str
    value: Any
    rule: str

    def __str__(self) -> str:
        return f"{self.key}={format_value(self.value)}: {self.rule}"


class ConfigError(ValueError):
    """An invalid configuration; the message lists every violation."""

    def __init__(self, violations: Sequence[Violation], header: str = "invalid configuration"):
        self.violations = list(violations)
        count = len(self.violations)
        lines = [f"{header} ({count} problem{'s' if count != 1 else ''}):"]
        lines += [f"  - {v}" for v in self.violations]
        super().__init__("\n".join(lines))


def format_value(value: Any) -> str:
    """A value as it would be written in an override (``null``, ``true``, ``[a, b]``)."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)) or value is None or isinstance(value, bool):
        return json.dumps(value, default=str)
    return str(value)


def validate(cfg: RedKnotConfig) -> List[Violation]:
    """Every violation of every rule, in rule order (empty list: valid)."""
    from redknot.config.rules import RULES

    found: List[Violation] = []
    for rule in RULES:
        found.extend(rule(cfg))
    return found


def check(cfg: RedKnotConfig) -> None:
    """Raise :class:`ConfigError` listing all violations, if there are any."""
    violations = validate(cfg)
    if violations:
        raise ConfigError(violations)


def check_parallel_layout(parallel: ParallelConfig, world_size: int,
                          num_devices: Optional[int] = None) -> List[Violation]:
    """Rules that need the launched world: call at engine start.

    Attention data parallel and context parallel tile the ranks (``dp * cp ==
    world_size``); MoE expert parallel groups span ranks (``ep`` divides the
    world size). ``num_devices`` (accelerators visible on this host, None on
    CPU) bounds the ranks one host can run with one device each.
    """
    found: List[Violation] = []
    for name in ("dp", "ep", "cp"):
        size = getattr(parallel, name)
        if size < 1:
            found.append(Violation(f"features.parallel.{name}", size, "parallel sizes must be positive"))
    if found:
        return found
    if parallel.dp * parallel.cp != world_size:
        found.append(Violation(
            "features.parallel.dp", parallel.dp,
            f"features.parallel.dp ({parallel.dp}) * features.parallel.cp ({parallel.cp}) = "
            f"{parallel.dp * parallel.cp} must equal the world size ({world_size} processes launched)"))
    if parallel.ep > world_size or world_size % parallel.ep:
        found.append(Violation(
            "features.parallel.ep", parallel.ep,
            f"must divide the world size ({world_size}) so expert-parallel groups cover every rank"))
    if num_devices is not None and world_size > num_devices:
        found.append(Violation(
            "features.parallel.dp", parallel.dp,
            f"the layout needs {world_size} devices (one per rank) but {num_devices} are visible"))
    return found


def require_parallel_layout(parallel: ParallelConfig, world_size: int,
                            num_devices: Optional[int] = None) -> None:
    """:func:`check_parallel_layout`, raising :class:`ConfigError` on any violation."""
    violations = check_parallel_layout(parallel, world_size, num_devices)
    if violations:
        raise ConfigError(violations, header="parallel layout does not fit the launched world")
