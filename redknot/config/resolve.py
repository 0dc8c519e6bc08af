"""From Hydra's composed ``DictConfig`` to a validated, typed :class:`RunContext`.

This module and ``redknot/__main__.py`` are the only places that see a
``DictConfig``. :func:`resolve`:

1. checks the legacy DeepInfer environment variables (stop, or recompose with
   them as overrides when ``legacy_env=translate``);
2. converts to the typed :class:`RedKnotConfig` and reports keys the schema does
   not know (``+model.foo=1`` gets past Hydra's struct mode);
3. runs the one validation step (all violations at once);
4. makes every path absolute against the directory the user started from.
"""
from __future__ import annotations

import os
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import redknot.config.schema_store  # noqa: F401  (the schema must be in the ConfigStore before any compose)
from redknot.config.legacy import LegacyEnvError, find_legacy, merge_overrides, renamed_key
from redknot.config.effective import derive_suite_name, effective_values, outside_cwd
from redknot.config.schema import LegacyEnvPolicy, Mode, RedKnotConfig
from redknot.config.violations import ConfigError, Violation, validate

# Typed fields holding paths, made absolute by the resolver.
PATH_KEYS = ("output.root", "output.cache_dir", "engine.cache_dir", "model.path", "model.tokenizer_path",
             "suite.data.dir", "suite.data.archive", "run_dir")


@dataclass
class RunContext:
    """Everything a mode body gets: the typed config plus where and how the run was started."""
    cfg: RedKnotConfig
    run_dir: Path
    overrides: List[str]
    legacy_translation: Dict[str, str]
    config_yaml: str                      # the full resolved config, after legacy translation and path fixing
    choices: Dict[str, str] = field(default_factory=dict)  # group -> option, e.g. {"suite": "128k"}
    sweep_dir: Optional[Path] = None      # set for the jobs of a multirun
    job_num: Optional[int] = None
    # Values that differ from what the config says (e.g. max_draft without drafting), key -> note.
    effective: Dict[str, str] = field(default_factory=dict)
    # suite keys overridden from the suite option's YAML (the suite name is derived from them).
    suite_changes: Dict[str, Any] = field(default_factory=dict)
    # mode=compare: the two arms' configs, {name: typed config}, baseline first.
    arms: Dict[str, RedKnotConfig] = field(default_factory=dict)


def resolve(cfg: DictConfig, *, run_dir: Optional[os.PathLike] = None, overrides: Optional[List[str]] = None,
            environ: Optional[Mapping[str, str]] = None, cwd: Optional[os.PathLike] = None) -> RunContext:
    """Validate and type ``cfg``. Outside a Hydra run (tests, notebooks) pass
    ``run_dir`` and, if the config came from overrides, ``overrides``."""
    hydra_cfg = _hydra_config()
    if overrides is None:
        overrides = list(hydra_cfg.overrides.task) if hydra_cfg is not None else []
    base = Path(cwd) if cwd is not None else Path(hydra_cfg.runtime.cwd if hydra_cfg is not None else os.getcwd())
    environ = os.environ if environ is None else environ

    settings = find_legacy(environ)
    translation: Dict[str, str] = {}
    if settings:
        if OmegaConf.select(cfg, "legacy_env") != LegacyEnvPolicy.translate:
            raise LegacyEnvError(settings, overrides)
        merged, translation = merge_overrides(overrides, settings)
        cfg = _recompose(hydra_cfg, merged)
        overrides = merged

    typed = to_typed(cfg)
    violations = validate(typed) + outside_cwd(typed, base)
    arms: Dict[str, RedKnotConfig] = {}
    if typed.mode == Mode.compare and not violations:
        from redknot.config.arms import resolve_arms

        arms, arm_violations = resolve_arms(cfg, typed, overrides, hydra_cfg)
        violations += arm_violations
    if violations:
        raise ConfigError(violations)
    _absolutize(typed, base)
    for arm in arms.values():
        _absolutize(arm, base)
    choices = _choices(hydra_cfg)
    suite_changes = derive_suite_name(typed, choices.get("suite") or typed.suite.name)
    for arm in arms.values():
        arm.suite = typed.suite

    if run_dir is None:
        if hydra_cfg is None:
            raise ValueError("resolve() outside a Hydra run needs run_dir=")
        run_dir = hydra_cfg.runtime.output_dir
    sweep_dir, job_num = _sweep(hydra_cfg)
    return RunContext(
        cfg=typed, run_dir=Path(run_dir).resolve(), overrides=list(overrides), legacy_translation=translation,
        config_yaml=OmegaConf.to_yaml(OmegaConf.structured(typed)), choices=choices,
        sweep_dir=sweep_dir, job_num=job_num, effective=effective_values(typed), suite_changes=suite_changes,
        arms=arms)


def to_typed(cfg: DictConfig) -> RedKnotConfig:
    """The typed config; unknown keys and unconvertible values are a :class:`ConfigError`."""
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
        unknown = unknown_keys(container, RedKnotConfig)
        if unknown:
            raise ConfigError(unknown)
        typed = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError([Violation(key, getattr(err, "value", None), str(err).splitlines()[0])]) from err
    if not isinstance(typed, RedKnotConfig):
        raise ConfigError([Violation("config", type(typed).__name__, "the primary config must use redknot_schema")])
    return typed


def unknown_keys(node: Mapping[str, Any], cls: type, prefix: str = "") -> List[Violation]:
    """Keys in ``node`` that the dataclass ``cls`` (recursively) has no field for."""
    names = {f.name for f in fields(cls)}
    hints = typing.get_type_hints(cls)
    found = []
    for key, value in node.items():
        if key not in names:
            renamed = renamed_key(f"{prefix}{key}")
            found.append(Violation(f"{prefix}{key}", value, renamed or
                                   f"unknown key; {cls.__name__} has: {', '.join(sorted(names))}"))
            continue
        sub = _dataclass_in(hints[key])
        if sub is not None and isinstance(value, Mapping):
            found.extend(unknown_keys(value, sub, f"{prefix}{key}."))
    return found


def _dataclass_in(hint: Any) -> Optional[type]:
    if is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):  # Optional[X]
        if is_dataclass(arg):
            return arg
    return None


def _absolutize(typed: RedKnotConfig, base: Path) -> None:
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = typed
        for part in parents:
            node = getattr(node, part)
        value = getattr(node, leaf)
        if value is not None and "://" not in str(value):
            setattr(node, leaf, str((base / Path(value).expanduser()).resolve()))


def _hydra_config() -> Optional[DictConfig]:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _recompose(hydra_cfg: Optional[DictConfig], overrides: List[str]) -> DictConfig:
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        raise ValueError("legacy_env=translate needs an initialised Hydra (python -m redknot or hydra.initialize)")
    name = hydra_cfg.job.config_name if hydra_cfg is not None else "config"
    try:
        return compose(config_name=name, overrides=overrides)
    except Exception as err:  # a translated value Hydra refuses (bad group option, bad enum)
        raise ConfigError([Violation("legacy_env", "translate", f"translated overrides do not compose: {err}")])


def _choices(hydra_cfg: Optional[DictConfig]) -> Dict[str, str]:
    if hydra_cfg is None:
        return {}
    choices = OmegaConf.to_container(hydra_cfg.runtime.choices)
    return {k: str(v) for k, v in choices.items() if not k.startswith("hydra/")}


def _sweep(hydra_cfg: Optional[DictConfig]):
    from hydra.types import RunMode

    if hydra_cfg is None or hydra_cfg.mode != RunMode.MULTIRUN:
        return None, None
    return Path(hydra_cfg.sweep.dir).resolve(), int(hydra_cfg.job.num)
