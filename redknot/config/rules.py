"""Cross-field and range rules of the run config (run by :func:`redknot.config.violations.validate`).

Each rule is a function ``RedKnotConfig -> list[Violation]``; :data:`RULES` lists
them in the order their messages are reported. Rules are pure: no filesystem, no
device, no imports of the engine.
"""
from __future__ import annotations

import re
from typing import Any, Callable, List, Optional, Tuple

from redknot.config.schema import Accelerator, Mode, RedKnotConfig, SwaReplayMode
from redknot.config.violations import Violation
from redknot.kernels.registry import BACKENDS
from redknot.models.registry import list_families

Rule = Callable[[RedKnotConfig], List[Violation]]

# The parts a run builds from `_target_`, and the targets RedKnot ships for each.
KNOWN_TARGETS = {
    "hardware.kernels": ("redknot.kernels.KernelSet",),
    "engine": ("redknot.engine.build_engine",),
    "tracking": ("redknot.tracking.MlflowTracker", "redknot.tracking.NullTracker"),
}
TARGET_PACKAGE = "redknot."


def get(cfg: Any, key: str) -> Any:
    """``get(cfg, "features.dspark.max_draft")``."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _at_least(low: float) -> Tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f"must be >= {low}"


def _optional_at_least(low: int) -> Tuple[Callable[[Any], bool], str]:
    return (lambda v: v is None or v >= low), f"must be null or >= {low}"


def _between(low: float, high: float, open_low: bool = False) -> Tuple[Callable[[Any], bool], str]:
    if open_low:
        return (lambda v: low < v <= high), f"must be in ({low}, {high}]"
    return (lambda v: low <= v <= high), f"must be in [{low}, {high}]"


RANGES: List[Tuple[str, Tuple[Callable[[Any], bool], str]]] = [
    ("model.max_position", _at_least(1)),
    ("model.sliding_window", _at_least(1)),
    ("model.num_layers", _optional_at_least(1)),
    ("hardware.memory_utilization", _between(0.0, 1.0, open_low=True)),
    ("features.dspark.max_draft", _at_least(0)),
    ("features.dspark.confidence_threshold", _between(0.0, 1.0)),
    ("features.swa_replay.keep_tokens", _at_least(1)),
    ("features.parallel.eplb.num_redundant_experts", _at_least(0)),
    ("features.parallel.eplb.rebalance_interval", _at_least(1)),
    ("suite.context_tokens", _at_least(1)),
    ("suite.samples_per_dataset", _at_least(1)),
    ("suite.admission_batch_size", _at_least(1)),
    ("suite.default_max_new_tokens", _at_least(1)),
    ("suite.warmup_requests", _at_least(0)),
    ("suite.request_timeout_s", (lambda v: v > 0, "must be > 0")),
    ("engine.scheduler.max_num_seqs", _at_least(1)),
    ("engine.scheduler.max_num_batched_tokens", _at_least(1)),
    ("engine.scheduler.long_prefill_chunk", _at_least(1)),
    ("engine.scheduler.block_size", _at_least(1)),
    ("engine.scheduler.num_cache_blocks", _optional_at_least(1)),
    ("generate.max_tokens", _at_least(1)),
    ("generate.temperature", _at_least(0.0)),
]


def ranges(cfg: RedKnotConfig) -> List[Violation]:
    found = []
    for key, (ok, rule) in RANGES:
        value = get(cfg, key)
        if not ok(value):
            found.append(Violation(key, value, rule))
    for name in ("dp", "ep", "cp"):
        size = get(cfg, f"features.parallel.{name}")
        if size < 1:
            found.append(Violation(f"features.parallel.{name}", size, "parallel sizes must be positive"))
    return found


def suite_lists(cfg: RedKnotConfig) -> List[Violation]:
    suite, found = cfg.suite, []
    if not suite.datasets:
        found.append(Violation("suite.datasets", suite.datasets, "must name at least one dataset"))
    duplicates = sorted({d for d in suite.datasets if suite.datasets.count(d) > 1})
    if duplicates:
        found.append(Violation("suite.datasets", suite.datasets, f"lists {duplicates} more than once"))
    extra = sorted(set(suite.max_new_tokens) - set(suite.datasets))
    if extra:
        found.append(Violation(
            "suite.max_new_tokens", suite.max_new_tokens,
            f"has entries {extra} for datasets not in suite.datasets {suite.datasets} (a misspelt name "
            f"would silently fall back to suite.default_max_new_tokens)"))
    for name, tokens in suite.max_new_tokens.items():
        if tokens < 1:
            found.append(Violation(f"suite.max_new_tokens.{name}", tokens, "must be >= 1"))
    return found


def suite_fits_model(cfg: RedKnotConfig) -> List[Violation]:
    suite = cfg.suite
    per_dataset = [suite.max_new_tokens.get(d, suite.default_max_new_tokens) for d in suite.datasets]
    max_new = max(per_dataset, default=suite.default_max_new_tokens)
    total = suite.context_tokens + max_new
    if total <= cfg.model.max_position:
        return []
    return [Violation(
        "suite.context_tokens", suite.context_tokens,
        f"suite.context_tokens ({suite.context_tokens}) + the largest max_new_tokens ({max_new}) = {total} "
        f"must be <= model.max_position ({cfg.model.max_position}) of model={cfg.model.name}")]


def deterministic(cfg: RedKnotConfig) -> List[Violation]:
    features, found = cfg.features, []
    if not features.deterministic:
        return found
    if not features.batch_invariant.enabled:
        found.append(Violation(
            "features.batch_invariant.enabled", False,
            "features.deterministic=true needs features.batch_invariant.enabled=true"))
    if features.dspark.enabled and features.dspark.varlen:
        found.append(Violation(
            "features.dspark.varlen", True,
            "features.deterministic=true needs features.dspark.varlen=false (a request's verify length "
            "would depend on the rest of the batch)"))
    return found


def batch_invariant_supported(cfg: RedKnotConfig) -> List[Violation]:
    if cfg.features.batch_invariant.enabled and not cfg.hardware.supports_batch_invariant:
        return [Violation(
            "features.batch_invariant.enabled", True,
            f"hardware={cfg.hardware.name} has no batch-invariant kernels "
            f"(hardware.supports_batch_invariant=false); use hardware=cpu, sm90-port or sm100")]
    return []


def swa_replay_window(cfg: RedKnotConfig) -> List[Violation]:
    replay, dspark = cfg.features.swa_replay, cfg.features.dspark
    if replay.mode != SwaReplayMode.compact:
        return []
    # The kept tail must cover the window after a rollback of a whole draft block;
    # with drafting off nothing is rolled back and the window plus one suffices.
    max_draft = dspark.effective_max_draft
    need = cfg.model.sliding_window + max_draft + 1
    if replay.keep_tokens >= need:
        return []
    draft = f"({max_draft})" if dspark.enabled else "(0: features.dspark.enabled=false)"
    return [Violation(
        "features.swa_replay.keep_tokens", replay.keep_tokens,
        f"must be >= model.sliding_window ({cfg.model.sliding_window}) + features.dspark.max_draft "
        f"{draft} + 1 = {need} when features.swa_replay.mode=compact")]


def kernel_backends(cfg: RedKnotConfig) -> List[Violation]:
    hw, found = cfg.hardware, []
    chosen = [("hardware.kernels.default", hw.kernels.default)]
    chosen += [(f"hardware.kernels.ops.{op}", b) for op, b in sorted(hw.kernels.ops.items())]
    for key, backend in chosen:
        if backend not in BACKENDS:
            found.append(Violation(key, backend, f"unknown kernel backend; known: {sorted(BACKENDS)}"))
            continue
        needs = BACKENDS[backend].accelerator
        if needs is not None and needs != hw.accelerator:
            found.append(Violation(
                key, backend,
                f"backend {backend!r} runs on accelerator {needs.value}, not on "
                f"hardware.accelerator={hw.accelerator.value}"))
    return found


_CC = re.compile(r"^\d+\.\d*$")


def hardware_facts(cfg: RedKnotConfig) -> List[Violation]:
    hw, found = cfg.hardware, []
    for cc in hw.compute_capability:
        if not _CC.match(cc):
            found.append(Violation("hardware.compute_capability", hw.compute_capability,
                                   f"entry {cc!r} must look like '9.0' or '10.' (a major.minor prefix)"))
    if hw.compute_capability and hw.accelerator != Accelerator.cuda:
        found.append(Violation("hardware.compute_capability", hw.compute_capability,
                               "compute capabilities apply to hardware.accelerator=cuda only"))
    if hw.cuda_graph_max_len < 1:
        found.append(Violation("hardware.cuda_graph_max_len", hw.cuda_graph_max_len, "must be >= 1"))
    if hw.cuda_graphs and hw.accelerator != Accelerator.cuda:
        found.append(Violation("hardware.cuda_graphs", True,
                               f"needs hardware.accelerator=cuda (is {hw.accelerator.value})"))
    return found


def model_source(cfg: RedKnotConfig) -> List[Violation]:
    model, found = cfg.model, []
    families = [entry.name for entry in list_families()]
    if model.family not in families:
        found.append(Violation("model.family", model.family, f"must be a registered model family: {families}"))
    if model.synthetic is None and model.path is None and cfg.mode in (Mode.run, Mode.generate):
        found.append(Violation(
            "model.path", None,
            f"model={model.name} has no synthetic weights: mode={cfg.mode.value} needs model.path=/path/to/"
            f"checkpoint (mode=prepare, catalog and validate work without it)"))
    arch = model.synthetic.architecture if model.synthetic is not None else {}
    for arch_key, key in (("sliding_window", "model.sliding_window"),
                          ("max_position_embeddings", "model.max_position")):
        value = get(cfg, key)
        if arch_key in arch and arch[arch_key] != value:
            found.append(Violation(
                key, value, f"must equal model.synthetic.architecture.{arch_key} ({arch[arch_key]})"))
    return found


def mode_inputs(cfg: RedKnotConfig) -> List[Violation]:
    if cfg.mode == Mode.generate and not cfg.prompt:
        return [Violation("prompt", cfg.prompt, 'mode=generate needs prompt="..."')]
    return []


def scheduler_budget(cfg: RedKnotConfig) -> List[Violation]:
    sched = cfg.engine.scheduler
    if sched.long_prefill_chunk > sched.max_num_batched_tokens:
        return [Violation(
            "engine.scheduler.long_prefill_chunk", sched.long_prefill_chunk,
            f"must be <= engine.scheduler.max_num_batched_tokens ({sched.max_num_batched_tokens})")]
    return []


def parallel_features(cfg: RedKnotConfig) -> List[Violation]:
    par, found = cfg.features.parallel, []
    if par.cp > 1 and cfg.features.swa_replay.mode == SwaReplayMode.compact:
        # Context parallel splits a prompt across ranks in zigzag chunks; the compact tail of the
        # window-only layers would have to live on one rank.
        found.append(Violation(
            "features.swa_replay.mode", "compact",
            f"not supported with features.parallel.cp={par.cp}; set features.swa_replay.mode=off"))
    if par.eplb.enabled and par.ep == 1:
        found.append(Violation(
            "features.parallel.eplb.enabled", True,
            "expert load balancing needs experts spread over ranks: set features.parallel.ep > 1"))
    return found


def target_of(cfg: RedKnotConfig, key: str) -> Optional[str]:
    return get(cfg, key)._target_


def targets(cfg: RedKnotConfig) -> List[Violation]:
    found = []
    for key, known in KNOWN_TARGETS.items():
        target = target_of(cfg, key)
        if not target.startswith(TARGET_PACKAGE):
            found.append(Violation(
                f"{key}._target_", target,
                f"targets must be inside the redknot package; known targets for {key}: {list(known)}"))
    if not cfg.tracking.experiment:
        found.append(Violation("tracking.experiment", cfg.tracking.experiment, "must not be empty"))
    return found


RULES: List[Rule] = [
    ranges, suite_lists, suite_fits_model, deterministic, batch_invariant_supported,
    swa_replay_window, kernel_backends, hardware_facts, model_source, mode_inputs,
    scheduler_budget, parallel_features, targets,
]
