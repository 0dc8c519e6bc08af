"""A tracking store that is down never stops or hangs a benchmark: refused at start in seconds, absorbed
mid-run, left on disk at the end; runs whose process died are closed at the next start. Real MLflow stores:
SQLite in tmp, and an HTTP address on this machine where no server listens."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from mlflow.tracking import MlflowClient

from redknot.tracking import open_tracker
from redknot.tracking.resilient import BACKLOG_FILE
from redknot.tracking.backend_store import TrackingUnavailable
from tracking_testutil import client, make_ctx, runs


def dead_uri() -> str:
    """An HTTP address on this machine with nothing listening (the port is free when chosen)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_an_unreachable_server_is_refused_at_start_within_seconds(tmp_path):
    ctx = make_ctx(tmp_path, "mode=prepare", f"tracking.uri={dead_uri()}")
    started = time.perf_counter()
    with pytest.raises(TrackingUnavailable) as err:
        with open_tracker(ctx):
            pytest.fail("the body must not run without its store")
    assert time.perf_counter() - started < 15
    message = str(err.value)
    assert "tracking.uri=http://127.0.0.1:" in message and "tracking.enabled=false" in message
    assert "Connection refused" in message or "connect" in message.lower()  # the store, not our settings
    assert os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") is None  # the run's settings are not left behind


def test_the_command_line_fails_fast_with_exit_1(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DEEPINFER_"))}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "redknot", "mode=prepare", f"tracking.uri={dead_uri()}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and time.perf_counter() - started < 60
    assert "error: tracking.uri=http://127.0.0.1:" in out.stderr and "Traceback" not in out.stderr


def test_a_file_store_uri_says_what_mlflow_needs(tmp_path):
    ctx = make_ctx(tmp_path, "mode=prepare", f"tracking.uri=file://{tmp_path}/mlruns")
    with pytest.raises(TrackingUnavailable, match="MLFLOW_ALLOW_FILE_STORE=true"):
        with open_tracker(ctx):
            pass


def test_a_store_that_goes_down_mid_run_neither_blocks_nor_loses_metrics(tmp_path):
    ctx = make_ctx(tmp_path, "mode=prepare", "tracking.run_name=outage")
    with open_tracker(ctx) as tracker:
        store = tracker.inner.client
        tracker.inner.client = MlflowClient(dead_uri())  # the server is gone
        started = time.perf_counter()
        for step in range(20):
            tracker.log_metrics({"request.ttft_s": float(step)}, step=step)
        assert time.perf_counter() - started < 1.0  # the benchmark never waits on the store
        time.sleep(1.5)
        assert tracker.degraded and tracker.failures >= 1
        tracker.inner.client = store  # ... and back
        assert tracker.flush(30)
    (run,) = [r for r in runs(tmp_path) if r.info.run_name == "outage"]
    history = client(tmp_path).get_metric_history(run.info.run_id, "request.ttft_s")
    assert sorted(m.step for m in history) == list(range(20))
    assert run.info.status == "FINISHED" and "failed deliveries" in run.data.tags["redknot.tracking_gaps"]
    assert not (ctx.run_dir / BACKLOG_FILE).exists()


def test_a_store_still_down_at_the_end_leaves_a_backlog_and_returns(tmp_path):
    ctx = make_ctx(tmp_path, "mode=prepare", "tracking.run_name=gone", "tracking.flush_timeout_s=1")
    started = time.perf_counter()
    with open_tracker(ctx) as tracker:
        tracker.inner.client = MlflowClient(dead_uri())
        tracker.log_metrics({"score.overall": 42.0})
    assert time.perf_counter() - started < 20 and tracker.incomplete
    ops = [json.loads(line) for line in (ctx.run_dir / BACKLOG_FILE).read_text().splitlines()]
    assert {"log_metrics", "finish"} <= {op["op"] for op in ops}
    assert any(op["args"][0] == {"score.overall": 42.0} for op in ops if op["op"] == "log_metrics")


def test_a_run_whose_process_was_killed_is_closed_at_the_next_start(tmp_path):
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from pathlib import Path
        from tracking_testutil import make_ctx
        from redknot.tracking import open_tracker
        ctx = make_ctx(Path({str(tmp_path)!r}), "mode=prepare", "tracking.run_name=killed")
        with open_tracker(ctx) as tracker:
            tracker.flush(30)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == -9, out.stderr[-2000:]
    (killed,) = [r for r in runs(tmp_path) if r.info.run_name == "killed"]
    assert killed.info.status == "RUNNING"  # what MLflow is left with
    with open_tracker(make_ctx(tmp_path, "mode=prepare", "tracking.run_name=next")):
        pass
    (killed,) = [r for r in runs(tmp_path) if r.info.run_name == "killed"]
    assert killed.info.status == "KILLED" and "is gone; marked KILLED" in killed.data.tags["redknot.stale"]


def test_an_unwritable_store_is_refused_at_start(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    ctx = make_ctx(tmp_path, "mode=prepare", f"tracking.uri=sqlite:///{blocker}/mlflow.db")
    with pytest.raises(TrackingUnavailable) as err:
        with open_tracker(ctx):
            pass
    assert f"tracking.uri=sqlite:///{blocker}/mlflow.db: the MLflow store cannot be used" in str(err.value)


def test_a_full_disk_is_one_line_naming_the_file_and_keeps_what_was_written(tmp_path):
    from tracking_testutil import start_app

    proc = start_app(f"output.root={tmp_path}", "seed=97", cwd=tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "records.jsonl: No space left on device; everything written before this point is kept in" in out
    assert "Traceback" not in out
    (body,) = tmp_path.glob("*/*/body.txt")
    assert body.read_text() == "seed=97\n"
