"""Legacy DeepInfer environment variables.

They never change behaviour silently. With ``legacy_env=stop`` (the default) a
set variable stops the run with the equivalent Hydra overrides printed; with
``legacy_env=translate`` they are applied as overrides (the resolver recomposes
the config with them) and the translation is recorded in MLflow.

A variable set to the empty string counts as unset (``export VAR=`` is how many
launch scripts clear one).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from redknot.config.violations import ConfigError, Violation

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

# DEEPINFER_ACCELERATOR spellings -> hardware option.
ACCELERATORS = {
    "cpu": "cpu",
    "cuda": "sm90-port", "sm90": "sm90-port", "hopper": "sm90-port", "h100": "sm90-port", "h200": "sm90-port",
    "sm100": "sm100", "blackwell": "sm100", "b200": "sm100", "gb200": "sm100",
    "npu": "ascend950", "ascend": "ascend950", "ascend950": "ascend950",
}
TRUNCATION_MODES = {"off": "off", "none": "off", "0": "off", "false": "off",
                    "compact": "compact", "1": "compact", "true": "compact", "on": "compact"}


class LegacyValueError(ValueError):
    """A legacy variable whose value has no equivalent override."""


def _bool(key: str) -> Callable[[str], List[str]]:
    def convert(raw: str) -> List[str]:
        value = raw.strip().lower()
        if value in _TRUE:
            return [f"{key}=true"]
        if value in _FALSE:
            return [f"{key}=false"]
        raise LegacyValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
    return convert


def _choice(key: str, table: Mapping[str, str]) -> Callable[[str], List[str]]:
    def convert(raw: str) -> List[str]:
        value = table.get(raw.strip().lower())
        if value is None:
            raise LegacyValueError(f"expected one of {sorted(table)}")
        return [f"{key}={value}"]
    return convert


def _int(key: str) -> Callable[[str], List[str]]:
    def convert(raw: str) -> List[str]:
        try:
            return [f"{key}={int(raw.strip())}"]
        except ValueError:
            raise LegacyValueError("expected an integer") from None
    return convert


def _nextn(raw: str) -> List[str]:
    # UNCONFIRMED meaning (reference dspark.md §4.6): a switch, or the draft count (its default, 5, is
    # the DSpark block size). A switch turns drafting on/off; a count N >= 1 also caps the drafts verified.
    value = raw.strip().lower()
    if value in _FALSE:
        return ["features.dspark.method=none"]
    if value in _TRUE - {"1"}:
        return ["features.dspark.method=auto"]
    try:
        count = int(value)
    except ValueError:
        raise LegacyValueError(f"expected one of {sorted(_TRUE | _FALSE)} or a draft count >= 0") from None
    if count < 0:
        raise LegacyValueError("expected a draft count >= 0")
    return ["features.dspark.method=auto", f"features.dspark.max_draft={count}"] if count else \
        ["features.dspark.method=none"]


def _model_dir(raw: str) -> List[str]:
    # The old variable pointed at a V4-Flash checkpoint; model.path takes it over.
    return ["model=deepseek-v4-flash", f"model.path={raw.strip()}"]


@dataclass(frozen=True)
class LegacyVar:
    """One DeepInfer variable: what it did and how it maps to overrides."""
    name: str
    meaning: str
    replacement: str   # the override(s), as documented
    convert: Callable[[str], List[str]]


LEGACY_VARS: Tuple[LegacyVar, ...] = (
    LegacyVar("DEEPINFER_ACCELERATOR", "target device",
              "hardware=cpu|sm90-port|sm100|ascend950", _choice("hardware", ACCELERATORS)),
    LegacyVar("DEEPINFER_HF_MODEL_DIR", "checkpoint directory",
              "model=deepseek-v4-flash model.path=DIR", _model_dir),
    LegacyVar("DEEPINFER_ENABLE_MTP_VARLEN", "variable-length (confidence-scheduled) draft verification",
              "features.dspark.adaptive=true|false", _bool("features.dspark.adaptive")),
    LegacyVar("DEEPINFER_USE_NEXTN_DECODE", "next-n speculative decoding (on/off, or the draft count)",
              "features.dspark.method=auto|none features.dspark.max_draft=N", _nextn),
    LegacyVar("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "SWA bounded replay of the prefill",
              "features.swa_replay.mode=off|compact", _choice("features.swa_replay.mode", TRUNCATION_MODES)),
    LegacyVar("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "tokens kept by bounded replay",
              "features.swa_replay.keep_tokens=N", _int("features.swa_replay.keep_tokens")),
    LegacyVar("DEEPINFER_BATCH_INVARIANT", "batch-invariant kernels",
              "features.batch_invariant.enabled=true|false", _bool("features.batch_invariant.enabled")),
)


# Config keys that were replaced: old key -> what to write instead. Composing or resolving a config
# that still uses one fails with this message rather than a bare "unknown key".
RENAMED_KEYS: Dict[str, str] = {
    "features.dspark.enabled": "replaced by features.dspark.method=auto|dspark|mtp|none "
                               "(enabled=false -> method=none; enabled=true -> method=auto)",
    "features.dspark.varlen": "replaced by features.dspark.adaptive=true|false "
                              "(confidence-scheduled verify lengths)",
    "features.dspark.confidence_threshold": "replaced by confidence scheduling: features.dspark.adaptive=true "
                                            "with features.dspark.budget=profile|file|fixed",
    "features.verification": "replaced by features.dspark.verification=token|block (greedy requests are "
                             "always verified by argmax match)",
    "features.verification.method": "replaced by features.dspark.verification=token|block (greedy requests "
                                    "are always verified by argmax match)",
}


def renamed_key(key: str) -> Optional[str]:
    """The message for a replaced config key (``features.dspark.enabled``), or None."""
    return RENAMED_KEYS.get(key.lstrip("+~"))


@dataclass(frozen=True)
class LegacySetting:
    """A legacy variable found in the environment and its equivalent overrides."""
    name: str
    value: str
    overrides: Tuple[str, ...]


def find_legacy(environ: Mapping[str, str]) -> List[LegacySetting]:
    """Every set legacy variable with its overrides; an untranslatable value raises
    :class:`ConfigError` naming the variable, its value and the accepted values."""
    found, bad = [], []
    for var in LEGACY_VARS:
        raw = environ.get(var.name)
        if raw is None or raw == "":
            continue
        try:
            found.append(LegacySetting(var.name, raw, tuple(var.convert(raw))))
        except LegacyValueError as err:
            bad.append(Violation(var.name, raw, f"{err} (replacement: {var.replacement})"))
    if bad:
        raise ConfigError(bad, header="legacy DeepInfer environment variables with values RedKnot cannot translate")
    return found


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(explicit: List[str], settings: List[LegacySetting]) -> Tuple[List[str], Dict[str, str]]:
    """Overrides for a translated run: the explicit ones win over a legacy variable
    that sets the same key. Returns (overrides, {variable: applied overrides})."""
    taken = {override_key(o) for o in explicit}
    merged, applied = list(explicit), {}
    for setting in settings:
        fresh = [o for o in setting.overrides if override_key(o) not in taken]
        merged.extend(fresh)
        applied[setting.name] = " ".join(fresh) if fresh else "(overridden on the command line)"
    return merged, applied


def stop_message(settings: List[LegacySetting], explicit: Optional[List[str]] = None) -> str:
    lines = ["legacy DeepInfer environment variables are set; RedKnot takes its settings from the config only:"]
    width = max(len(f"{s.name}={s.value}") for s in settings)
    for s in settings:
        lines.append(f"  {f'{s.name}={s.value}':<{width}}  ->  {' '.join(s.overrides)}")
    overrides, _ = merge_overrides(list(explicit or []), settings)
    lines.append("equivalent command:")
    lines.append("  python -m redknot " + " ".join(shlex.quote(o) for o in overrides))
    lines.append("unset the variables, or add legacy_env=translate to apply them as overrides "
                 "(the translation is recorded in MLflow)")
    return "\n".join(lines)


class LegacyEnvError(ConfigError):
    """Raised when legacy variables are set and ``legacy_env=stop``."""

    def __init__(self, settings: List[LegacySetting], explicit: Optional[List[str]] = None):
        self.settings = settings
        ValueError.__init__(self, stop_message(settings, explicit))
        self.violations = [Violation(s.name, s.value, "legacy variable set") for s in settings]
