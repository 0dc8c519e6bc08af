"""Build every case of a suite: rows → token ids → exact-length prompts + manifest entries.

Used by ``mode=prepare`` (to freeze inputs) and by ``mode=validate`` (to
re-derive them and compare bit for bit). Each dataset's texts are tokenized
once, in batches; prompts are joined from token ids (see
:mod:`redknot.bench.casebuild`). All choices — which distractor rows, in which
order, at what depth the gold sits — derive from ``suite.seed`` and the row ids
through sha256, and are written to the manifest.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from redknot.bench import registry, synthetic
from redknot.bench.casebuild import BuiltCase, CaseError, PromptPieces, build_case
from redknot.bench.datasets import DatasetSource, SourceReader
from redknot.bench.registry import DatasetSpec
from redknot.bench.tokcache import TokenCache, context_key
from redknot.bench.tokenizer import BenchTokenizer
from redknot.config.schema import ChatTemplate, SuiteConfig

BUILDER_VERSION = "casebuild-v1"
TOKENS_PER_K = 1024
_ENCODE_CHUNK = 32

Progress = Callable[[str, int, int], None]  # (task description, done, total)


@dataclass(frozen=True)
class CaseEntry:
    """A frozen case as the manifest records it (everything needed to run and score it)."""
    case_id: str
    dataset: str
    kind: str
    row_index: int
    row_id: str
    source: str
    source_sha256: str
    question: str
    answers: Tuple[str, ...]
    metric: str
    first_line_only: bool
    max_new_tokens: int
    num_tokens: int
    ids_sha256: str
    gold_spans: Tuple[Tuple[int, int], ...]
    gold_truncated: bool
    depths: Tuple[float, ...]
    distractors: Tuple[str, ...]
    num_filler_blocks: int
    role: str = "short"  # "short": scored into the accuracy aggregate; "presentation": long answer, shown only

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "CaseEntry":
        values = dict(obj)
        for name in ("answers", "depths", "distractors"):
            values[name] = tuple(values[name])
        values["gold_spans"] = tuple(tuple(span) for span in values["gold_spans"])
        return cls(**values)


def ids_sha256(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<u4").tobytes()).hexdigest()


def _unit_interval(*parts: object) -> float:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def distractor_order(seed: int, dataset: str, row_id: str, other_ids: Sequence[str]) -> List[str]:
    """Other rows of the dataset in the seeded order they fill this case's context."""
    return sorted(other_ids, key=lambda other: hashlib.sha256(f"{seed}/{dataset}/{row_id}/{other}".encode()).digest())


def gold_depth(seed: int, dataset: str, row_id: str) -> float:
    return round(_unit_interval(seed, dataset, row_id, "depth"), 6)


class SuiteBuilder:
    """Builds the cases of one suite with one tokenizer from one data location."""

    def __init__(self, suite: SuiteConfig, tokenizer: BenchTokenizer, reader: SourceReader,
                 token_cache: Optional[TokenCache] = None):
        self.suite = suite
        self.tokenizer = tokenizer
        self.reader = reader
        self.token_cache = token_cache  # prepare only; validation tokenizes from the sources
        self.specs: List[Tuple[str, DatasetSpec]] = [(name, registry.get_spec(name)) for name in suite.datasets]
        self._filler_pool: Optional[List[np.ndarray]] = None
        self.stats: dict = {}  # per dataset, filled while building: source rows, gold token counts, truncations

    # ------------------------------------------------------------------ identity

    def num_rows(self, count: int) -> int:
        """LongBench rows used: the first ``samples_per_dataset`` (all of them when it is 0 or less)."""
        wanted = self.suite.samples_per_dataset
        return count if wanted <= 0 else min(wanted, count)

    def num_synthetic(self) -> int:
        if self.suite.samples_per_dataset <= 0:
            raise CaseError(f"suite.samples_per_dataset={self.suite.samples_per_dataset}: synthetic tasks need a "
                            "positive number of cases")
        return self.suite.samples_per_dataset

    def presentation_rows(self) -> List[Tuple[str, DatasetSpec, int]]:
        """(dataset, spec, row index) of each presentation case: the datasets in turn, rows after the
        short-answer ones (case k of dataset d is row samples_per_dataset + k)."""
        out, seen = [], {}
        for i in range(max(self.suite.presentation_cases, 0)):
            name, spec = self.specs[i % len(self.specs)]
            out.append((name, spec, max(self.suite.samples_per_dataset, 0) + seen.get(name, 0)))
            seen[name] = seen.get(name, 0) + 1
        return out

    def synthetic_rows(self, name: str, spec: DatasetSpec) -> List:
        """The generated rows of a synthetic task: short-answer rows, then any presentation rows
        (each row depends on its index only, so the first ones never change)."""
        extra = sum(1 for d, _, _ in self.presentation_rows() if d == name)
        return synthetic.generate_rows(spec.name, self.num_synthetic() + extra, self.suite.seed)

    def max_new(self, name: str) -> int:
        return registry.max_new_tokens(name, dict(self.suite.max_new_tokens), self.suite.default_max_new_tokens)

    def source_sha256(self, name: str, spec: DatasetSpec) -> str:
        if spec.kind == "synthetic":
            rows = self.synthetic_rows(name, spec)
            blob = json.dumps([asdict(r) for r in rows] + synthetic.filler_sentences(self.suite.seed))
            return hashlib.sha256(blob.encode()).hexdigest()
        return self.reader.sha256(name)

    def key(self) -> dict:
        """Everything the frozen inputs depend on; its sha256 is their address."""
        suite = self.suite
        return {
            "builder": BUILDER_VERSION, "templates": registry.TEMPLATE_VERSION,
            "synthetic": synthetic.SYNTHETIC_VERSION,
            "suite": suite.name, "context_tokens": suite.context_tokens, "tokens_per_k": TOKENS_PER_K,
            "datasets": list(suite.datasets), "samples_per_dataset": suite.samples_per_dataset, "seed": suite.seed,
            "chat_template": ChatTemplate(suite.chat_template).value,
            "max_new_tokens": {name: self.max_new(name) for name, _ in self.specs},
            "tokenizer_sha256": self.tokenizer.sha256,
            "sources": {name: self.source_sha256(name, spec) for name, spec in self.specs},
            **({"presentation": {"cases": suite.presentation_cases,
                                 "max_new_tokens": suite.presentation_max_new_tokens}}
               if suite.presentation_cases > 0 else {}),
        }

    # ------------------------------------------------------------------ tokens

    def _encode_all(self, texts: Sequence[str], label: str, progress: Optional[Progress]) -> List[np.ndarray]:
        out: List[np.ndarray] = []
        for start in range(0, len(texts), _ENCODE_CHUNK):
            out += self.tokenizer.encode_batch(texts[start:start + _ENCODE_CHUNK])
            if progress:
                progress(label, len(out), len(texts))
        return out

    def _contexts(self, source: DatasetSource, label: str, progress: Optional[Progress]) -> List[np.ndarray]:
        """Token ids of every row's context (from the token cache when one is given and holds them)."""
        key = context_key(source.sha256, self.tokenizer.sha256)
        cached = self.token_cache.get(key) if self.token_cache is not None else None
        if cached is not None and len(cached) == len(source.rows):
            return cached
        contexts = self._encode_all([row.context for row in source.rows], label, progress)
        if self.token_cache is not None:
            self.token_cache.put(key, contexts)
        return contexts

    def _pieces(self, spec: DatasetSpec, question: np.ndarray) -> PromptPieces:
        before, after = registry.chat_wrapper(ChatTemplate(self.suite.chat_template).value)
        head, middle, tail = spec.template_parts()
        enc = self.tokenizer.encode
        return PromptPieces(prefix=np.concatenate([enc(before), enc(head)]), middle=enc(middle), question=question,
                            suffix=np.concatenate([enc(tail), enc(after)]))

    # ------------------------------------------------------------------ cases

    def build(self, progress: Optional[Progress] = None) -> Iterator[Tuple[CaseEntry, np.ndarray]]:
        """Every case of the suite in a fixed order: the short-answer cases dataset by dataset, then
        the presentation cases."""
        wanted = {}
        for name, _, index in self.presentation_rows():
            wanted.setdefault(name, []).append(index)
        later = []
        for name, spec in self.specs:
            built = (self._build_synthetic(name, spec, progress) if spec.kind == "synthetic" else
                     self._build_longbench(name, spec, self.reader.load(name), progress, wanted.get(name, [])))
            for entry, ids in built:
                if entry.role == "presentation":
                    later.append((entry, ids))
                else:
                    yield entry, ids
        order = {(name, index): i for i, (name, _, index) in enumerate(self.presentation_rows())}
        yield from sorted(later, key=lambda item: order[(item[0].dataset, item[0].row_index)])

    def _note_stats(self, name: str, source_rows: int, gold_lengths: List[int], truncated: int) -> None:
        self.stats[name] = {
            "source_rows": source_rows, "cases": len(gold_lengths), "truncated": truncated,
            "gold_tokens": {"mean": float(np.mean(gold_lengths)) if gold_lengths else 0.0,
                            "min": int(min(gold_lengths, default=0)), "max": int(max(gold_lengths, default=0))}}

    def _entry(self, name: str, spec: DatasetSpec, index: int, row_id: str, source: str, sha: str, question: str,
               answers: Sequence[str], built: BuiltCase, distractors: Tuple[str, ...]) -> CaseEntry:
        presentation = index >= max(self.suite.samples_per_dataset, 0) and self.suite.samples_per_dataset > 0
        role = "presentation" if presentation else "short"
        max_new = self.suite.presentation_max_new_tokens if presentation else self.max_new(name)
        return CaseEntry(
            case_id=f"{name}-{index:04d}", dataset=name, kind=spec.kind, row_index=index, row_id=row_id,
            source=source, source_sha256=sha, question=question, answers=tuple(answers), metric=spec.metric,
            first_line_only=spec.first_line_only, max_new_tokens=max_new,
            num_tokens=int(len(built.input_ids)), ids_sha256=ids_sha256(built.input_ids),
            gold_spans=built.gold_spans, gold_truncated=built.gold_truncated, depths=built.depths,
            distractors=distractors, num_filler_blocks=len(built.filler_keys), role=role)

    def _build_longbench(self, name: str, spec: DatasetSpec, source: DatasetSource, progress: Optional[Progress],
                         presentation: Sequence[int] = ()) -> Iterator[Tuple[CaseEntry, np.ndarray]]:
        rows = source.rows
        missing = [i for i in presentation if i >= len(rows)]
        if missing:
            raise CaseError(f"{name} from {self.reader.description}: suite.presentation_cases needs row {missing[0]} "
                            f"but the file has {len(rows)} rows")
        selected = list(rows[:self.num_rows(len(rows))]) + [rows[i] for i in presentation]
        contexts = self._contexts(source, f"tokenize {name}", progress)
        questions = self.tokenizer.encode_batch([row.input for row in selected])
        sep = self.tokenizer.encode(registry.PASSAGE_SEPARATOR)
        by_id = {row.row_id: row.index for row in rows}
        truncated = 0
        for count, (row, question) in enumerate(zip(selected, questions), start=1):
            order = distractor_order(self.suite.seed, name, row.row_id, [r.row_id for r in rows if r is not row])
            filler = ((other, contexts[by_id[other]]) for other in order)
            try:
                built = build_case(self._pieces(spec, question), [contexts[row.index]],
                                   [gold_depth(self.suite.seed, name, row.row_id)], filler, sep,
                                   self.suite.context_tokens)
            except CaseError as err:
                hint = data_hint(self.reader) if "filler runs out" in str(err) else ""
                raise CaseError(f"{name} row {row.index} (_id {row.row_id}) from {self.reader.description}: "
                                f"{err}{hint}") from None
            truncated += built.gold_truncated
            yield self._entry(name, spec, row.index, row.row_id, source.origin, source.sha256, row.input,
                              row.answers, built, built.filler_keys), built.input_ids
            if progress:
                progress(f"build {name}", count, len(selected))
        self._note_stats(name, len(rows), [len(contexts[row.index]) for row in selected], truncated)

    def _pool(self, progress: Optional[Progress]) -> List[np.ndarray]:
        if self._filler_pool is None:
            self._filler_pool = self._encode_all(synthetic.filler_sentences(self.suite.seed), "tokenize filler",
                                                 progress)
        return self._filler_pool

    def _build_synthetic(self, name: str, spec: DatasetSpec,
                         progress: Optional[Progress]) -> Iterator[Tuple[CaseEntry, np.ndarray]]:
        pool = self._pool(progress)
        rows = self.synthetic_rows(name, spec)
        sha = self.source_sha256(name, spec)
        empty = np.zeros(0, dtype=np.uint32)
        gold_lengths = []
        for row in rows:
            needles = self.tokenizer.encode_batch([" " + needle for needle in row.needles])
            gold_lengths.append(sum(len(n) for n in needles))
            order = synthetic.filler_order(self.suite.seed, spec.name, row.index, len(pool))
            filler = ((f"s{i}", pool[i]) for i in order)
            built = build_case(self._pieces(spec, self.tokenizer.encode(row.question)), needles, row.depths,
                               filler, empty, self.suite.context_tokens)
            yield self._entry(name, spec, row.index, row.row_id, f"synthetic:{spec.name}", sha, row.question,
                              row.answers, built, ()), built.input_ids
            if progress:
                progress(f"build {name}", row.index + 1, len(rows))
        self._note_stats(name, len(rows), gold_lengths, 0)


def data_hint(reader: SourceReader) -> str:
    """How to get enough LongBench data (appended to a "filler runs out" error)."""
    sample = "the LongBench-format sample bundled with redknot is sized for the smoke suites; " \
        if reader.description.startswith("the packaged") else ""
    return (f"; {sample}get the LongBench data with suite.data.download=true (mode=prepare fetches "
            f"THUDM/LongBench's data.zip once into output.cache_dir), or point suite.data.dir=DIR (one "
            f"<dataset>.jsonl per set) or suite.data.archive=data.zip at a copy; suite=ruler_64k or ruler_128k "
            f"(synthetic tasks) needs no download; or lower suite.context_tokens")


def tokenizer_summary(tokenizer: BenchTokenizer) -> dict:
    return {"path": str(Path(tokenizer.path)), "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}
