"""Incremental detokenization equals a full decode; stop strings cut the text, across token boundaries."""
import random

import pytest

from redknot.engine.detokenizer import IncrementalDetokenizer
from redknot.models.deepseek_v4 import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


TEXTS = ["Hello world, this is RedKnot.", "多语言文本：你好，世界！🙂🚀 mixed with ASCII", "a\n\tb  c\u00e9\u00e8 ∑∫ end"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    rng = random.Random(0)
    d = IncrementalDetokenizer(tok)
    i = 0
    while i < len(ids):
        n = rng.randrange(1, 4)
        d.add(ids[i:i + n])
        assert tok.decode(ids[:i + n]).startswith(d.text)
        i += n
    assert d.finish() == tok.decode(ids) == text


def test_random_tokens_match_full_decode(tok):
    rng = random.Random(1)
    ids = [rng.randrange(0, 128000) for _ in range(300)]
    d = IncrementalDetokenizer(tok)
    for t in ids:
        d.add([t])
    assert d.finish() == tok.decode(ids)


def test_stop_string_cuts_text_even_across_tokens(tok):
    ids = tok.encode("The answer is 42. STOP here and more text")
    d = IncrementalDetokenizer(tok, stop=["STOP", "never"])
    hit = None
    fed = 0
    for t in ids:
        fed += 1
        hit = d.add([t])
        if hit:
            break
    assert hit == "STOP" and d.text == "The answer is 42. " and d.stopped
    assert fed < len(ids)
    assert d.add([5]) is None and d.finish() == "The answer is 42. "


def test_earliest_stop_wins(tok):
    d = IncrementalDetokenizer(tok, stop=["b c", "a"])
    assert d.add(tok.encode("x a b c")) == "a" and d.text == "x "
