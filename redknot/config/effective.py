"""What a resolved config really does, where that differs from what it says.

* :func:`effective_values` — values that have no effect as configured (``features.dspark.max_draft=5``
  with drafting off runs with 0 drafts); recorded as ``effective.*`` tags and printed as warnings.
* :func:`derive_suite_name` — a suite whose keys were overridden (``suite.context_tokens=1024`` on
  ``suite=smoke``) is not the suite its name says: it gets a derived name, ``smoke~<digest>``, and
  the changed keys are recorded with the run.
* :func:`outside_cwd` — output paths outside the directory the run starts from, refused unless
  ``output.allow_outside_cwd=true``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from redknot.config.schema import BudgetSource, DraftMethod, DraftSampling, RedKnotConfig, SuiteConfig
from redknot.config.violations import Violation, format_value

# Suite keys that do not change what is measured (where data is read from, how long to wait).
_SUITE_KEYS_IGNORED = ("name", "data", "request_timeout_s")


def effective_values(cfg: RedKnotConfig) -> Dict[str, str]:
    """``{key: note}`` for every value that does not take effect as written."""
    found: Dict[str, str] = {}
    dspark = cfg.features.dspark
    if not dspark.enabled and dspark.max_draft > 0:
        found["features.dspark.max_draft"] = (
            f"0 (features.dspark.method=none: nothing is drafted; the configured {dspark.max_draft} has "
            f"no effect)")
    if dspark.enabled and DraftMethod(dspark.method) == DraftMethod.mtp and \
            DraftSampling(dspark.draft_sampling) == DraftSampling.probabilistic:
        found["features.dspark.draft_sampling"] = "greedy (the classic MTP layer drafts its argmax chain)"
    par = cfg.features.parallel
    if dspark.enabled and dspark.adaptive and BudgetSource(dspark.budget) == BudgetSource.profile and \
            (par.dp > 1 or par.ep > 1 or par.cp > 1):
        found["features.dspark.adaptive"] = ("false (budget=profile with a parallel layout: ranks would time "
                                             "different costs, so every draft is verified)")
    if dspark.enabled and not dspark.adaptive and dspark.budget != BudgetSource.profile:
        found["features.dspark.budget"] = (
            f"unused (features.dspark.adaptive=false: every request verifies up to max_draft drafts; "
            f"budget={BudgetSource(dspark.budget).value} has no effect)")
    return found


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def suite_option(name: str, conf_dir: Optional[Path] = None) -> Optional[SuiteConfig]:
    """The suite option ``conf/suite/<name>.yaml`` as typed, or None when there is no such file."""
    from omegaconf import OmegaConf

    from redknot.config.hardware_fit import CONF_DIR

    path = (conf_dir or CONF_DIR) / "suite" / f"{name}.yaml"
    if not path.is_file():
        return None
    merged = OmegaConf.merge(OmegaConf.structured(SuiteConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def suite_changes(suite: SuiteConfig, option: SuiteConfig) -> Dict[str, Any]:
    """``{key: value}`` of the suite keys that differ from the option's YAML."""
    changes = {}
    for f in dataclasses.fields(SuiteConfig):
        if f.name in _SUITE_KEYS_IGNORED:
            continue
        ours, theirs = _plain(getattr(suite, f.name)), _plain(getattr(option, f.name))
        if ours != theirs:
            changes[f.name] = ours
    return changes


def derive_suite_name(cfg: RedKnotConfig, choice: Optional[str], conf_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Rename ``cfg.suite`` when its keys differ from the suite option it was composed from; return the
    differences. A suite named explicitly (``suite.name=...``) keeps its name."""
    option = suite_option(choice, conf_dir) if choice else None
    if option is None:
        return {}
    changes = suite_changes(cfg.suite, option)
    if changes and cfg.suite.name == option.name:
        digest = hashlib.sha256(json.dumps(changes, sort_keys=True).encode()).hexdigest()[:6]
        cfg.suite.name = f"{option.name}~{digest}"
    return changes


def describe_changes(changes: Dict[str, Any]) -> str:
    return " ".join(f"suite.{k}={format_value(v)}" for k, v in changes.items())


def _inside(path: str, base: Path) -> bool:
    full = os.path.abspath(base / Path(path).expanduser())
    root = os.path.abspath(base)
    return full == root or full.startswith(root.rstrip("/") + "/")


def outside_cwd(cfg: RedKnotConfig, base: Path) -> List[Violation]:
    """``output.root`` / ``output.cache_dir`` outside ``base`` without ``output.allow_outside_cwd``."""
    if cfg.output.allow_outside_cwd:
        return []
    found = []
    for key, value in (("output.root", cfg.output.root), ("output.cache_dir", cfg.output.cache_dir)):
        if key == "output.cache_dir" and found and _inside(value, base / cfg.output.root):
            continue  # already reported through output.root
        if not _inside(value, base):
            found.append(Violation(key, value, f"lies outside the directory the run starts from ({base}); "
                                              f"add output.allow_outside_cwd=true to write there"))
    return found
