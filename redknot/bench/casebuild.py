"""Assemble one prompt of exactly ``target`` tokens from token-id pieces.

A prompt is ``prefix + context + middle + question + suffix`` (prefix and
suffix carry the chat wrapper and the template text around the context). The
context is built from token ids only — never by decoding and re-encoding:

* the gold pieces (a LongBench row's context, or a synthetic task's needles)
  are placed in order at seeded depths inside a stream of filler blocks
  (other rows' contexts, or filler sentences), each followed by the passage
  separator; insertion points snap to the nearest block boundary so passages
  stay whole, and the stream is cut at a token boundary where the budget ends;
* a single gold piece longer than the budget is truncated in the middle
  (LongBench style: the first and last halves of the budget are kept).

The result records where every gold piece landed, so validation can check that
it survived.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, List, Sequence, Tuple

import numpy as np


class CaseError(ValueError):
    """A case that cannot be built to the target length (too long a question, too little filler)."""


@dataclass(frozen=True)
class PromptPieces:
    """Token ids of the fixed parts of one prompt."""
    prefix: np.ndarray    # chat wrapper head + template text before the context
    middle: np.ndarray    # template text between context and question
    question: np.ndarray  # the row's input
    suffix: np.ndarray    # template text after the question + chat wrapper tail

    @property
    def num_fixed(self) -> int:
        return len(self.prefix) + len(self.middle) + len(self.question) + len(self.suffix)


@dataclass(frozen=True)
class BuiltCase:
    """One assembled prompt and where its gold pieces are.

    ``gold_spans`` are ``[start, end)`` offsets into ``input_ids``; for a
    middle-truncated gold piece there are two spans (the kept head and tail).
    ``filler_keys`` names the filler blocks that made it into the prompt, in
    order (the last one possibly cut).
    """
    input_ids: np.ndarray               # [target] uint32
    gold_spans: Tuple[Tuple[int, int], ...]
    gold_truncated: bool
    depths: Tuple[float, ...]
    filler_keys: Tuple[str, ...]


def middle_truncate(ids: np.ndarray, budget: int) -> Tuple[np.ndarray, np.ndarray]:
    """The (head, tail) LongBench keeps of an over-long sequence: budget//2 first, the rest last."""
    head = budget // 2
    tail = budget - head
    return ids[:head], ids[len(ids) - tail:] if tail else ids[:0]


def _snap(targets: Sequence[int], boundaries: np.ndarray, limit: int) -> List[int]:
    """Each target → the nearest candidate in ``boundaries ∪ {limit}`` that is ≤ limit (ties go left)."""
    candidates = np.unique(np.append(boundaries[boundaries <= limit], limit))
    snapped = []
    for target in targets:
        right = int(np.searchsorted(candidates, target, side="left"))
        right = min(right, len(candidates) - 1)
        left = max(right - 1, 0)
        pick = candidates[left] if target - candidates[left] <= candidates[right] - target else candidates[right]
        snapped.append(int(pick))
    return snapped


def _collect_filler(filler: Iterable[Tuple[str, np.ndarray]], sep: np.ndarray, needed: int
                    ) -> Tuple[List[Tuple[str, np.ndarray]], np.ndarray]:
    """Filler blocks (each followed by ``sep``) until the stream holds ``needed`` tokens."""
    blocks: List[Tuple[str, np.ndarray]] = []
    ends: List[int] = []
    total = 0
    iterator: Iterator = iter(filler)
    while total < needed:
        try:
            key, ids = next(iterator)
        except StopIteration:
            raise CaseError(f"filler runs out: {total} tokens available, {needed} needed") from None
        if len(ids) == 0:
            continue
        blocks.append((key, ids))
        total += len(ids) + len(sep)
        ends.append(total)
    return blocks, np.asarray([0] + ends, dtype=np.int64)


def _assemble(pieces: PromptPieces, context: List[np.ndarray]) -> np.ndarray:
    parts = [pieces.prefix, *context, pieces.middle, pieces.question, pieces.suffix]
    return np.concatenate([np.asarray(p, dtype=np.uint32) for p in parts])  # [target]


def _truncated_case(pieces: PromptPieces, gold: np.ndarray, budget: int) -> BuiltCase:
    head, tail = middle_truncate(gold, budget)
    start = len(pieces.prefix)
    spans = ((start, start + len(head)), (start + len(head), start + budget))
    return BuiltCase(_assemble(pieces, [head, tail]), spans, True, (0.0,), ())


def build_case(pieces: PromptPieces, golds: Sequence[np.ndarray], depths: Sequence[float],
               filler: Iterable[Tuple[str, np.ndarray]], sep: np.ndarray, target: int) -> BuiltCase:
    """Assemble a prompt of exactly ``target`` tokens (see the module docstring).

    ``depths`` (one per gold piece, in [0, 1]) are where the pieces should sit
    within the filler; they are sorted so that the pieces keep their order.
    """
    if len(golds) != len(depths) or not golds:
        raise CaseError(f"need one depth per gold piece, got {len(golds)} pieces and {len(depths)} depths")
    budget = target - pieces.num_fixed
    if budget < 0:
        raise CaseError(f"template and question take {pieces.num_fixed} tokens, more than the target {target}")
    gold_lengths = [len(g) for g in golds]
    filler_room = budget - sum(gold_lengths) - (len(golds) - 1) * len(sep)
    if filler_room < 0:
        if len(golds) == 1:
            return _truncated_case(pieces, np.asarray(golds[0]), budget)
        raise CaseError(f"{len(golds)} gold pieces of {sum(gold_lengths)} tokens do not fit in {budget}")
    blocks, boundaries = _collect_filler(filler, sep, filler_room)
    stream = np.concatenate([np.concatenate([ids, sep]) for _, ids in blocks]) if blocks else sep[:0]
    wanted = [int(round(min(max(d, 0.0), 1.0) * filler_room)) for d in sorted(depths)]
    points = _snap(wanted, boundaries, filler_room)
    context: List[np.ndarray] = []
    spans: List[Tuple[int, int]] = []
    cursor, offset = 0, len(pieces.prefix)
    for gold, point in zip(golds, points):
        context.append(stream[cursor:point])
        offset += point - cursor
        spans.append((offset, offset + len(gold)))
        context += [np.asarray(gold), sep]
        offset += len(gold) + len(sep)
        cursor = point
    remaining = budget - (offset - len(pieces.prefix))
    if remaining < 0:  # the separator after the last gold piece runs past the budget: cut it
        context[-1] = sep[:len(sep) + remaining]
        remaining = 0
    context.append(stream[cursor:cursor + remaining])
    filler_used = cursor + remaining
    used = tuple(key for (key, _), start in zip(blocks, boundaries[:-1]) if start < filler_used)
    input_ids = _assemble(pieces, context)
    assert len(input_ids) == target, (len(input_ids), target)
    actual = tuple(p / filler_room if filler_room else 0.0 for p in points)
    return BuiltCase(input_ids, tuple(spans), False, actual, used)
