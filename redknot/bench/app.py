"""Mode bodies called by ``python -m redknot`` (see ``redknot.config.modes``).

``run``, ``prepare``, ``validate`` and ``generate`` take ``(ctx, tracker)``;
``catalog`` takes ``(ctx)``. Each returns the process exit code. ``prepare``,
``validate`` and ``catalog`` never import torch or the engine; ``run`` and
``generate`` reach the engine only through its public API (``LLM``,
``SamplingParams``, ``RequestOutput``).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console

from redknot.bench.casebuild import CaseError
from redknot.bench.datasets import DataError

INPUT_ERRORS = (DataError, CaseError, FileNotFoundError)


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 140)


def build_engine(cfg):
    """The engine from its ``_target_`` with the kernel set of ``hardware.kernels``."""
    from redknot.config.instantiate import build

    kernels = build(cfg.hardware.kernels, "hardware.kernels")
    return build(cfg.engine, "engine", model=cfg.model, hardware=cfg.hardware, features=cfg.features,
                 kernels=kernels)


def greedy_params(cfg):
    """``max_tokens → SamplingParams``: greedy decoding with the run's seed (LongBench decodes greedily)."""
    from redknot.engine import SamplingParams

    return lambda max_tokens: SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=cfg.seed)


def run(ctx, tracker) -> int:
    from redknot.bench.benchmark import BenchmarkRun, EngineStartError, RunSetup

    console = _console()
    try:
        return BenchmarkRun(ctx, tracker, RunSetup(build_engine, greedy_params), console).execute()
    except (*INPUT_ERRORS, EngineStartError) as err:
        console.print(f"error: {err}", style="red", markup=False)
        return 2


def prepare(ctx, tracker) -> int:
    from redknot.bench.freeze import freeze

    cfg, console = ctx.cfg, _console()
    try:
        result = freeze(cfg.suite, cfg.model, Path(cfg.output.cache_dir), console=console)
    except INPUT_ERRORS as err:
        console.print(f"[red]error: {err}[/red]")
        return 2
    inputs = result.inputs
    verb = "reused" if result.reused else "built"
    console.print(f"suite {cfg.suite.name}: {len(inputs.cases)} cases of {cfg.suite.context_tokens:,} tokens "
                  f"{verb} in {result.seconds:.1f} s; {result.disk_bytes / 2 ** 20:.1f} MiB at {inputs.directory}")
    tracker.set_tags({"bench.inputs_address": inputs.address, "bench.inputs_reused": str(result.reused).lower()})
    tracker.log_metrics({"prepare.seconds": result.seconds, "prepare.disk_bytes": result.disk_bytes,
                         "prepare.cases": len(inputs.cases)})
    tracker.log_artifact(inputs.directory / "manifest.json", "inputs")
    return 0


def _print_report(console: Console, report, what: str) -> None:
    for note in report.notes:
        console.print(f"note: {note}")
    if report.ok:
        console.print(f"[green]{what}: OK[/green] ({report.checked_cases} cases, {report.checked_records} records)")
        return
    console.print(f"[red]{what}: {len(report.differences)} difference(s)[/red]")
    for line in report.differences:
        console.print(f"  - {line}", markup=False)


def validate(ctx, tracker) -> int:
    from redknot.bench.freeze import make_builder
    from redknot.bench.frozen_inputs import InputStore, address_of, load_entry
    from redknot.bench.validate import ValidationReport, validate_inputs, validate_results

    cfg, console = ctx.cfg, _console()
    report = ValidationReport()
    try:
        if cfg.run_dir:
            run_dir = Path(cfg.run_dir)
            suite, model, inputs_dir = _run_dir_inputs(run_dir)
            inputs = load_entry(inputs_dir)
            report.extend(validate_inputs(make_builder(suite, model, Path(cfg.output.cache_dir)), inputs, console))
            report.extend(validate_results(run_dir, inputs))
            what = f"run {run_dir}"
        else:
            builder = make_builder(cfg.suite, cfg.model, Path(cfg.output.cache_dir))
            store = InputStore(Path(cfg.output.cache_dir))
            address = address_of(builder.key())
            if not store.exists(address):
                console.print(f"[red]no frozen inputs for suite {cfg.suite.name} at {store.path(address)}; "
                              f"run mode=prepare first[/red]")
                return 1
            report = validate_inputs(builder, store.load(address), console)
            what = f"inputs {address}"
    except INPUT_ERRORS as err:
        console.print(f"[red]error: {err}[/red]")
        return 2
    _print_report(console, report, what)
    tracker.log_metrics({"validate.differences": len(report.differences),
                         "validate.cases": report.checked_cases, "validate.records": report.checked_records})
    if report.differences:
        tracker.log_text("\n".join(report.differences) + "\n", "validate/differences.txt")
    return 0 if report.ok else 1


def _run_dir_inputs(run_dir: Path):
    """The suite, model and inputs directory a past run used (from its ``bench_run.json``)."""
    from redknot.bench.benchmark import RUN_META
    from redknot.bench.typed import from_dict
    from redknot.config.schema import ModelConfig, SuiteConfig

    meta_path = run_dir / RUN_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"run_dir={str(run_dir)!r}: no {RUN_META} there (not a benchmark run directory)")
    meta = json.loads(meta_path.read_text())
    return from_dict(SuiteConfig, meta["suite"]), from_dict(ModelConfig, meta["model"]), Path(meta["inputs_dir"])


def catalog(ctx) -> int:
    from redknot.bench.catalog import show_catalog
    from redknot.config.hardware_fit import CONF_DIR

    show_catalog(_console(), CONF_DIR, Path(ctx.cfg.output.cache_dir), dict(ctx.choices))
    return 0


def generate(ctx, tracker) -> int:
    """One prompt through the engine, wrapped in the suite's chat template; prints the completion and timing."""
    from redknot.bench import registry
    from redknot.bench.measure import request_timings
    from redknot.bench.tokenizer import load_tokenizer
    from redknot.engine import SamplingParams

    cfg, console = ctx.cfg, _console()
    if not cfg.prompt:
        console.print("[red]error: mode=generate needs prompt=\"...\"[/red]")
        return 2
    before, after = registry.chat_wrapper(cfg.suite.chat_template.value)
    ids = load_tokenizer(cfg.model).encode(before + cfg.prompt + after).tolist()
    params = SamplingParams(max_tokens=cfg.generate.max_tokens, temperature=cfg.generate.temperature,
                            seed=cfg.generate.seed)
    started = time.perf_counter()
    llm = build_engine(cfg)
    loaded = time.perf_counter() - started
    output = llm.generate([ids], params)[0]
    timings = request_timings(output.metrics)
    console.print(output.text, markup=False)
    console.print(f"[dim]{len(ids)} prompt tokens, {len(output.token_ids)} generated ({output.finish_reason}); "
                  f"TTFT {timings.ttft_s or 0:.3f} s, e2e {timings.e2e_s or 0:.3f} s, "
                  f"decode {timings.decode_tok_s or 0:.1f} tok/s; engine start {loaded:.1f} s[/dim]")
    tracker.log_text(output.text, "generate/completion.txt")
    tracker.log_metrics({k: v for k, v in {"generate.ttft_s": timings.ttft_s, "generate.e2e_s": timings.e2e_s,
                                           "generate.decode_tok_s": timings.decode_tok_s,
                                           "generate.output_tokens": len(output.token_ids)}.items()
                         if v is not None})
    return 0 if output.finish_reason in ("stop", "length") else 1
