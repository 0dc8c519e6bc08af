"""Scorers on hand-worked cases (values computed by hand, LongBench semantics)."""
import pytest

from redknot.bench import scoring
from redknot.bench.scoring import (
    code_similarity, contains_all, dataset_score, exact_match, normalize_answer, qa_f1, rouge_l,
    score_prediction, strip_thinking,
)


@pytest.mark.parametrize("text, expected", [
    ("The  Quick, brown fox!", "quick brown fox"),
    ("An apple a day", "apple day"),
    ("theater anagram", "theater anagram"),          # articles only as whole words
    ("  U.S.A.\n\tthe end ", "usa end"),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_f1_partial_overlap():
    # pred {paris, france}, ref {paris}: P = 1/2, R = 1, F1 = 2/3
    assert qa_f1("Paris, France", ["Paris"]) == pytest.approx(2 / 3)


def test_f1_takes_best_of_multiple_answers():
    # vs "george bush": no overlap; vs "obama": P = 1/2, R = 1 -> 2/3
    assert qa_f1("Barack Obama", ["George Bush", "Obama"]) == pytest.approx(2 / 3)
    assert qa_f1("Barack Obama", ["George Bush", "Obama", "barack obama"]) == pytest.approx(1.0)


def test_f1_counts_repeated_tokens_once_per_reference_occurrence():
    # "the the cat cat" -> [cat, cat]; common with [cat] is 1: P = 1/2, R = 1 -> 2/3
    assert qa_f1("the the cat cat", ["cat"]) == pytest.approx(2 / 3)


def test_f1_only_articles_in_reference_is_zero():
    assert qa_f1("the", ["the"]) == 0.0


def test_empty_prediction_scores_zero():
    assert qa_f1("", ["Paris"]) == 0.0
    assert exact_match("", ["Paris"]) == 0.0
    assert contains_all("", ["123"]) == 0.0
    result = score_prediction("", ["Paris"], "qa_f1")
    assert result.primary == 0.0 and result.metrics == {"qa_f1": 0.0, "exact_match": 0.0}


def test_exact_match_after_normalisation():
    assert exact_match("The Beatles.", ["beatles"]) == 1.0
    assert exact_match("Beatles band", ["beatles"]) == 0.0


def test_triviaqa_scores_first_line_only():
    raw = "\nMount Everest\nQuestion: Which is the tallest mountain?\nAnswer: K2"
    scored = score_prediction(raw, ["Everest", "Mount Everest"], "qa_f1", first_line_only=True)
    assert scored.prediction == "Mount Everest"
    assert scored.primary == 1.0
    assert scored.metrics["exact_match"] == 1.0
    # The same text scored whole: pred tokens {mount, everest, question, which, is, tallest,
    # mountain, answer, k2} (9, "the" dropped); vs "mount everest": P = 2/9, R = 1 -> 4/11
    whole = score_prediction(raw, ["Mount Everest"], "qa_f1")
    assert whole.primary == pytest.approx(4 / 11)


def test_thinking_markers_are_stripped():
    assert strip_thinking("<think>The capital is Paris, not Lyon.</think>London") == "London"
    assert strip_thinking("Paris<｜end▁of▁sentence｜>") == "Paris"
    assert strip_thinking("<think>never finished") == ""
    scored = score_prediction("<think>maybe Lyon</think> Paris", ["Paris"], "qa_f1")
    assert scored.prediction == "Paris" and scored.primary == 1.0


def test_contains_all_fraction_of_references():
    assert contains_all("the values are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert contains_all("VAR ABCDE and var fghij", ["abcde", "FGHIJ"]) == 1.0


def test_rouge_l_hand_computed():
    # LCS("the cat sat", "the cat sat on the mat") = 3: P = 3/3, R = 3/6 -> F = 2/3
    assert rouge_l("the cat sat", ["the cat sat on the mat"]) == pytest.approx(2 / 3)


def test_code_similarity_uses_first_code_line():
    assert code_similarity("```python\nx = 1\ny = 2", ["x = 1"]) == 1.0
    # InDel ratio: "abcd" vs "abce" -> 1 - 2/8 = 0.75
    assert code_similarity("# comment\nabcd", ["abce"]) == pytest.approx(0.75)


def test_retrieval_score():
    assert scoring.retrieval_score("Paragraph 3", ["Paragraph 3"]) == 1.0
    assert scoring.retrieval_score("Paragraph 3 or 5", ["Paragraph 3"]) == pytest.approx(0.5)


def test_dataset_score_is_100_times_mean_two_decimals():
    assert dataset_score([1.0, 0.0, 0.5]) == 50.0
    assert dataset_score([2 / 3]) == 66.67
    assert dataset_score([]) == 0.0


def test_unknown_metric_names_allowed_values():
    with pytest.raises(ValueError, match="metric='bleu'.*allowed: code_sim"):
        score_prediction("x", ["x"], "bleu")
