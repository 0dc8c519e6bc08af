"""``report.md`` in every run directory, and the console's last lines.

Every tracked mode (run, prepare, validate, generate, compare) prints through one recording
console; when the mode ends, ``report.md`` gets the command, the config choices that matter,
what the console showed (tables included) and where the MLflow run is, and the console ends
with the run directory and the MLflow run id.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import List

from rich.console import Console

from redknot.config.schema import DraftMethod, DraftSampling, VerificationMode

REPORT_FILE = "report.md"


def make_console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140, record=True)


def key_choices(cfg) -> List[str]:
    """The config values a reader of a result needs first (the whole config is in .hydra/ and MLflow)."""
    f, s, sched = cfg.features, cfg.suite, cfg.engine.scheduler
    model = f"{cfg.model.name}" + (f" ({cfg.model.path})" if cfg.model.path else " (seeded synthetic weights)"
                                   if cfg.model.synthetic is not None else "")
    return [
        f"mode: {cfg.mode.value}",
        f"model: {model}",
        f"hardware: {cfg.hardware.name} ({cfg.hardware.accelerator.value}, {cfg.hardware.dtype.value}, "
        f"kernels {cfg.hardware.kernels.default})",
        f"suite: {s.name}: {s.context_tokens:,} tokens, {', '.join(s.datasets)} x {s.samples_per_dataset}"
        + (f" + {s.presentation_cases} presentation cases" if s.presentation_cases else "")
        + (f"; hot TTFT {s.warmup_repeats} warm-up + {s.measured_repeats} measured per case"
           if s.warmup_repeats or s.measured_repeats > 1 else "")
        + f"; admission {s.admission_batch_size}/rank",
        f"features: dspark {DraftMethod(f.dspark.method).value if f.dspark.enabled else 'none'} (max_draft "
        f"{f.dspark.max_draft}, {DraftSampling(f.dspark.draft_sampling).value} drafts, {VerificationMode(f.dspark.verification).value} verification, "
        f"adaptive {f.dspark.adaptive}), swa_replay {f.swa_replay.mode.value} (keep {f.swa_replay.keep_tokens}), async "
        f"{f.async_scheduling}, batch_invariant {f.batch_invariant.enabled}, deterministic {f.deterministic}, "
        f"parallel dp={f.parallel.dp} ep={f.parallel.ep} cp={f.parallel.cp}",
        f"engine: block_size {sched.block_size}, max_num_seqs {sched.max_num_seqs}, "
        f"max_num_batched_tokens {sched.max_num_batched_tokens}; seed {cfg.seed}",
    ]


def tracking_location(ctx, tracker) -> str:
    run_id = getattr(tracker, "run_id", None)
    if not ctx.cfg.tracking.enabled or run_id is None:
        return "MLflow: tracking disabled (tracking.enabled=false)"
    uri = getattr(tracker, "uri", "")
    line = f"MLflow run {run_id} (experiment {ctx.cfg.tracking.experiment}, store {uri})"
    if getattr(tracker, "degraded", False):
        line += " - INCOMPLETE: the store was unreachable for part of the run (see tracking_backlog.jsonl)"
    return line


def write_report(ctx, tracker, console: Console, code: int) -> Path:
    """Write ``report.md`` into the run directory (see the module docstring)."""
    run_dir = Path(ctx.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# RedKnot {ctx.cfg.mode.value}: {ctx.cfg.suite.name} on {ctx.cfg.hardware.name}", "",
             f"- finished: {time.strftime('%Y-%m-%d %H:%M:%S')} with exit code {code}",
             f"- command: `python -m redknot {' '.join(ctx.overrides)}`".rstrip(),
             f"- run directory: `{run_dir}`", f"- {tracking_location(ctx, tracker)}", "",
             "## Configuration that matters", ""]
    lines += [f"- {choice}" for choice in key_choices(ctx.cfg)]
    for key, note in sorted((getattr(ctx, "effective", None) or {}).items()):
        lines.append(f"- effective: {key} = {note}")
    lines += ["", "The full resolved config is in `.hydra/config.yaml` and in the MLflow run "
              "(`config/resolved.yaml`).", "", "## Console", "", "```",
              console.export_text(clear=False).rstrip(), "```", ""]
    path = run_dir / REPORT_FILE
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def finish(ctx, tracker, console: Console, code: int) -> int:
    """Write ``report.md`` and end the console with the run directory and the MLflow run."""
    try:
        path = write_report(ctx, tracker, console, code)
    except OSError as err:
        console.print(f"could not write {REPORT_FILE} into {ctx.run_dir}: {err}", style="red", markup=False)
        path = None
    # Never wrapped: scripts take the run directory and the run id from the last two lines.
    console.print(f"run directory: {ctx.run_dir}" + (f" (report: {path.name})" if path else ""), markup=False,
                  soft_wrap=True)
    console.print(tracking_location(ctx, tracker), markup=False, soft_wrap=True)
    return code
