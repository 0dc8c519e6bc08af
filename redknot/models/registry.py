"""The model-family registry: which family serves a model config or a checkpoint (pure Python).

A family is one folder under ``redknot/models/`` whose ``family.py`` defines
``FAMILY``, an instance of :class:`redknot.models.family.ModelFamily`. The table
below is the only place that names a family: its ``model.family`` value, the
``architectures`` and ``model_type`` values of the ``config.json`` files it
loads, and its module (imported on first use, so reading this table needs
neither torch nor the model code). Adding a family is one folder plus one entry.

``family_for(model_cfg)`` is how the engine and the harness find a model's
family: by ``model.family``, checked against the checkpoint's ``config.json``
when ``model.path`` is set.
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

if TYPE_CHECKING:
    from redknot.models.family import ModelFamily


@dataclass(frozen=True)
class FamilyEntry:
    """One registered model family."""
    name: str                        # the ``model.family`` value
    architectures: Tuple[str, ...]   # config.json ``architectures`` entries it loads
    model_types: Tuple[str, ...]     # config.json ``model_type`` values it loads
    module: str                      # module defining ``FAMILY`` (a ModelFamily)
    description: str = ""

    def accepts(self, config: Mapping[str, Any]) -> bool:
        """Whether a checkpoint's config.json is this family's: every field it states must match,
        and it must state at least one of ``architectures`` and ``model_type``."""
        archs = config.get("architectures")
        model_type = config.get("model_type")
        if archs is None and model_type is None:
            return False
        if archs is not None and not set(archs) & set(self.architectures):
            return False
        return model_type is None or model_type in self.model_types

    def check_identity(self, config: Mapping[str, Any]) -> None:
        """Raise ValueError naming the field when config.json states an ``architectures`` or
        ``model_type`` this family does not load (a field it leaves out is not checked)."""
        archs = config.get("architectures")
        if archs is not None and not set(archs) & set(self.architectures):
            raise ValueError(f"config.json field 'architectures'={archs!r}: "
                             f"this model family loads {list(self.architectures)} only")
        mt = config.get("model_type")
        if mt is not None and mt not in self.model_types:
            raise ValueError(f"config.json field 'model_type'={mt!r}: must be one of {list(self.model_types)}")


FAMILIES: Tuple[FamilyEntry, ...] = (
    FamilyEntry("deepseek_v4", ("DeepseekV4ForCausalLM",), ("deepseek_v4",),
                "redknot.models.deepseek_v4.family",
                "DeepSeek-V4-Flash: SWA + CSA/HCA compressed attention, mHC, MoE, one classic MTP layer"),
    FamilyEntry("deepseek_v41", ("DeepseekV41ForCausalLM",), ("deepseek_v41", "deepseek_v41_text"),
                "redknot.models.deepseek_v41.family",
                "DeepSeek-V4.1-Flash: shared compressed caches (ratio 2/1 sources), two-level indexer, "
                "Engram hash memory, lagged mHC, MXFP4 experts, DSpark draft stages"),
)

CONFIG_FILE = "config.json"

_LOADED: Dict[str, "ModelFamily"] = {}


class FamilyError(ValueError):
    """A model config or checkpoint that no registered family serves, or that two sources disagree on."""


def list_families() -> List[FamilyEntry]:
    return list(FAMILIES)


def family_entry(name: str) -> FamilyEntry:
    for entry in FAMILIES:
        if entry.name == name:
            return entry
    raise FamilyError(f"model.family={name!r}: not a registered model family; "
                      f"known families: {[e.name for e in FAMILIES]}")


def detect_family(config: Mapping[str, Any]) -> FamilyEntry:
    """The family whose ``architectures`` / ``model_type`` the config.json dict declares."""
    for entry in FAMILIES:
        if entry.accepts(config):
            return entry
    accepted = "; ".join(f"{e.name}: architectures {list(e.architectures)}, model_type {list(e.model_types)}"
                         for e in FAMILIES)
    raise FamilyError(f"config.json declares architectures={config.get('architectures')!r}, "
                      f"model_type={config.get('model_type')!r}: no registered model family loads it "
                      f"(accepted: {accepted})")


def read_checkpoint_config(path: str) -> Optional[Dict[str, Any]]:
    """``<path>/config.json`` as a dict, or None when the file is not there."""
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path, encoding="utf-8") as f:
        return json.load(f)


def load_family(name: str) -> "ModelFamily":
    """The family implementation registered as ``name`` (its module imported on first use)."""
    entry = family_entry(name)
    if name not in _LOADED:
        _LOADED[name] = importlib.import_module(entry.module).FAMILY
    return _LOADED[name]


def family_for(model_cfg: Any) -> "ModelFamily":
    """The family of a ``ModelConfig``: ``model.family``, which must agree with the checkpoint's
    config.json when ``model.path`` holds one that states ``architectures`` or ``model_type``."""
    entry = family_entry(model_cfg.family)
    path = getattr(model_cfg, "path", None)
    config = read_checkpoint_config(path) if path else None
    if config is not None and (config.get("architectures") is not None or config.get("model_type") is not None):
        found = detect_family(config)
        if found.name != entry.name:
            raise FamilyError(
                f"model.family={entry.name!r} but {os.path.join(path, CONFIG_FILE)} declares "
                f"architectures={config.get('architectures')!r}, model_type={config.get('model_type')!r}, "
                f"which is model family {found.name!r}; set model.family={found.name}")
    return load_family(entry.name)
