"""The runner against the engine double: admission caps seen from the engine, engine-side timings, failures."""
import pytest

from redknot.bench.freeze import freeze
from redknot.bench.runner import CaseJob, Runner
from redknot.config.schema import ModelConfig
from redknot.engine import SamplingParams

from .fake_engine import FakeLLM, prompt_key
from .support import answer_book, smoke_suite


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return freeze(smoke_suite(), ModelConfig(), tmp_path_factory.mktemp("cache")).inputs


def _jobs(inputs):
    return [CaseJob(c, inputs.load_ids(c).tolist()) for c in inputs.cases]


def _run(inputs, tokenizer, admission, dp=1, fail=None, timeout_s=600.0):
    book = answer_book(inputs)
    engine = FakeLLM(tokenizer, lambda ids: book[prompt_key(ids)], fail=fail)
    runner = Runner(engine, lambda n: SamplingParams(max_tokens=n), admission, dp, timeout_s,
                    clock=lambda: engine.now)
    outcomes = []
    runner.run(_jobs(inputs), outcomes.append)
    return engine, outcomes


@pytest.mark.parametrize("admission, dp", [(1, 1), (3, 1), (2, 2)])
def test_active_requests_per_rank_never_exceed_admission(inputs, tokenizer, admission, dp):
    engine, outcomes = _run(inputs, tokenizer, admission, dp)
    assert len(outcomes) == len(inputs.cases) and all(o.status == "ok" for o in outcomes)
    rank_of = {f"case:{o.entry.case_id}": o.dp_rank for o in outcomes}
    per_step = [[sum(rank_of[r] == rank for r in active) for rank in range(dp)] for active in engine.active_log]
    assert max(max(counts) for counts in per_step) == admission  # the cap is reached ...
    assert all(count <= admission for counts in per_step for count in counts)  # ... and never passed
    assert max(len(active) for active in engine.active_log) == admission * dp


def test_ttft_and_throughput_come_from_engine_timestamps(inputs, tokenizer):
    engine, outcomes = _run(inputs, tokenizer, admission=1)
    from redknot.bench.measure import request_timings

    for outcome in outcomes:
        t = request_timings(outcome.output.metrics)
        # Alone in the engine: the first step prefills 2,048 tokens and yields the first token.
        assert t.ttft_s == pytest.approx(2048 * FakeLLM.PREFILL_S_PER_TOKEN)
        assert t.queue_s == 0.0
        n = len(outcome.output.token_ids)
        assert t.e2e_s == pytest.approx(2048 * FakeLLM.PREFILL_S_PER_TOKEN + (n - 1) * FakeLLM.DECODE_S_PER_TOKEN)
        assert t.prefill_tok_s == pytest.approx(1 / FakeLLM.PREFILL_S_PER_TOKEN)
        if n > 1:
            assert t.decode_tok_s == pytest.approx(1 / FakeLLM.DECODE_S_PER_TOKEN)


def test_failures_are_per_case_and_the_run_goes_on(inputs, tokenizer):
    ids = [f"case:{c.case_id}" for c in inputs.cases]
    fail = {ids[1]: "oom", ids[3]: "error", ids[5]: "hang", ids[7]: "raise"}
    engine, outcomes = _run(inputs, tokenizer, admission=1, fail=fail, timeout_s=0.05)
    status = {f"case:{o.entry.case_id}": o.status for o in outcomes}
    assert len(outcomes) == len(inputs.cases)
    assert status[ids[1]] == "oom" and status[ids[3]] == "error" and status[ids[5]] == "timeout"
    assert status[ids[7]] == "error"
    assert [s for r, s in status.items() if r not in fail] == ["ok"] * (len(ids) - 4)
    assert ids[5] in engine.aborted and ids[7] in engine.aborted
    errors = {f"case:{o.entry.case_id}": o.error for o in outcomes}
    assert "out of memory" in errors[ids[1]] and "suite.request_timeout_s" in errors[ids[5]]
    assert "simulated engine failure" in errors[ids[7]]


def test_a_refused_request_fails_alone(inputs, tokenizer):
    class Refusing(FakeLLM):
        def add_request(self, req_id, prompt_token_ids, params):
            if req_id.endswith("0001"):
                raise ValueError("prompt too long for model.max_position")
            super().add_request(req_id, prompt_token_ids, params)

    book = answer_book(inputs)
    engine = Refusing(tokenizer, lambda ids: book[prompt_key(ids)])
    outcomes = []
    Runner(engine, lambda n: SamplingParams(max_tokens=n), 1).run(_jobs(inputs), outcomes.append)
    refused = {o.entry.case_id for o in outcomes if o.status == "error"}
    assert len(outcomes) == len(inputs.cases)
    assert refused == {c.case_id for c in inputs.cases if c.case_id.endswith("0001")}
    assert all("max_position" in o.error for o in outcomes if o.status == "error")
