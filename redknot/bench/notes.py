"""What the numbers of a run mean: notes printed under the summary and written into ``report.md``."""
from __future__ import annotations

from typing import List, Optional

from redknot.bench.report import plots_with_information


def run_notes(ctx, results: dict, records: Optional[List[dict]] = None) -> List[str]:
    """Plain-language caveats for this run's numbers (empty when there is nothing to say)."""
    cfg = ctx.cfg
    notes = []
    if cfg.model.synthetic is not None and not cfg.model.path:
        notes.append(f"model={cfg.model.name} has seeded random weights: its answers are noise and scores near 0 "
                     f"are expected; this run checks the harness and the engine path, not a model's quality")
    accel = getattr(cfg.hardware.accelerator, "value", cfg.hardware.accelerator)
    if accel == "cpu":
        notes.append("hardware=cpu: times are those of the PyTorch reference path on this CPU; TTFT is taken from "
                     "the engine's clock (arrival to first token)")
    if results.get("presentation"):
        notes.append(f"accuracy covers the short-answer cases only; the {len(results['presentation'])} presentation "
                     f"cases (long answers) are shown, not scored into it")
    for key, note in sorted((getattr(ctx, "effective", None) or {}).items()):
        notes.append(f"{key} is effectively {note}")
    changes = getattr(ctx, "suite_changes", None) or {}
    if changes:
        from redknot.config.effective import describe_changes

        base = ctx.choices.get("suite", "?") if getattr(ctx, "choices", None) else "?"
        notes.append(f"suite {cfg.suite.name} is suite={base} with {describe_changes(changes)}")
    for name, why in plots_with_information(records or [], results).items():
        notes.append(f"no {name}: {why}")
    return notes
