"""Cross-field and range rules of the run config (run by :func:`redknot.config.violations.validate`).

Each rule is a function ``RedKnotConfig -> list[Violation]``; :data:`RULES` lists
them in the order their messages are reported. Rules are pure: no filesystem, no
device, no imports of the engine.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, List, Optional, Tuple

from redknot.config.schema import Accelerator, BudgetSource, DraftMethod, Mode, RedKnotConfig, SwaReplayMode
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
    ("features.dspark.budget_tokens", _at_least(0)),
    ("features.swa_replay.keep_tokens", _at_least(1)),
    ("features.parallel.eplb.num_redundant_experts", _at_least(0)),
    ("features.parallel.eplb.rebalance_interval", _at_least(1)),
    ("suite.context_tokens", _at_least(1)),
    ("suite.samples_per_dataset", _at_least(1)),
    ("suite.admission_batch_size", _at_least(1)),
    ("suite.default_max_new_tokens", _optional_at_least(1)),
    ("suite.presentation_cases", _at_least(0)),
    ("suite.presentation_max_new_tokens", _at_least(1)),
    ("suite.warmup_requests", _at_least(0)),
    ("suite.warmup_repeats", _at_least(0)),
    ("suite.measured_repeats", _at_least(1)),
    ("suite.request_timeout_s", (lambda v: v > 0, "must be > 0")),
    ("engine.scheduler.max_num_seqs", _at_least(1)),
    ("engine.scheduler.max_num_batched_tokens", _at_least(1)),
    ("engine.scheduler.long_prefill_chunk", _at_least(1)),
    ("engine.scheduler.block_size", _at_least(1)),
    ("engine.scheduler.num_cache_blocks", _optional_at_least(1)),
    ("generate.max_tokens", _at_least(1)),
    ("generate.temperature", _at_least(0.0)),
    ("tracking.request_timeout_s", _at_least(1)),
    ("tracking.max_retries", _at_least(0)),
    ("tracking.flush_timeout_s", _at_least(0.0)),
    ("compare.max_accuracy_drop", _at_least(0.0)),
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
    from redknot.bench import registry  # the dataset table (pure data)

    suite, found = cfg.suite, []
    if not suite.datasets:
        found.append(Violation("suite.datasets", suite.datasets, "must name at least one dataset"))
    duplicates = sorted({d for d in suite.datasets if suite.datasets.count(d) > 1})
    if duplicates:
        found.append(Violation("suite.datasets", suite.datasets, f"lists {duplicates} more than once"))
    known = ", ".join(sorted(registry.DATASETS))
    unknown = [d for d in suite.datasets if registry.canonical_name(d) not in registry.DATASETS]
    if unknown:
        found.append(Violation("suite.datasets", suite.datasets, f"unknown datasets {unknown}; known: {known}"))
    # Entries for datasets the suite does not run are allowed (suite.datasets=[...] is one override);
    # an entry naming no dataset at all is a misspelling that would otherwise be ignored.
    misspelt = sorted(k for k in suite.max_new_tokens if registry.canonical_name(k) not in registry.DATASETS)
    if misspelt:
        found.append(Violation("suite.max_new_tokens", suite.max_new_tokens,
                               f"has entries {misspelt} that name no dataset; known: {known}"))
    for name, tokens in suite.max_new_tokens.items():
        if tokens < 1:
            found.append(Violation(f"suite.max_new_tokens.{name}", tokens, "must be >= 1"))
    return found


def largest_max_new(suite) -> int:
    """The longest generation any case of ``suite`` asks for (short-answer and presentation cases)."""
    from redknot.bench import registry

    lengths = [registry.max_new_tokens(d, dict(suite.max_new_tokens), suite.default_max_new_tokens)
               for d in suite.datasets if registry.canonical_name(d) in registry.DATASETS]
    if suite.presentation_cases > 0:
        lengths.append(suite.presentation_max_new_tokens)
    return max(lengths, default=1)


def suite_fits_model(cfg: RedKnotConfig) -> List[Violation]:
    suite = cfg.suite
    max_new = largest_max_new(suite)
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
    if features.dspark.enabled and features.dspark.adaptive:
        found.append(Violation(
            "features.dspark.adaptive", True,
            "features.deterministic=true needs features.dspark.adaptive=false (the verify budget comes from "
            "timings, and a request's verify length from the rest of the batch)"))
    return found


# The largest draft block any supported checkpoint trains (DSpark dspark_block_size); the engine checks
# max_draft against the loaded checkpoint's own block size at start.
MAX_TRAINED_BLOCK = 5


def dspark_options(cfg: RedKnotConfig) -> List[Violation]:
    """``features.dspark``: the verify cap, staleness and the budget source's inputs."""
    d, found = cfg.features.dspark, []
    if d.max_draft > MAX_TRAINED_BLOCK and DraftMethod(d.method) != DraftMethod.none:
        found.append(Violation(
            "features.dspark.max_draft", d.max_draft,
            f"must be <= {MAX_TRAINED_BLOCK}, the draft block size the DSpark checkpoints are trained with "
            f"(drafting always runs the trained block; max_draft only caps how many drafts are verified)"))
    if d.staleness not in (1, 2):
        found.append(Violation("features.dspark.staleness", d.staleness,
                               "must be 1 (budget from last step's confidences) or 2 (two steps old)"))
    if not (d.enabled and d.adaptive):
        return found
    budget = BudgetSource(d.budget)
    if budget == BudgetSource.file and not d.budget_file:
        found.append(Violation("features.dspark.budget_file", d.budget_file,
                               "features.dspark.budget=file needs features.dspark.budget_file=/path/to/costs.json"))
    if budget == BudgetSource.fixed and d.budget_tokens < 1:
        found.append(Violation("features.dspark.budget_tokens", d.budget_tokens,
                               "features.dspark.budget=fixed needs features.dspark.budget_tokens >= 1 "
                               "(drafts verified per step over the whole batch)"))
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
    off = DraftMethod(dspark.method) == DraftMethod.none
    draft = "(0: features.dspark.method=none)" if off else f"({max_draft})"
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
    if hw.side_stream_max_tokens < 0:
        found.append(Violation("hardware.side_stream_max_tokens", hw.side_stream_max_tokens,
                               "must be >= 0 (0 keeps one stream)"))
    if hw.side_stream_max_tokens > 0 and hw.accelerator != Accelerator.cuda:
        found.append(Violation("hardware.side_stream_max_tokens", hw.side_stream_max_tokens,
                               f"a side stream needs hardware.accelerator=cuda (is {hw.accelerator.value}); use 0"))
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
    if cfg.mode == Mode.compare:
        arms = cfg.compare
        if list(arms.baseline) == list(arms.candidate):
            return [Violation("compare.candidate", arms.candidate,
                              f"must differ from compare.baseline ({arms.baseline}): mode=compare runs two "
                              f"configs, e.g. compare.baseline=[features.swa_replay.mode=off] "
                              f"compare.candidate=[features.swa_replay.mode=compact]")]
        if arms.baseline_name == arms.candidate_name:
            return [Violation("compare.candidate_name", arms.candidate_name, "must differ from compare.baseline_name")]
    return []


# Compression ratios of the released V4 checkpoints (CSA 4, HCA 128); a synthetic architecture may set its own.
FAMILY_COMPRESS_RATIOS = {"deepseek_v4": (4, 128)}


def compress_ratios(cfg: RedKnotConfig) -> Tuple[int, ...]:
    arch = cfg.model.synthetic.architecture if cfg.model.synthetic is not None else {}
    ratios = arch.get("compress_ratios")
    if isinstance(ratios, (list, tuple)):
        return tuple(sorted({int(r) for r in ratios if int(r) > 0}))
    return FAMILY_COMPRESS_RATIOS.get(cfg.model.family, ())


def scheduler_budget(cfg: RedKnotConfig) -> List[Violation]:
    sched, found = cfg.engine.scheduler, []
    if sched.long_prefill_chunk > sched.max_num_batched_tokens:
        found.append(Violation(
            "engine.scheduler.long_prefill_chunk", sched.long_prefill_chunk,
            f"must be <= engine.scheduler.max_num_batched_tokens ({sched.max_num_batched_tokens})"))
    ratios = compress_ratios(cfg)
    if sched.block_size >= 1 and any(sched.block_size % r for r in ratios):
        step = math.lcm(*ratios)
        found.append(Violation(
            "engine.scheduler.block_size", sched.block_size,
            f"must be a multiple of every compress ratio {list(ratios)} of model={cfg.model.name} "
            f"(e.g. {max(step, sched.block_size // step * step)} or {(sched.block_size // step + 1) * step})"))
    return found


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
    ranges, suite_lists, suite_fits_model, deterministic, dspark_options, batch_invariant_supported,
    swa_replay_window, kernel_backends, hardware_facts, model_source, mode_inputs,
    scheduler_budget, parallel_features, targets,
]
