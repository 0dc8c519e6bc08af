"""The two arms of ``mode=compare``: the run's config with each arm's overrides applied.

Inside ``python -m redknot`` each arm is composed by Hydra from the command line's overrides
plus the arm's (so an arm may switch a config group, ``model=tiny``); outside Hydra (tests,
notebooks) an arm's ``key=value`` overrides are merged into the composed config. Each arm is
typed and validated like a run: every problem of either arm is reported at once, prefixed with
the arm (``compare.candidate: features.swa_replay.keep_tokens=...``).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from redknot.config.schema import RedKnotConfig
from redknot.config.violations import ConfigError, Violation, validate


def _compose(hydra_cfg: Optional[DictConfig], overrides: List[str]) -> DictConfig:
    from hydra import compose

    name = hydra_cfg.job.config_name if hydra_cfg is not None else "config"
    return compose(config_name=name, overrides=overrides)


def _merge(cfg: DictConfig, arm: List[str]) -> DictConfig:
    groups = [o for o in arm if "=" in o and "." not in o.split("=", 1)[0]]
    if groups:
        raise ValueError(f"group overrides {groups} need python -m redknot (Hydra composes them)")
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(arm)))


def arm_config(cfg: DictConfig, arm: List[str], base_overrides: List[str],
               hydra_cfg: Optional[DictConfig]) -> DictConfig:
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return _compose(hydra_cfg, list(base_overrides) + list(arm))
    return _merge(cfg, arm)


def resolve_arms(cfg: DictConfig, typed: RedKnotConfig, overrides: List[str],
                 hydra_cfg: Optional[DictConfig]) -> Tuple[Dict[str, RedKnotConfig], List[Violation]]:
    """``({name: typed arm config}, violations)`` for the baseline and the candidate."""
    from redknot.config.resolve import to_typed

    arms: Dict[str, RedKnotConfig] = {}
    found: List[Violation] = []
    spec = typed.compare
    for key, name, arm in (("compare.baseline", spec.baseline_name, spec.baseline),
                           ("compare.candidate", spec.candidate_name, spec.candidate)):
        try:
            arm_typed = to_typed(arm_config(cfg, list(arm), overrides, hydra_cfg))
        except ConfigError as err:
            found += [Violation(key, arm, f"{v}") for v in err.violations]
            continue
        except Exception as err:  # an override Hydra or OmegaConf refuses
            found.append(Violation(key, arm, f"does not compose: {str(err).splitlines()[0]}"))
            continue
        found += [Violation(key, arm, f"{v}") for v in validate(arm_typed)]
        if arm_typed.suite != typed.suite or arm_typed.output != typed.output:
            found.append(Violation(key, arm, "changes suite.* or output.*: both arms run the same frozen inputs "
                                             "and write one comparison; set those outside the arms"))
        arms[name] = arm_typed
    return arms, found
