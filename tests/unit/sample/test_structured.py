"""Structured outputs with the V4 tokenizer: random logits + grammar mask always yield valid text."""
import json
import re

import jsonschema
import pytest
import torch

from redknot.sample.params import normalize_structured_output
from redknot.models.deepseek_v4 import load_tokenizer
from redknot.sample import GrammarError, Sampler, SamplingRow, StructuredOutputManager
from redknot.sample.params import SamplingParams

VOCAB = 129280
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"(yes|no)-[0-9]{2,4}"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "z" [0-9]'


@pytest.fixture(scope="module")
def manager():
    tok = load_tokenizer()
    return tok, StructuredOutputManager(tok, VOCAB, [tok.eos_id])


def _generate(manager, spec, seed, max_steps=60):
    tok, mgr = manager
    state = mgr.new_matcher(normalize_structured_output(spec))
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(torch.device("cpu"))
    out = []
    for i in range(max_steps):
        logits = torch.randn(1, VOCAB, generator=g) * 3  # [1, V]
        t = sampler.sample(logits, [SamplingRow("r", SamplingParams(temperature=1.0), seed, i)],
                           bitmask=mgr.bitmask([state]))[0]
        assert state.accept(t)
        if t == tok.eos_id:
            break
        out.append(t)
    assert state.is_terminated, "grammar did not finish"
    return tok.decode(out)


@pytest.mark.parametrize("seed", range(4))
def test_outputs_validate(manager, seed):
    text = _generate(manager, {"schema_type": "json", "schema": SCHEMA}, seed)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert re.fullmatch(REGEX, _generate(manager, {"schema_type": "regex", "schema": REGEX}, seed))
    assert re.fullmatch(r"\((?:[a-c]|z[0-9])(?:,(?:[a-c]|z[0-9]))*\)",
                        _generate(manager, {"schema_type": "ebnf", "schema": EBNF}, seed, max_steps=200))


def test_unconstrained_random_logits_do_not_validate(manager):
    tok, _ = manager
    g = torch.Generator().manual_seed(0)
    text = tok.decode(torch.randn(20, VOCAB, generator=g).argmax(1).tolist())
    assert not re.fullmatch(REGEX, text)
    with pytest.raises(ValueError):
        json.loads(text)


def test_compiled_once_and_errors_carry_compiler_message(manager):
    _, mgr = manager
    spec = normalize_structured_output({"schema_type": "regex", "schema": "[0-9]+x"})
    before = mgr.num_compiled
    mgr.new_matcher(spec)
    mgr.new_matcher(spec)
    assert mgr.num_compiled == before + 1
    with pytest.raises(GrammarError, match="regex does not compile: .*parenthesis is not closed"):
        mgr.compile(normalize_structured_output({"schema_type": "regex", "schema": "(ab"}))
    with pytest.raises(GrammarError, match="ebnf does not compile: .*EBNF parser error"):
        mgr.compile(normalize_structured_output({"schema_type": "ebnf", "schema": "root ::= "}))
    with pytest.raises(GrammarError, match="json does not compile"):
        mgr.compile(normalize_structured_output({"schema_type": "json", "schema": '{"type": 5}'}))


def test_unconstrained_rows_allow_everything(manager):
    _, mgr = manager
    state = mgr.new_matcher(normalize_structured_output({"schema_type": "regex", "schema": "a+"}))
    mask = mgr.bitmask([None, state])
    assert int((mask[0] == -1).sum()) == mask.shape[1]
    assert mgr.bitmask([None, None]) is None
