"""SamplingParams validation names the field, the value and what is allowed."""
import pytest

from redknot.sample.params import SamplingParams


@pytest.mark.parametrize("kw, field", [
    ({"max_tokens": 0}, "max_tokens=0"), ({"max_tokens": 1.5}, "max_tokens=1.5"),
    ({"temperature": -0.1}, "temperature=-0.1"), ({"top_k": -1}, "top_k=-1"),
    ({"top_p": 0.0}, "top_p=0.0"), ({"top_p": 1.2}, "top_p=1.2"), ({"min_p": 2}, "min_p=2"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"), ({"stop_token_ids": "ab"}, "stop_token_ids"),
    ({"stop": ""}, "stop=''"), ({"stop": [1]}, "stop=[1]"), ({"seed": "x"}, "seed='x'"),
    ({"ignore_eos": 1}, "ignore_eos=1"), ({"structured_output": "abc"}, "structured_output="),
    ({"structured_output": {"schema_type": "yaml", "schema": "x"}}, "schema_type='yaml'"),
    ({"structured_output": {"schema_type": "regex", "schema": ""}}, "schema=''"),
    ({"structured_output": {"schema_type": "regex", "schema": "a", "x": 1}}, "unknown keys"),
    ({"logits_processors": [3]}, "logits_processors"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match="SamplingParams.*" + field.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kw)


def test_normalisation():
    p = SamplingParams(stop="END", structured_output={"schema_type": "json", "schema": {"type": "integer"}})
    assert p.stop == ["END"]
    assert p.structured_output == {"schema_type": "json", "schema": '{"type": "integer"}'}
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
