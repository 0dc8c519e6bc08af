"""Flattening the resolved config into MLflow params without silent truncation."""
from redknot.tracking import params as P


def test_flatten_keeps_override_spelling():
    flat = P.flatten({"a": {"b": 1, "c": [1, "x"], "d": None, "e": True, "f": {}}, "g": "text", "h": 0.3})
    assert flat == {"a.b": "1", "a.c": '[1, "x"]', "a.d": "null", "a.e": "true", "a.f": "{}", "g": "text",
                    "h": "0.3"}


def test_values_that_fit_are_untouched_and_long_ones_are_marked_not_cut():
    flat = {"short": "x" * 6000, "long": "y" * 6001}
    fitted = P.fit(flat)
    assert fitted.params["short"] == "x" * 6000
    assert fitted.params["long"] == "<6001 characters, over MLflow's limit: full value in artifact params/long.txt>"
    assert fitted.elided == {"long": "y" * 6001}
    assert fitted.renamed == {}


def test_long_and_odd_keys_are_shortened_and_mapped_back():
    key = "suite.max_new_tokens." + "k" * 300
    fitted = P.fit({key: "1", "model.synthetic.architecture.rope scaling?": "2"})
    (long_key,) = [k for k in fitted.params if k.startswith("suite.")]
    assert len(long_key) == P.MAX_KEY_LENGTH and fitted.renamed[long_key] == key
    assert fitted.renamed["model.synthetic.architecture.rope scaling_"] == "model.synthetic.architecture.rope scaling?"


def test_batches_respect_the_batch_limit():
    items = {str(i): i for i in range(250)}
    sizes = [len(b) for b in P.batches(items, P.MAX_PARAMS_TAGS_PER_BATCH)]
    assert sizes == [100, 100, 50]


def test_limits_match_mlflow():
    from mlflow.utils import validation

    assert P.MAX_KEY_LENGTH == validation.MAX_ENTITY_KEY_LENGTH
    assert P.MAX_PARAM_VALUE_LENGTH == validation.MAX_PARAM_VAL_LENGTH
    assert P.MAX_TAG_VALUE_LENGTH == validation.MAX_TAG_VAL_LENGTH
    assert P.MAX_PARAMS_TAGS_PER_BATCH == validation.MAX_PARAMS_TAGS_PER_BATCH
    assert P.MAX_METRICS_PER_BATCH == validation.MAX_METRICS_PER_BATCH
