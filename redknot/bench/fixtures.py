"""LongBench-format data made by RedKnot itself, for tests, the smoke suite and scale runs.

The rows follow the LongBench JSONL layout (``input``, ``context``,
``answers``, ``length``, ``dataset``, ``language``, ``all_classes``, ``_id``)
and each dataset's shape: numbered passages for the multi-hop sets, one long
story for narrativeqa, few-shot examples in ``context`` with the answer passage
in ``input`` for triviaqa. Text is seeded pseudo-English; every question's
answer is stated in the row's own context (or input), so the tasks are
checkable. Profiles: ``smoke`` (the rows shipped with the package), ``test``
(small unit-test files), ``scale`` (LongBench row counts and mean context
lengths, for timing ``mode=prepare`` of the release suites).

    python -m redknot.bench.fixtures --profile smoke --out redknot/bench/data/longbench_sample
"""
from __future__ import annotations

import argparse
import hashlib
import json
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Tuple

import numpy as np

LEXICON = tuple((
    "river house garden letter window morning evening village station market bridge mountain forest harbor "
    "council library museum theatre school church castle valley island railway factory office kitchen "
    "painting song novel journey winter summer autumn spring season company family friend brother sister "
    "captain doctor teacher farmer soldier merchant writer singer painter student engineer lawyer minister "
    "walked wrote found opened closed carried followed watched built painted visited remembered explained "
    "returned arrived decided believed discovered described gathered listened answered travelled studied "
    "quiet bright narrow ancient modern famous distant gentle heavy early late small large old young "
    "northern southern eastern western golden silver wooden stone green red blue grey long short warm cold "
    "slowly quickly often rarely later again together almost nearly always never still soon "
    "and but with from into over under after before during because while near across between through "
    "of in on at by for to as is was were had has been this that these those his her their its "
    "record report history story rumour decision meeting election treaty agreement festival exhibition"
).split())
_SYLLABLES = "ka lo mi ren tha vel dor an is ur el mor sen tal bri cos nav ph or lin gar fen wy ost rel".split()
_FIELDS = (("founded", "founded"), ("directed", "directed"), ("designed", "designed"), ("written", "wrote"),
           ("financed", "financed"), ("restored", "restored"))  # (passive, active)
_PLACES_SUFFIX = ("ton", "burg", "ford", "ville", "mouth", "dale")


@dataclass(frozen=True)
class Profile:
    """How many rows and how long (mean context words) each dataset's file gets."""
    rows: Dict[str, int]
    mean_words: Dict[str, int]


# Row counts and mean context lengths (words) of the LongBench English QA sets.
_LB_ROWS = {"hotpotqa": 200, "2wikimqa": 200, "musique": 200, "narrativeqa": 200, "triviaqa": 200,
            "multifieldqa_en": 150}
_LB_WORDS = {"hotpotqa": 9151, "2wikimqa": 4887, "musique": 11214, "narrativeqa": 18409, "triviaqa": 8209,
             "multifieldqa_en": 4559}

PROFILES: Dict[str, Profile] = {
    "scale": Profile(rows=_LB_ROWS, mean_words=_LB_WORDS),
    "smoke": Profile(rows={name: 4 for name in _LB_ROWS}, mean_words={name: 700 for name in _LB_WORDS}),
    "test": Profile(rows={name: 6 for name in _LB_ROWS}, mean_words={name: 160 for name in _LB_WORDS}),
}


class _Text:
    """Seeded pseudo-English: names, sentences, paragraphs."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.words = np.array(LEXICON)

    def name(self) -> str:
        parts = self.rng.choice(_SYLLABLES, size=int(self.rng.integers(2, 4)))
        return "".join(parts).capitalize()

    def place(self) -> str:
        return self.name() + str(self.rng.choice(_PLACES_SUFFIX))

    def sentences(self, num_words: int) -> str:
        words = self.rng.choice(self.words, size=max(num_words, 1))
        out: List[str] = []
        start = 0
        while start < len(words):
            length = int(self.rng.integers(7, 19))
            chunk = " ".join(words[start:start + length])
            out.append(chunk[0].upper() + chunk[1:] + ".")
            start += length
        return " ".join(out)

    def words_around(self, fact: str, num_words: int) -> str:
        """Filler sentences with ``fact`` placed at a random sentence boundary."""
        before = int(self.rng.integers(0, max(num_words, 1)))
        return " ".join(p for p in (self.sentences(before), fact, self.sentences(num_words - before)) if p)

    def length(self, mean_words: int) -> int:
        return int(np.clip(self.rng.normal(mean_words, mean_words * 0.35), mean_words * 0.25, mean_words * 2.2))


def _passages(text: _Text, total_words: int, gold: Dict[int, Tuple[str, str]]) -> str:
    """Numbered ``Passage i:`` blocks (title line + text); ``gold`` maps passage index → (title, fact)."""
    count = max(2, total_words // 150, max(gold, default=0) + 1)
    blocks = []
    for index in range(count):
        title, fact = gold.get(index, (text.name(), ""))
        body = text.words_around(fact, 140) if fact else text.sentences(150)
        blocks.append(f"Passage {index + 1}:\n{title}\n{body}")
    return "\n\n".join(blocks)


def _multihop(text: _Text, words: int) -> Tuple[str, str, List[str]]:
    work, person, town = text.name(), f"{text.name()} {text.name()}", text.place()
    passive, active = _FIELDS[int(text.rng.integers(len(_FIELDS)))]
    count = max(2, words // 150)
    first, second = (int(i) for i in text.rng.choice(count, size=2, replace=False))
    gold = {first: (work, f"{work} was {passive} by {person}."), second: (person, f"{person} was born in {town}.")}
    return _passages(text, words, gold), f"Where was the person who {active} {work} born?", [town]


def _narrative(text: _Text, words: int) -> Tuple[str, str, List[str]]:
    hero, place, thing = text.name(), text.place(), str(text.rng.choice(["lantern", "letter", "key", "map"]))
    story = text.words_around(f"{hero} hid the {thing} in {place}.", words)
    return story, f"Where did {hero} hide the {thing}?", [place, f"in {place}"]


def _trivia_example(text: _Text, words: int, with_answer: bool) -> Tuple[str, str]:
    subject, answer = text.name(), text.place()
    passage = text.words_around(f"The {subject} festival is held every year in {answer}.", words)
    block = f"Passage: {passage}\nQuestion: Where is the {subject} festival held?\nAnswer:"
    return (block + f" {answer}" if with_answer else block), answer


def _trivia(text: _Text, words: int) -> Tuple[str, str, List[str]]:
    shots = [_trivia_example(text, 180, True)[0] for _ in range(max(1, words // 200))]
    query, answer = _trivia_example(text, 180, False)
    return "\n\n".join(shots), query, [answer, answer.lower()]


def _multifield(text: _Text, words: int) -> Tuple[str, str, List[str]]:
    system, count = text.name(), str(int(text.rng.integers(2, 99)))
    unit = str(text.rng.choice(["units", "panels", "members"]))
    sections = [f"Section {i + 1}\n{text.sentences(120)}" for i in range(max(1, words // 130) - 1)]
    position = int(text.rng.integers(0, len(sections) + 1))
    fact = f"The {system} array has {count} {unit}."
    sections.insert(position, f"Section {position + 1}\n{text.words_around(fact, 110)}")
    return "\n\n".join(sections), f"How many {unit} does the {system} array have?", [count, f"{count} {unit}"]


_BUILDERS: Dict[str, Callable[[_Text, int], Tuple[str, str, List[str]]]] = {
    "hotpotqa": _multihop, "2wikimqa": _multihop, "musique": _multihop,
    "narrativeqa": _narrative, "triviaqa": _trivia, "multifieldqa_en": _multifield,
}


def generate_rows(dataset: str, num_rows: int, mean_words: int, seed: int = 0) -> List[dict]:
    """``num_rows`` LongBench-format rows for ``dataset``, deterministic in ``seed``."""
    if dataset not in _BUILDERS:
        raise ValueError(f"dataset={dataset!r}: no fixture generator; allowed: {', '.join(sorted(_BUILDERS))}")
    text = _Text(seed * 1_000_003 + zlib.crc32(dataset.encode()))
    rows = []
    for index in range(num_rows):
        context, question, answers = _BUILDERS[dataset](text, text.length(mean_words))
        row_id = hashlib.sha256(f"{dataset}/{seed}/{index}".encode()).hexdigest()[:48]
        rows.append({"input": question, "context": context, "answers": answers,
                     "length": len(context.split()), "dataset": dataset, "language": "en",
                     "all_classes": None, "_id": row_id})
    return rows


def _jsonl(rows: Iterable[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_dataset_dir(out_dir: Path, profile: str, datasets: Iterable[str], seed: int = 0) -> List[Path]:
    """Write ``<dataset>.jsonl`` files for ``profile`` under ``out_dir``; returns the paths."""
    spec = PROFILES[profile]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for dataset in datasets:
        rows = generate_rows(dataset, spec.rows[dataset], spec.mean_words[dataset], seed)
        path = out_dir / f"{dataset}.jsonl"
        path.write_text(_jsonl(rows), encoding="utf-8")
        paths.append(path)
    return paths


def write_data_zip(zip_path: Path, profile: str, datasets: Iterable[str], seed: int = 0) -> Path:
    """The same files packed like LongBench's ``data.zip`` (``data/<dataset>.jsonl``)."""
    spec = PROFILES[profile]
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(zip_path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for dataset in datasets:
            rows = generate_rows(dataset, spec.rows[dataset], spec.mean_words[dataset], seed)
            info = zipfile.ZipInfo(f"data/{dataset}.jsonl", date_time=(2024, 1, 1, 0, 0, 0))
            archive.writestr(info, _jsonl(rows), compress_type=zipfile.ZIP_DEFLATED)
    return zip_path


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory (or .zip path) to write")
    parser.add_argument("--datasets", nargs="*", default=sorted(_BUILDERS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.suffix == ".zip":
        write_data_zip(args.out, args.profile, args.datasets, args.seed)
    else:
        write_dataset_dir(args.out, args.profile, args.datasets, args.seed)
    print(f"wrote {args.profile} fixtures for {', '.join(args.datasets)} to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
