"""``mode=catalog``: suites, datasets, model families, models and hardware targets, and what this machine has.

Reads only YAML options, the dataset and model-family registries and the
manifests already in the input cache; it imports neither torch nor the engine
(the device probe asks ``nvidia-smi`` / ``npu-smi``).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from redknot.bench import registry
from redknot.bench.frozen_inputs import MANIFEST
from redknot.bench.typed import load_yaml_option
from redknot.config.schema import Accelerator, HardwareConfig, ModelConfig, SuiteConfig
from redknot.models.registry import list_families


def probe_device():
    """This machine's accelerator without torch: ``nvidia-smi`` for CUDA (name, CC), ``npu-smi`` for Ascend."""
    from redknot.config.hardware_fit import DeviceFacts

    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
                                 check=True).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            name, cc, driver = (part.strip() for part in out[0].split(","))
            return DeviceFacts(Accelerator.cuda, len(out), name, cc, driver)
    if shutil.which("npu-smi"):
        return DeviceFacts(Accelerator.npu, 1, "Ascend NPU")
    return DeviceFacts(Accelerator.cpu, 0, "no accelerator")


def _options(conf_dir: Path, group: str, cls) -> Dict[str, object]:
    return {path.stem: load_yaml_option(path, cls) for path in sorted((conf_dir / group).glob("*.yaml"))}


def prepared_manifests(cache_dir: Path) -> List[dict]:
    """Headers (and case counts) of the frozen inputs in the cache, newest first."""
    headers = []
    for path in sorted((Path(cache_dir) / "inputs").glob(f"*/{MANIFEST}"), key=lambda p: -p.stat().st_mtime):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        data.pop("cases", None)
        headers.append(data)
    return headers


def suites_table(suites: Dict[str, SuiteConfig], prepared: List[dict], selected: Optional[str]) -> Table:
    table = Table(title="suites (suite=NAME)")
    for column in ("suite", "target tokens", "datasets", "cases", "admission", "template", "prepared inputs"):
        table.add_column(column, overflow="fold")
    for name, suite in suites.items():
        per = suite.samples_per_dataset
        cases = f"{per} x {len(suite.datasets)} = {per * len(suite.datasets)}" if per > 0 else "all rows"
        if suite.presentation_cases:
            cases += f" + {suite.presentation_cases} presentation"
        if suite.warmup_repeats or suite.measured_repeats > 1:
            cases += f"; hot TTFT {suite.warmup_repeats}+{suite.measured_repeats}"
        ready = [f"{h['address']} ({h['num_cases']} cases)" for h in prepared if h.get("suite") == suite.name]
        mark = "*" if name == selected else " "
        table.add_row(f"{mark} {name}", f"{suite.context_tokens:,} ({suite.context_tokens // 1024}K)",
                      ", ".join(suite.datasets), cases, f"{suite.admission_batch_size}/rank",
                      suite.chat_template.value, "\n".join(ready) or "-")
    return table


def _dataset_stats(prepared: List[dict]) -> Dict[str, str]:
    stats: Dict[str, str] = {}
    for header in prepared:
        for name, info in header.get("datasets", {}).items():
            if name in stats:
                continue
            tokens = info.get("gold_tokens", {})
            stats[name] = (f"{info.get('source_rows', '?')} rows; gold context tokens mean {tokens.get('mean', 0):,.0f}"
                           f" (min {tokens.get('min', 0):,}, max {tokens.get('max', 0):,}); "
                           f"{info.get('truncated', 0)} truncated at {header.get('target_tokens'):,}")
    return stats


def datasets_table(prepared: List[dict], suites: Dict[str, SuiteConfig]) -> Table:
    table = Table(title="datasets (suite.datasets=[...])")
    for column in ("dataset", "kind", "metric", "max_new", "in suites", "rows / tokens (when prepared)",
                   "known weakness"):
        table.add_column(column, overflow="fold")
    stats = _dataset_stats(prepared)
    for name, spec in registry.DATASETS.items():
        used = [s for s, cfg in suites.items() if name in [registry.canonical_name(d) for d in cfg.datasets]]
        table.add_row(name, spec.kind, spec.metric + (" (first line)" if spec.first_line_only else ""),
                      str(spec.max_new), ", ".join(used) or "-", stats.get(name, "-"), escape(spec.weakness or "-"))
    return table


def families_table(models: Dict[str, ModelConfig]) -> Table:
    """Every registered model family and the checkpoints it loads (by their config.json)."""
    table = Table(title="model families (model.family=NAME; a checkpoint's config.json must declare one of its "
                        "architectures / model_type)")
    for column in ("family", "architectures", "model_type", "model options", "description"):
        table.add_column(column, overflow="fold")
    for entry in list_families():
        used = [name for name, model in models.items() if model.family == entry.name]
        table.add_row(entry.name, ", ".join(entry.architectures), ", ".join(entry.model_types), ", ".join(used) or "-",
                      escape(entry.description))
    return table


def models_table(models: Dict[str, ModelConfig], selected: Optional[str]) -> Table:
    table = Table(title="models (model=NAME)")
    for column in ("model", "family", "support", "max positions", "checkpoint", "description"):
        table.add_column(column, overflow="fold")
    for name, model in models.items():
        source = model.path or ("synthetic (seeded weights)" if model.synthetic else "set model.path")
        table.add_row(("*" if name == selected else " ") + f" {name}", model.family, model.support.value,
                      f"{model.max_position:,}", source, escape(model.description))
    return table


def hardware_table(options: Dict[str, HardwareConfig], facts, selected: Optional[str]) -> Table:
    from redknot.config.hardware_fit import fits

    found = f"{facts.accelerator.value} ({facts.name}" + (
        f", {facts.count} x CC {facts.compute_capability}" if facts.compute_capability else "") + ")"
    table = Table(title=f"hardware targets (hardware=NAME); this machine: {found}")
    for column in ("hardware", "support", "accelerator", "compute capability", "kernels", "runs here"):
        table.add_column(column, overflow="fold")
    for name, hw in options.items():
        kernels = hw.kernels.default + (f" (+{len(hw.kernels.ops)} ops overridden)" if hw.kernels.ops else "")
        table.add_row(("*" if name == selected else " ") + f" {name}", hw.support.value, hw.accelerator.value,
                      ", ".join(hw.compute_capability) or "any", kernels, "yes" if fits(hw, facts) else "no")
    return table


def memory_plan_lines(cfg, facts) -> List[str]:
    """The selected model's per-device memory plan for the configured parallel layout (from its
    family; a device this machine has, else the hardware option's device names)."""
    from redknot.models.registry import load_family

    device = facts.name if facts.accelerator == Accelerator.cuda else None
    par = cfg.features.parallel
    placement = getattr(par.engram_placement, "value", par.engram_placement)
    head = (f"memory plan: model={cfg.model.name}, hardware={cfg.hardware.name}, features.parallel "
            f"dp={par.dp} ep={par.ep} engram_placement={placement}")
    try:
        plans = load_family(cfg.model.family).memory_plans(cfg.model, cfg.hardware, cfg.features, device)
    except (ValueError, OSError) as err:
        return [head, f"  (no plan: {err})"]
    if not plans:
        return []
    lines = [head]
    for plan in plans:
        lines += [f"  {line}" for line in plan.describe()]
        lines.append(f"  -> {'fits' if plan.fits else 'DOES NOT FIT: the engine refuses this layout at start'}")
    return lines


def show_catalog(console: Console, conf_dir: Path, cache_dir: Path, choices: Dict[str, str], cfg=None) -> None:
    suites = _options(conf_dir, "suite", SuiteConfig)
    prepared = prepared_manifests(cache_dir)
    console.print(suites_table(suites, prepared, choices.get("suite")))
    console.print(datasets_table(prepared, suites))
    models = _options(conf_dir, "model", ModelConfig)
    console.print(families_table(models))
    console.print(models_table(models, choices.get("model")))
    facts = probe_device()
    console.print(hardware_table(_options(conf_dir, "hardware", HardwareConfig), facts, choices.get("hardware")))
    if cfg is not None:
        for line in memory_plan_lines(cfg, facts):
            console.print(escape(line))
