"""Prepare a suite's frozen inputs: build every case once and store it, or reuse the stored entry.

This is the body of ``mode=prepare`` and the first step of ``mode=run``. It
imports neither torch nor the engine, so it runs on any machine.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from redknot.bench.datasets import SourceReader
from redknot.bench.frozen_inputs import FrozenInputs, InputStore, address_of
from redknot.bench.integrity import InputsError, entry_problems
from redknot.bench.suite import TOKENS_PER_K, SuiteBuilder, tokenizer_summary
from redknot.bench.tokcache import TokenCache
from redknot.bench.tokenizer import load_tokenizer
from redknot.config.schema import ModelConfig, SuiteConfig


@dataclass
class FreezeResult:
    """What ``prepare`` did: the entry, whether it already existed, time taken and disk used."""
    inputs: FrozenInputs
    reused: bool
    seconds: float
    disk_bytes: int
    repaired: List[str] = field(default_factory=list)  # problems of a damaged entry that was rebuilt

def make_builder(suite: SuiteConfig, model: ModelConfig, cache_dir: Path, reuse_tokens: bool = False) -> SuiteBuilder:
    """A builder for ``suite``; ``reuse_tokens`` lets it read/write tokenized contexts under the cache (prepare)."""
    cache = TokenCache(Path(cache_dir)) if reuse_tokens else None
    return SuiteBuilder(suite, load_tokenizer(model), SourceReader(suite.data, Path(cache_dir)), cache)


def manifest_header(builder: SuiteBuilder, key: dict) -> dict:
    suite = builder.suite
    return {
        "key": key,
        "suite": suite.name,
        "target_tokens": suite.context_tokens,
        "tokens_per_k": TOKENS_PER_K,
        "target_k": suite.context_tokens / TOKENS_PER_K,
        "chat_template": key["chat_template"],
        "template_version": key["templates"],
        "seed": suite.seed,
        "tokenizer": tokenizer_summary(builder.tokenizer),
        "data_location": builder.reader.description,
        "archive_sha256": builder.reader.archive_sha256,
        "datasets": builder.stats,  # filled while the cases are built, written with the manifest
    }


@contextmanager
def progress_callback(console: Optional[Console]) -> Iterator:
    """A ``(label, done, total)`` callback drawing one rich progress bar per label (None: silent)."""
    if console is None:
        yield None
        return
    columns = (TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = {}

        def update(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = progress.add_task(label, total=total)
            progress.update(tasks[label], completed=done, total=total)

        yield update


def freeze(suite: SuiteConfig, model: ModelConfig, cache_dir: Path, console: Optional[Console] = None,
           builder: Optional[SuiteBuilder] = None, repair: bool = True) -> FreezeResult:
    """Return the suite's frozen inputs, building and storing them first if the address is new.

    A stored entry is checked before reuse (:func:`redknot.bench.integrity.entry_problems`): a
    damaged one is set aside and rebuilt, or with ``repair=False`` refused with an
    :class:`InputsError` naming every damaged file.
    """
    started = time.perf_counter()
    builder = builder or make_builder(suite, model, cache_dir, reuse_tokens=True)
    store = InputStore(Path(cache_dir))
    key = builder.key()
    address = address_of(key)
    repaired: List[str] = []
    if store.path(address).exists():
        problems = entry_problems(store.path(address))
        if not problems:
            inputs = store.load(address)
            return FreezeResult(inputs, True, time.perf_counter() - started, store.disk_bytes(address))
        if not repair:
            raise InputsError(f"frozen inputs of suite {suite.name} at {store.path(address)} are damaged:\n  - "
                              + "\n  - ".join(problems) + f"\nrerun mode=prepare suite={suite.name} to rebuild them")
        aside = store.set_aside(address)
        repaired = problems + [f"the damaged entry was moved to {aside} and rebuilt"]
        if console is not None:
            console.print(f"frozen inputs at {store.path(address)} failed their check; rebuilding:", style="yellow")
            for line in repaired:
                console.print(f"  - {line}", markup=False)
    with progress_callback(console) as progress:
        inputs = store.write(address, manifest_header(builder, key), builder.build(progress))
    return FreezeResult(inputs, False, time.perf_counter() - started, store.disk_bytes(address), repaired)
