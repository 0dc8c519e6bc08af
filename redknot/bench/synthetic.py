"""RULER-style synthetic long-context tasks, generated from a seed (no download).

Each task yields rows of the same shape as LongBench rows: a question, the
reference answers, and the *needles* — short statements hidden at seeded depths
in filler text (the case builder places them; filler is a pool of seeded
pseudo-English sentences). Scored by the fraction of references the output
contains.

* ``niah_single``: one key → value statement; asked for the value.
* ``niah_multikey``: four statements with different keys; asked for one.
* ``niah_multivalue``: four values stated for the same key; asked for all.
* ``variable_tracking``: ``VAR A = 12345``, ``VAR B = VAR A`` …; asked for
  every variable that holds the value.

All randomness comes from :func:`seeded_random` (Python's Mersenne Twister
seeded with an integer derived by sha256), so rows are stable across
platforms; the manifest records what was generated and validation re-derives it.
"""
from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

from redknot.bench.fixtures import LEXICON

SYNTHETIC_VERSION = "synthetic-v1"
NUM_FILLER_SENTENCES = 512


def seeded_random(*parts: object) -> random.Random:
    """A ``random.Random`` whose seed is sha256 of the parts (stable across runs and platforms)."""
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


@dataclass(frozen=True)
class SyntheticRow:
    """One generated task instance: needles to hide, in order, with their depths."""
    index: int
    row_id: str
    question: str
    answers: Tuple[str, ...]
    needles: Tuple[str, ...]
    depths: Tuple[float, ...]


def _key(rng: random.Random) -> str:
    return "-".join(rng.sample(LEXICON, 2))


def _value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _code_statement(key: str, value: str) -> str:
    return f"The secret code for {key} is {value}."


def _single(rng: random.Random) -> Tuple[str, List[str], List[str]]:
    key, value = _key(rng), _value(rng)
    question = f"What is the secret code for {key}? Answer with the code only.\nThe secret code for {key} is"
    return question, [value], [_code_statement(key, value)]


def _multikey(rng: random.Random) -> Tuple[str, List[str], List[str]]:
    keys = []
    while len(keys) < 4:
        key = _key(rng)
        if key not in keys:
            keys.append(key)
    values = [_value(rng) for _ in keys]
    asked = rng.randrange(len(keys))
    question = (f"What is the secret code for {keys[asked]}? Answer with the code only.\n"
                f"The secret code for {keys[asked]} is")
    return question, [values[asked]], [_code_statement(k, v) for k, v in zip(keys, values)]


def _multivalue(rng: random.Random) -> Tuple[str, List[str], List[str]]:
    key = _key(rng)
    values = []
    while len(values) < 4:
        value = _value(rng)
        if value not in values:
            values.append(value)
    question = (f"What are all the secret codes for {key}? List every one of them.\n"
                f"The secret codes for {key} are")
    return question, values, [_code_statement(key, v) for v in values]


def _variable_tracking(rng: random.Random) -> Tuple[str, List[str], List[str]]:
    names = []
    while len(names) < 5:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    needles = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    question = (f"Which variables hold the value {value} after the assignments above? List all of them.\n"
                f"The variables holding {value} are:")
    return question, names, needles


TASKS: Dict[str, Callable[[random.Random], Tuple[str, List[str], List[str]]]] = {
    "niah_single": _single,
    "niah_multikey": _multikey,
    "niah_multivalue": _multivalue,
    "variable_tracking": _variable_tracking,
}


def generate_rows(task: str, num_rows: int, seed: int) -> List[SyntheticRow]:
    """``num_rows`` instances of ``task``; needles keep their order (sorted depths)."""
    if task not in TASKS:
        raise ValueError(f"synthetic task {task!r} unknown; allowed: {', '.join(sorted(TASKS))}")
    rows = []
    for index in range(num_rows):
        rng = seeded_random(SYNTHETIC_VERSION, task, seed, index)
        question, answers, needles = TASKS[task](rng)
        depths = tuple(sorted(round(rng.random(), 6) for _ in needles))
        rows.append(SyntheticRow(index=index, row_id=f"{task}-{seed}-{index}", question=question,
                                 answers=tuple(answers), needles=tuple(needles), depths=depths))
    return rows


def filler_sentences(seed: int) -> List[str]:
    """The pool of filler sentences (each with a leading space so token ids join like running text)."""
    rng = seeded_random(SYNTHETIC_VERSION, "filler", seed)
    sentences = []
    for _ in range(NUM_FILLER_SENTENCES):
        words = [rng.choice(LEXICON) for _ in range(rng.randint(7, 18))]
        sentences.append(" " + " ".join(words).capitalize() + ".")
    return sentences


def filler_order(seed: int, task: str, index: int, pool_size: int):
    """An endless seeded sequence of pool indices for one case's filler."""
    rng = seeded_random(SYNTHETIC_VERSION, "order", seed, task, index)
    while True:
        yield rng.randrange(pool_size)
