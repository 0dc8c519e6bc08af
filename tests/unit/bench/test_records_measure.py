"""Records survive a torn write; timings follow the engine's counters (hand-computed cases)."""
import json

import pytest

from redknot.bench.measure import request_timings
from redknot.bench.records import RecordWriter, RequestRecord, finished_case_ids, latest_by_case, read_records
from redknot.engine.outputs import RequestMetrics


def _record(case_id, status, score=None):
    return RequestRecord(case_id=case_id, dataset="d", row_id="r", suite="s", status=status, prompt_tokens=8,
                         max_new_tokens=4, ids_sha256="x", inputs_address="a", config_hash="c", git_sha="g",
                         score=score)


def test_torn_last_line_is_dropped_and_appending_stays_line_aligned(tmp_path):
    path = tmp_path / "records.jsonl"
    with RecordWriter(path) as writer:
        writer.write(_record("a", "ok", 1.0))
    with open(path, "a") as handle:
        handle.write('{"case_id": "b", "sta')  # the process died mid-line
    records, problems = read_records(path)
    assert [r["case_id"] for r in records] == ["a"] and "incomplete last line" in problems[0]
    with RecordWriter(path) as writer:
        writer.write(_record("b", "ok", 0.0))
    records, problems = read_records(path)
    assert [r["case_id"] for r in records] == ["a", "b"] and not problems
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_skipped_cases_are_retried_and_final_records_win():
    records = [vars(_record("a", "skipped")), vars(_record("b", "oom")), vars(_record("a", "ok", 1.0)),
               vars(_record("c", "ok", 0.5)), vars(_record("c", "skipped"))]
    latest = latest_by_case(records)
    assert latest["a"]["status"] == "ok" and latest["c"]["status"] == "ok"
    assert finished_case_ids([vars(_record("a", "skipped"))]) == set()
    assert finished_case_ids(records) == {"a", "b", "c"}


def test_bad_status_is_refused():
    with pytest.raises(ValueError, match="status='done'; allowed: ok, error, timeout, oom, skipped"):
        _record("a", "done")


def test_timings_from_engine_metrics():
    # 1,000 prompt tokens scheduled 0.5 s after arrival, first token 2 s later, 11 tokens by t=13.
    m = RequestMetrics(arrival_time=100.0, scheduled_time=100.5, first_token_time=102.5, finish_time=113.0,
                       num_prompt_tokens=1000, num_output_tokens=11, num_draft_proposed=12, num_draft_accepted=6)
    t = request_timings(m)
    assert t.ttft_s == 2.5 and t.e2e_s == 13.0 and t.queue_s == 0.5
    assert t.prefill_tok_s == 500.0
    assert t.decode_tok_s == pytest.approx(10 / 10.5)
    # 10 decoded tokens, 6 of them accepted drafts -> 4 verify steps -> 2.5 tokens per step
    assert t.accept_len == 2.5 and t.draft_proposed == 12


def test_timings_of_a_request_that_failed_before_its_first_token():
    t = request_timings(RequestMetrics(arrival_time=1.0, scheduled_time=1.5, finish_time=2.0))
    assert t.ttft_s is None and t.prefill_tok_s is None and t.decode_tok_s is None and t.e2e_s == 1.0
    assert request_timings(None).ttft_s is None
