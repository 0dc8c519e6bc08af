"""Mode bodies called by ``python -m redknot`` (see ``redknot.config.modes``).

``run``, ``prepare``, ``validate``, ``generate`` and ``compare`` take ``(ctx, tracker)``;
``catalog`` takes ``(ctx)``. Each returns the process exit code (2: bad input, such as
damaged frozen inputs, a prompt the model cannot take or an engine that cannot start with
this config; 1: the work did not complete). Each tracked body ends with ``report.md`` in its
run directory and the run directory and MLflow run id as the console's last lines.
``prepare``, ``validate`` and ``catalog`` never import torch or the engine; ``run``,
``generate`` and ``compare`` reach the engine only through its public API (``LLM``,
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
from redknot.bench.runlog import finish, make_console

INPUT_ERRORS = (DataError, CaseError, FileNotFoundError)


def _console() -> Console:
    return make_console()


def build_engine(cfg):
    """The engine from its ``_target_`` with the kernel set of ``hardware.kernels``. The device is
    checked first: on the wrong machine the message names the device found and the hardware option
    that fits (not a kernel package to install)."""
    from redknot.config.hardware_fit import check_device
    from redknot.config.instantiate import build

    check_device(cfg.hardware)
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
        code = BenchmarkRun(ctx, tracker, RunSetup(build_engine, greedy_params), console).execute()
    except (*INPUT_ERRORS, EngineStartError) as err:
        console.print(f"error: {err}", style="red", markup=False)
        code = 2
    return finish(ctx, tracker, console, code)


def compare(ctx, tracker) -> int:
    from redknot.bench.benchmark import EngineStartError, RunSetup
    from redknot.bench.compare import Comparison

    console = _console()
    try:
        code = Comparison(ctx, tracker, RunSetup(build_engine, greedy_params), console).execute()
    except (*INPUT_ERRORS, EngineStartError) as err:
        console.print(f"error: {err}", style="red", markup=False)
        code = 2
    return finish(ctx, tracker, console, code)


def prepare(ctx, tracker) -> int:
    console = _console()
    try:
        code = _prepare(ctx, tracker, console)
    except INPUT_ERRORS as err:
        console.print(f"error: {err}", style="red", markup=False)
        code = 2
    return finish(ctx, tracker, console, code)


def _prepare(ctx, tracker, console: Console) -> int:
    from redknot.bench.freeze import freeze

    cfg = ctx.cfg
    result = freeze(cfg.suite, cfg.model, Path(cfg.output.cache_dir), console=console)
    inputs = result.inputs
    verb = "rebuilt (the stored copy was damaged)" if result.repaired else "reused" if result.reused else "built"
    console.print(f"suite {cfg.suite.name}: {len(inputs.cases)} cases of {cfg.suite.context_tokens:,} tokens "
                  f"{verb} in {result.seconds:.1f} s; {result.disk_bytes / 2 ** 20:.1f} MiB at {inputs.directory}")
    if cfg.suite.release:
        from redknot.bench.release import write_release

        path = write_release(Path(cfg.output.cache_dir), cfg.suite, inputs)
        console.print(f"release suite {cfg.suite.name}: order, SHA-256 of every file and the execution contract "
                      f"pinned in {path}")
        tracker.log_artifact(path, "inputs")
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
    console = _console()
    return finish(ctx, tracker, console, _validate(ctx, tracker, console))


def _validate(ctx, tracker, console: Console) -> int:
    from redknot.bench.freeze import make_builder
    from redknot.bench.frozen_inputs import InputStore, address_of, load_entry
    from redknot.bench.integrity import InputsError
    from redknot.bench.validate import ValidationReport, validate_inputs, validate_results

    cfg = ctx.cfg
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
            if cfg.suite.release:
                report.extend(_release_report(cfg, store.load(address)))
    except InputsError as err:  # the frozen inputs themselves are damaged: that is the finding
        console.print(f"inputs: 1 difference(s)\n  - {err}", style="red", markup=False)
        return 1
    except INPUT_ERRORS as err:
        console.print(f"error: {err}", style="red", markup=False)
        return 2
    _print_report(console, report, what)
    tracker.log_metrics({"validate.differences": len(report.differences),
                         "validate.cases": report.checked_cases, "validate.records": report.checked_records})
    if report.differences:
        tracker.log_text("\n".join(report.differences) + "\n", "validate/differences.txt")
    return 0 if report.ok else 1


def _release_report(cfg, inputs):
    from redknot.bench.release import manifest_path, release_problems
    from redknot.bench.validate import ValidationReport

    report = ValidationReport()
    if manifest_path(Path(cfg.output.cache_dir)).is_file():
        report.differences += release_problems(Path(cfg.output.cache_dir), cfg.suite, inputs)
    else:
        report.notes.append(f"no {manifest_path(Path(cfg.output.cache_dir))} yet (mode=prepare writes it)")
    return report


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

    show_catalog(_console(), CONF_DIR, Path(ctx.cfg.output.cache_dir), dict(ctx.choices), cfg=ctx.cfg)
    return 0


class GenerateInputError(ValueError):
    """A prompt the model cannot take (not UTF-8, too long, token ids outside its vocabulary)."""


def _prompt_ids(cfg) -> list:
    from redknot.bench import registry
    from redknot.bench.tokenizer import load_tokenizer

    before, after = registry.chat_wrapper(cfg.suite.chat_template.value)
    text = before + cfg.prompt + after
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise GenerateInputError(f"prompt is not valid UTF-8 text (undecodable byte at character "
                                 f"{err.start - len(before)}); pass text in UTF-8") from None
    ids = load_tokenizer(cfg.model).encode(text).tolist()
    limit = cfg.model.max_position
    if len(ids) + cfg.generate.max_tokens > limit:
        raise GenerateInputError(f"prompt: {len(ids)} tokens (chat template included) + generate.max_tokens="
                                 f"{cfg.generate.max_tokens} = {len(ids) + cfg.generate.max_tokens} exceed "
                                 f"model.max_position={limit} of model={cfg.model.name}")
    return ids


def generate(ctx, tracker) -> int:
    """One prompt through the engine, wrapped in the suite's chat template; prints the completion and timing,
    and saves it as ``generation.txt`` (+ ``generation.json``) in the run directory and in MLflow."""
    from redknot.bench.benchmark import EngineStartError

    console = _console()
    try:
        code = _generate(ctx, tracker, console)
    except (GenerateInputError, *INPUT_ERRORS, EngineStartError) as err:
        console.print(f"error: {err}", style="red", markup=False)
        code = 2
    return finish(ctx, tracker, console, code)


def _generate(ctx, tracker, console: Console) -> int:
    from redknot.bench.benchmark import EngineStartError
    from redknot.bench.measure import request_timings
    from redknot.engine import SamplingParams

    cfg = ctx.cfg
    if not cfg.prompt:
        console.print('error: mode=generate needs prompt="..."', style="red", markup=False)
        return 2
    ids = _prompt_ids(cfg)
    params = SamplingParams(max_tokens=cfg.generate.max_tokens, temperature=cfg.generate.temperature,
                            seed=cfg.generate.seed)
    started = time.perf_counter()
    try:
        llm = build_engine(cfg)
    except Exception as err:  # the engine's own message names the cause (path, device, checkpoint tensor)
        raise EngineStartError(f"the engine did not start: {type(err).__name__}: {err}") from err
    loaded = time.perf_counter() - started
    try:
        output = llm.generate([ids], params)[0]
    except ValueError as err:  # a prompt the engine refuses (e.g. token ids outside the model's vocabulary)
        raise GenerateInputError(f"the engine refused the prompt: {err}") from None
    timings = request_timings(output.metrics)
    console.print(output.text, markup=False)
    console.print(f"[dim]{len(ids)} prompt tokens, {len(output.token_ids)} generated ({output.finish_reason}); "
                  f"TTFT {timings.ttft_s or 0:.3f} s, e2e {timings.e2e_s or 0:.3f} s, "
                  f"decode {timings.decode_tok_s or 0:.1f} tok/s; engine start {loaded:.1f} s[/dim]")
    _save_generation(ctx, tracker, ids, output, timings)
    tracker.log_metrics({k: v for k, v in {"generate.ttft_s": timings.ttft_s, "generate.e2e_s": timings.e2e_s,
                                           "generate.decode_tok_s": timings.decode_tok_s,
                                           "generate.output_tokens": len(output.token_ids)}.items()
                         if v is not None})
    if output.finish_reason not in ("stop", "length"):
        console.print(f"error: generation ended with {output.finish_reason}: {output.error}", style="red",
                      markup=False)
        return 1
    return 0


def _save_generation(ctx, tracker, ids, output, timings) -> None:
    from dataclasses import asdict

    run_dir = Path(ctx.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "generation.txt").write_text(output.text, encoding="utf-8")
    record = {"prompt": ctx.cfg.prompt, "prompt_token_ids": ids, "token_ids": list(output.token_ids),
              "text": output.text, "finish_reason": output.finish_reason, "error": output.error,
              "timings": asdict(timings)}
    (run_dir / "generation.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n",
                                             encoding="utf-8")
    tracker.log_text(output.text, "generate/completion.txt")
    tracker.log_artifact(run_dir / "generation.json", "generate")
