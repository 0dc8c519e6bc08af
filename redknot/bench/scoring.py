"""Answer scoring with LongBench semantics, plus the synthetic-task metric.

Every scorer takes the cleaned prediction and the list of reference answers
and returns a value in [0, 1] (the best over the references where that
applies). Dataset scores are ``100 × mean`` rounded to two decimals.
"""
from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_SPECIAL_TEXT = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<think>", "</think>")


def normalize_answer(text: str) -> str:
    """LongBench normalisation: lower-case, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def strip_thinking(text: str) -> str:
    """The answer part of a V4 completion: text after the last ``</think>``, without marker tokens.

    Non-thinking prompts end in ``</think>`` already, so their completions
    usually hold no marker; thinking completions hold the reasoning, then
    ``</think>``, then the answer. An unterminated ``<think>`` (generation cut by
    ``max_new``) leaves no answer, which scores as an empty prediction.
    """
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:
        text = text.split("<think>", 1)[0]
    text = _THINK_BLOCK.sub("", text)
    for marker in _SPECIAL_TEXT:
        text = text.replace(marker, "")
    return text.strip()


def first_line(text: str) -> str:
    """LongBench's few-shot datasets score only the first line after leading newlines."""
    return text.lstrip("\n").split("\n")[0]


def _token_f1(prediction_tokens: List[str], reference_tokens: List[str]) -> float:
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, references: Sequence[str]) -> float:
    """Token F1 between normalised prediction and each reference; the best one."""
    prediction_tokens = normalize_answer(prediction).split()
    return max((_token_f1(prediction_tokens, normalize_answer(ref).split()) for ref in references), default=0.0)


def exact_match(prediction: str, references: Sequence[str]) -> float:
    normalized = normalize_answer(prediction)
    return float(any(normalized == normalize_answer(ref) for ref in references))


def rouge_l(prediction: str, references: Sequence[str]) -> float:
    """ROUGE-L F-measure (summaries), best over references."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    return max((scorer.score(ref, prediction)["rougeL"].fmeasure for ref in references), default=0.0)


def code_similarity(prediction: str, references: Sequence[str]) -> float:
    """Fuzzy ratio between the first line that looks like code and each reference (code completion)."""
    from rapidfuzz import fuzz

    candidate = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            candidate = line
            break
    return max((fuzz.ratio(candidate, ref) / 100.0 for ref in references), default=0.0)


def retrieval_score(prediction: str, references: Sequence[str]) -> float:
    """Passage retrieval: share of numbers in the prediction that name the reference paragraph."""
    best = 0.0
    for ref in references:
        wanted = re.findall(r"Paragraph (\d+)", ref)
        numbers = re.findall(r"\d+", prediction)
        if wanted and numbers:
            best = max(best, sum(n == wanted[0] for n in numbers) / len(numbers))
    return best


def contains_all(prediction: str, references: Sequence[str]) -> float:
    """Synthetic tasks: fraction of references found (case-insensitive) in the prediction."""
    if not references:
        return 0.0
    lowered = prediction.lower()
    return sum(ref.lower() in lowered for ref in references) / len(references)


METRICS: Dict[str, Callable[[str, Sequence[str]], float]] = {
    "qa_f1": qa_f1,
    "exact_match": exact_match,
    "rouge_l": rouge_l,
    "code_sim": code_similarity,
    "retrieval": retrieval_score,
    "contains_all": contains_all,
}


@dataclass(frozen=True)
class Score:
    """A scored prediction: the cleaned text that was scored and every metric's value."""
    prediction: str
    primary: float
    metrics: Dict[str, float]


def score_prediction(raw: str, references: Sequence[str], metric: str, first_line_only: bool = False) -> Score:
    """Clean a raw completion (thinking markers, first line where the dataset asks) and score it.

    QA metrics also report exact match as a second value.
    """
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}; allowed: {', '.join(sorted(METRICS))}")
    cleaned = strip_thinking(raw)
    if first_line_only:
        cleaned = first_line(cleaned)
    values = {metric: METRICS[metric](cleaned, references)}
    if metric == "qa_f1":
        values["exact_match"] = exact_match(cleaned, references)
    return Score(prediction=cleaned, primary=values[metric], metrics=values)


def dataset_score(values: Sequence[float]) -> float:
    """LongBench reporting: 100 × mean, two decimals (0.0 for no values)."""
    if not values:
        return 0.0
    return round(100.0 * sum(values) / len(values), 2)
