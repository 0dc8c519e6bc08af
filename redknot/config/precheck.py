"""Checks made before Hydra starts a run (``python -m redknot``'s first step).

Hydra stops at the first bad override with its own exit code (1) and creates
the run directory before RedKnot sees the config. :func:`precheck` composes the
command line first, with Hydra's compose API, and reports *every* problem at
once with exit code 2: overrides that do not parse or compose (each tried on
its own, every value of a sweep too), cross-field rule violations, and output
paths (``output.root``, ``hydra.run.dir``, ``hydra.sweep.dir``) outside the
directory the run starts from unless ``output.allow_outside_cwd=true``. With
``--cfg`` (Hydra prints the config and runs nothing) it also applies the legacy
DeepInfer variable policy: ``stop`` refuses, ``translate`` adds the overrides.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from redknot.config.violations import ConfigError, Violation

# Hydra flags that take a value, and flags after which RedKnot leaves everything to Hydra.
_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--experimental-rerun"}
_HANDS_OFF = {"--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc", "--config-path", "-cp",
              "--config-name", "-cn", "--config-dir", "-cd", "--version", "--experimental-rerun"}


@dataclass
class Precheck:
    """What :func:`precheck` found: violations (exit 2) and overrides to add (legacy translation)."""
    violations: List[Violation] = field(default_factory=list)
    extra_overrides: List[str] = field(default_factory=list)
    legacy_stop: Optional[str] = None


def split_argv(argv: Sequence[str]) -> Tuple[List[str], List[str], bool]:
    """(Hydra flags, overrides, multirun) from ``sys.argv[1:]``."""
    flags, overrides, multirun, skip = [], [], False, False
    for arg in argv:
        if skip:
            flags.append(arg)
            skip = False
        elif arg in ("-m", "--multirun"):
            multirun = True
            flags.append(arg)
        elif arg.startswith("-"):
            flags.append(arg)
            skip = arg in _VALUE_FLAGS
        else:
            overrides.append(arg)
    return flags, overrides, multirun


def _message(err: BaseException) -> str:
    parts = [str(err)]
    cause = err.__cause__
    if cause is not None and str(cause) not in parts[0]:
        parts.append(str(cause))
    lines = [line.rstrip() for part in parts for line in part.splitlines() if line.strip()]
    keep = [line for line in lines if not line.strip().startswith((
        "Config search path", "provider=", "full_key:", "object_type=", "reference_type=", "Error merging override",
        "Set the environment variable HYDRA_FULL_ERROR"))]
    return " ".join(line.strip() for line in keep[:40]) or type(err).__name__


def _compose(overrides: List[str]):
    from hydra import compose

    return compose("config", overrides=list(overrides), return_hydra_config=True)


def _single_values(override: str) -> List[str]:
    """A sweep override (``a=1,2``) as one override per value; anything else as itself."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides([override])[0]
    if not parsed.is_sweep_override():
        return [override]
    try:
        values = list(parsed.sweep_string_iterator())
    except Exception:  # range()/interval() sweeps of floats: the jobs themselves check those
        return []
    prefix = override.split("=", 1)[0]
    return [f"{prefix}={value}" for value in values]


def _parse_each(overrides: List[str]) -> Tuple[List[str], List[Violation]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    good, bad = [], []
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
            good.append(override)
        except Exception as err:
            bad.append(Violation(override.split("=", 1)[0], override.split("=", 1)[-1],
                                 f"not a valid override: {_message(err)}"))
    return good, bad


def _compose_each(overrides: List[str], multirun: bool) -> Tuple[List[str], List[Violation]]:
    """Overrides that compose on their own (every value of a sweep), and one violation per one that does not."""
    good, bad = [], []
    for override in overrides:
        values = _single_values(override) if multirun else [override]
        problems = []
        for value in values:
            try:
                _compose([value])
            except Exception as err:
                problems.append(f"{value}: {_message(err)}" if len(values) > 1 else _message(err))
        if problems:
            from redknot.config.legacy import renamed_key

            key, _, value = override.partition("=")
            renamed = renamed_key(key)
            bad.append(Violation(key, value, renamed if renamed else "; ".join(problems)))
        elif not multirun or values == [override]:
            good.append(override)
        elif values:
            good.append(values[0])  # one value stands for the sweep in the combined check below
    return good, bad


def _norm(path: Path) -> Path:
    text = os.path.abspath(path)
    return Path("/" + text.lstrip("/"))  # POSIX keeps a leading "//" apart; here it is "/"


def _outside(path: str, base: Path) -> bool:
    try:
        _norm(base / Path(path).expanduser()).relative_to(_norm(base))
    except ValueError:
        return True
    return False


def output_path_violations(cfg, base: Path, multirun: bool) -> List[Violation]:
    """Output paths outside ``base`` (the directory the run starts from) without ``output.allow_outside_cwd``,
    and output paths that cannot be created or written."""
    from omegaconf import OmegaConf

    allow = bool(OmegaConf.select(cfg, "output.allow_outside_cwd", default=False))
    keys = ["output.root", "output.cache_dir", "hydra.sweep.dir" if multirun else "hydra.run.dir"]
    found, refused = [], []
    for key in keys:
        value = OmegaConf.select(cfg, key, default=None)
        if value is None or any(not _outside(str(value), Path(parent)) for parent in refused):
            continue  # inside a path already reported
        full = _norm(base / Path(str(value)).expanduser())
        problem = None
        if not allow and _outside(str(value), base):
            problem = (f"lies outside the directory the run starts from ({base}); add output.allow_outside_cwd=true "
                       f"to write there")
        problem = problem or _unwritable(full)
        if problem:
            refused.append(str(full))
            found.append(Violation(key, value, problem))
    return found


def _unwritable(path: Path) -> Optional[str]:
    """Why ``path`` cannot be created or written (its nearest existing ancestor decides), else None."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot be created: {probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"cannot be written: {probe} is read-only for this user"
    return None


def _rules(cfg) -> List[Violation]:
    from omegaconf import open_dict

    from redknot.config.resolve import to_typed
    from redknot.config.violations import validate

    with open_dict(cfg):
        del cfg["hydra"]
    try:
        return validate(to_typed(cfg))
    except ConfigError as err:
        return err.violations


def _legacy(flags: List[str], overrides: List[str], environ: Mapping[str, str], cfg, result: Precheck) -> None:
    from omegaconf import OmegaConf

    from redknot.config.legacy import find_legacy, merge_overrides, stop_message

    if not any(f in ("--cfg", "-c") for f in flags):
        return  # a run applies the policy itself, in the resolver
    try:
        settings = find_legacy(environ)
    except ConfigError as err:
        result.violations += err.violations
        return
    if not settings:
        return
    if OmegaConf.select(cfg, "legacy_env") == "translate":
        merged, _ = merge_overrides(overrides, settings)
        result.extra_overrides = merged[len(overrides):]
    else:
        result.legacy_stop = stop_message(settings, overrides)


def precheck(argv: Sequence[str], conf_dir: Path, cwd: Optional[Path] = None,
             environ: Optional[Mapping[str, str]] = None) -> Optional[Precheck]:
    """Check the command line (see the module docstring); None when Hydra should handle it alone."""
    from hydra import initialize_config_dir

    import redknot.config.schema_store  # noqa: F401

    flags, overrides, multirun = split_argv(argv)
    if any(f in _HANDS_OFF for f in flags):
        return None
    environ = os.environ if environ is None else environ
    base = Path(cwd or os.getcwd())
    result = Precheck()
    parsed, result.violations = _parse_each(overrides)
    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        try:
            cfg = _compose(parsed if not multirun else [o for o in parsed if not _is_sweep(o)])
            good = parsed
        except Exception:
            good, bad = _compose_each(parsed, multirun)
            result.violations += bad
            try:
                cfg = _compose(good if not multirun else [o for o in good if not _is_sweep(o)])
            except Exception as err:  # overrides that compose alone but not together
                result.violations.append(Violation("overrides", " ".join(good), _message(err)))
                return result
        if multirun:
            result.violations += _compose_each([o for o in good if _is_sweep(o)], True)[1]
        from omegaconf import OmegaConf

        run_mode = str(OmegaConf.select(cfg, "hydra.mode", default="")).endswith("MULTIRUN")
        result.violations += output_path_violations(cfg, base, multirun or run_mode)
        _legacy(flags, overrides, environ, cfg, result)
        legacy_set = any(environ.get(name) for name in _legacy_names())
        if not multirun and not run_mode and not legacy_set and not result.legacy_stop:
            # (with legacy variables set, the resolver checks the config after translating them)
            result.violations += _rules(cfg)
    return result


def _is_sweep(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides([override])[0].is_sweep_override()
    except Exception:
        return False


def _legacy_names() -> List[str]:
    from redknot.config.legacy import LEGACY_VARS

    return [var.name for var in LEGACY_VARS]
