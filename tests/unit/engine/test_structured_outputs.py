"""Structured outputs through the engine with the tiny random model: every constrained output
parses and validates, unconstrained neighbours in the same batch do not, a bad grammar fails
only its own request with the compiler's message."""
import json
import re

import jsonschema
from llm_testutil import run_all

from redknot.engine import SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "score": {"type": "integer", "minimum": -5, "maximum": 500}},
          "required": ["name", "score"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,5}-[0-9]{3}(\.[0-9])?"
EBNF = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'
EBNF_RE = r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]"


def _spec(kind, schema):
    return SamplingParams(max_tokens=60, temperature=0.7, seed=3,
                          structured_output={"schema_type": kind, "schema": schema})


def test_constrained_outputs_validate_in_a_mixed_batch(engines):
    llm = engines()
    prompts, params = {}, {}
    for i in range(3):
        prompts[f"json{i}"], params[f"json{i}"] = [0, 10 + i, 20], _spec("json", SCHEMA)
        prompts[f"re{i}"], params[f"re{i}"] = [0, 30 + i], _spec("regex", REGEX)
        prompts[f"ebnf{i}"], params[f"ebnf{i}"] = [0, 40 + i, 7], _spec("ebnf", EBNF)
        prompts[f"free{i}"], params[f"free{i}"] = [0, 10 + i, 20], SamplingParams(max_tokens=20, seed=i,
                                                                                 temperature=0.7)
    prompts["bad"], params["bad"] = [0, 5], _spec("regex", "[0-9")
    out, _ = run_all(llm, prompts, params)
    for i in range(3):
        assert out[f"json{i}"].finish_reason == "stop"
        jsonschema.validate(json.loads(out[f"json{i}"].text), SCHEMA)
        assert re.fullmatch(REGEX, out[f"re{i}"].text), out[f"re{i}"].text
        assert re.fullmatch(EBNF_RE, out[f"ebnf{i}"].text), out[f"ebnf{i}"].text
        free = out[f"free{i}"].text
        assert not re.fullmatch(REGEX, free) and not re.fullmatch(EBNF_RE, free)
        assert out[f"free{i}"].finish_reason == "length"
    bad = out["bad"]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert "regex does not compile" in bad.error and "Regex parsing error" in bad.error


def test_unconstrained_json_request_does_not_parse(engines):
    out, _ = run_all(engines(), {"x": [0, 10, 20]}, SamplingParams(max_tokens=20, seed=0, temperature=0.7))
    try:
        jsonschema.validate(json.loads(out["x"].text), SCHEMA)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    assert not valid
