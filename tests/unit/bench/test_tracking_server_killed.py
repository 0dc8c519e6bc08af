"""A real ``mlflow server`` killed in the middle of a suite: every case still runs and is recorded, the run
returns within seconds of its end, and what the store missed is left in the run directory. Slow: the server
takes tens of seconds to start on a small machine."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from redknot.bench.benchmark import BenchmarkRun
from redknot.bench.freeze import freeze
from redknot.bench.records import RECORDS_FILE, read_records
from redknot.config.schema import ModelConfig, TrackingConfig
from redknot.tracking.resilient import BACKLOG_FILE

from .fake_engine import FakeLLM, prompt_key
from .support import answer_book, make_ctx, smoke_suite


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def server(tmp_path):
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp_path}/server.db", "--workers", "1",
                             "--default-artifact-root", str(tmp_path / "server-artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    import urllib.request

    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mlflow server did not start")
    yield f"http://127.0.0.1:{port}", proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_a_server_killed_mid_suite_stops_nothing(tmp_path, server, tokenizer):
    from redknot.tracking import open_tracker

    uri, proc = server
    cache = tmp_path / "outputs" / "cache"
    inputs = freeze(smoke_suite(), ModelConfig(), cache).inputs
    book = answer_book(inputs)

    class KillsTheServer(FakeLLM):
        def step(self):
            if self.finished_count == 4 and proc.poll() is None:  # 1 warm-up + 3 cases done
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return super().step()

    from redknot.bench.benchmark import RunSetup
    from redknot.sample.params import SamplingParams

    setup = RunSetup(lambda cfg: KillsTheServer(tokenizer, lambda ids: book[prompt_key(ids)]),
                     lambda cfg: lambda n: SamplingParams(max_tokens=n))
    ctx = make_ctx(tmp_path / "outputs" / "run", cache)
    ctx.cfg.tracking = TrackingConfig(enabled=True, uri=uri, experiment="killed-server", flush_timeout_s=3.0)
    ctx.run_dir.mkdir(parents=True)
    with open_tracker(ctx) as tracker:
        started = time.perf_counter()
        tracker.exit_code = BenchmarkRun(ctx, tracker, setup).execute()
        suite_seconds = time.perf_counter() - started
    total = time.perf_counter() - started
    assert proc.poll() is not None  # the server really died mid-suite
    assert tracker.exit_code == 0 and suite_seconds < 30 and total < suite_seconds + 20
    records, _ = read_records(ctx.run_dir / RECORDS_FILE)
    assert len(records) == 10 and {r["status"] for r in records} == {"ok"}
    assert json.loads((ctx.run_dir / "results.json").read_text())["completed"] == 10
    assert tracker.degraded and tracker.incomplete
    ops = [json.loads(line)["op"] for line in (ctx.run_dir / BACKLOG_FILE).read_text().splitlines()]
    assert "finish" in ops and "log_metrics" in ops
