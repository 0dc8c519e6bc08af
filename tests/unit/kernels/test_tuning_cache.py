"""The persistent tuning store: a later process reuses a measured choice instead of timing again, only for
the same GPU / torch / triton; corrupt, foreign, disabled and stale cases all fall back to measuring.

No CUDA here: ``ConfigTuner._measure`` (the CUDA branch of ``pick``) is driven directly, with triton's
``do_bench`` replaced by fixed per-candidate times so the fastest candidate is known in advance."""
import json
import logging
import os

import pytest
import torch
import triton
import triton.testing

from redknot.kernels import tuning_cache
from redknot.kernels.triton._common import ConfigTuner

CPU = torch.device("cpu")
TIMES = {"a": 3.0, "b": 1.0, "c": 2.0}   # ms: "b" is the fastest; "a" is the untuned default


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
    tuning_cache.reset()
    path = tmp_path / "choices.json"
    tuning_cache.set_path(str(path))
    tuning_cache.set_seed_path(None)   # the shipped seed has its own tests (test_tuning_seed.py)
    yield path
    tuning_cache.reset()


class Bench:
    """Stands in for ``triton.testing.do_bench``: runs the candidate once, returns its fixed time."""

    def __init__(self, monkeypatch):
        self.calls = 0
        monkeypatch.setattr(triton.testing, "do_bench", self)

    def __call__(self, fn, **_):
        self.calls += 1
        return fn()


def _run(cfg):
    return TIMES[cfg]


def _fresh_process():
    """What a new process sees: no choices in memory, the file read again."""
    path = tuning_cache.current_path()
    tuning_cache.reset()
    tuning_cache.set_path(path)
    return ConfigTuner("toy", ["a", "b", "c"])


def test_a_measured_choice_is_reused_by_the_next_process(cache, monkeypatch):
    bench = Bench(monkeypatch)
    key = ((7168, 4096), 32, "torch.bfloat16")
    assert ConfigTuner("toy", ["a", "b", "c"])._measure(key, _run, CPU) == "b"
    assert bench.calls == 3
    data = json.loads(cache.read_text())
    assert data["format"] == tuning_cache.FORMAT
    (env, tuners), = data["entries"].items()
    assert f"triton {triton.__version__}" in env and f"torch {torch.__version__}" in env
    assert tuners["toy"][repr(key)]["choice"] == "'b'"

    tuner, ran = _fresh_process(), []
    got = tuner._measure(key, lambda cfg: ran.append(cfg), CPU)
    assert got == "b" and bench.calls == 3      # nothing timed again
    assert ran == ["b"]                          # the first-use guard ran the stored choice once
    assert tuner.choices[key] == "b" and sorted(tuner.timings[key], key=lambda r: r[1])[0] == ("b", 1.0)
    assert [p for p in os.listdir(cache.parent) if p.endswith(".tmp")] == []


def test_another_triton_version_misses(cache, monkeypatch):
    bench = Bench(monkeypatch)
    monkeypatch.setattr(tuning_cache, "environment", lambda device: "H200|sm90|torch 2.11|triton 3.6.0")
    ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)
    assert bench.calls == 3
    _fresh_process()._measure(("k",), _run, CPU)
    assert bench.calls == 3
    monkeypatch.setattr(tuning_cache, "environment", lambda device: "H200|sm90|torch 2.11|triton 3.7.0")
    assert _fresh_process()._measure(("k",), _run, CPU) == "b"
    assert bench.calls == 6
    assert len(json.loads(cache.read_text())["entries"]) == 2   # both environments kept


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 99, "entries": {}}), "[1, 2]"])
def test_a_corrupt_or_foreign_file_is_ignored_with_one_warning(cache, monkeypatch, caplog, text):
    bench = Bench(monkeypatch)
    cache.write_text(text)
    tuner = ConfigTuner("toy", ["a", "b", "c"])
    with caplog.at_level(logging.WARNING, logger=tuning_cache.__name__):
        assert tuner._measure(("k1",), _run, CPU) == "b"
        assert tuner._measure(("k2",), _run, CPU) == "b"
    assert bench.calls == 6
    assert len([r for r in caplog.records if r.name == tuning_cache.__name__]) == 1
    assert set(json.loads(cache.read_text())["entries"].popitem()[1]["toy"]) == {"('k1',)", "('k2',)"}


def test_the_switch_disables_the_store(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tuning_cache.reset()
    bench = Bench(monkeypatch)
    try:
        monkeypatch.setenv(tuning_cache.ENV_VAR, "off")
        assert tuning_cache.store() is None
        ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)
        _fresh_process()._measure(("k",), _run, CPU)
        assert bench.calls == 6 and os.listdir(tmp_path) == []
        monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "elsewhere.json"))
        tuning_cache.reset()
        ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)
        assert os.listdir(tmp_path) == ["elsewhere.json"]
        monkeypatch.delenv(tuning_cache.ENV_VAR)
        tuning_cache.reset()
        ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)
        assert (tmp_path / tuning_cache.DEFAULT_PATH).is_file()   # default: under outputs/ of the working dir
    finally:
        tuning_cache.reset()


def test_off_cuda_pick_neither_reads_nor_writes(cache, monkeypatch):
    bench = Bench(monkeypatch)
    assert ConfigTuner("toy", ["a", "b", "c"]).pick(("k",), _run, CPU) == "a"
    assert bench.calls == 0 and not cache.exists()


def test_a_stale_variant_name_falls_back_to_tuning(cache, monkeypatch):
    bench = Bench(monkeypatch)
    ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)
    tuning_cache.reset()
    tuning_cache.set_path(str(cache))
    renamed = ConfigTuner("toy", ["a", "b2", "c"])   # "b" no longer exists
    times = {"a": 3.0, "b2": 0.5, "c": 2.0}
    assert renamed._measure(("k",), lambda cfg: times[cfg], CPU) == "b2"
    assert bench.calls == 6
    assert json.loads(cache.read_text())["entries"].popitem()[1]["toy"]["('k',)"]["choice"] == "'b2'"


def test_a_stored_choice_that_fails_its_first_use_is_tuned_again(cache, monkeypatch):
    bench = Bench(monkeypatch)
    ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)

    def run(cfg):
        if cfg == "b":
            raise RuntimeError("out of resources")
        return TIMES[cfg]
    assert _fresh_process()._measure(("k",), run, CPU) == "c"
    assert bench.calls == 6


def test_a_candidate_added_after_the_measurement_is_compared(cache, monkeypatch):
    """A stored choice predating a candidate does not hide it: the new candidate is timed against the stored
    choice (two timings, not one per candidate), and the new entry then serves the next process untimed."""
    bench = Bench(monkeypatch)
    ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), _run, CPU)
    assert bench.calls == 3
    times = {**TIMES, "d": 0.5}
    ran = []
    for _ in range(2):
        tuning_cache.reset()
        tuning_cache.set_path(str(cache))
        assert ConfigTuner("toy", ["a", "b", "c", "d"])._measure(
            ("k",), lambda cfg: ran.append(cfg) or times[cfg], CPU) == "d"
    assert bench.calls == 3 + 2 and set(ran) == {"b", "d"}   # the stored choice "b" and the new "d" only
    entry = json.loads(cache.read_text())["entries"].popitem()[1]["toy"]["('k',)"]
    assert entry["choice"] == "'d'" and dict(entry["timings"]) == {"'a'": 3.0, "'b'": 1.0, "'c'": 2.0, "'d'": 0.5}


def test_an_added_candidate_that_is_slower_leaves_the_choice(cache, monkeypatch):
    """The added candidate loses to the stored choice: the choice stays, every candidate keeps a time, a
    candidate that failed before stays failed (so no later process takes it for a new one), and a stored
    choice that no longer runs sends the class to a full timing."""
    bench = Bench(monkeypatch)

    def run(cfg):
        if cfg == "c":
            raise RuntimeError("out of resources")
        return {**TIMES, "d": 5.0}[cfg]
    ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), run, CPU)
    assert bench.calls == 3
    tuning_cache.reset()
    tuning_cache.set_path(str(cache))
    assert ConfigTuner("toy", ["a", "b", "c", "d"])._measure(("k",), run, CPU) == "b"
    assert bench.calls == 3 + 2
    entry = json.loads(cache.read_text())["entries"].popitem()[1]["toy"]["('k',)"]
    assert entry["choice"] == "'b'" and {t for t, _ in entry["timings"]} == {"'a'", "'b'", "'d'"}
    assert entry["failed"] == ["'c'"]
    assert tuning_cache.untimed(entry, ["a", "b", "c", "d"]) == []

    def broken(cfg):
        if cfg in ("b", "c"):
            raise RuntimeError("no longer builds")
        return {**TIMES, "e": 4.0}[cfg]
    tuning_cache.reset()
    tuning_cache.set_path(str(cache))
    assert ConfigTuner("toy", ["a", "b", "c", "e"])._measure(("k",), broken, CPU) == "a"
    assert bench.calls == 3 + 2 + 2 + 4   # "b" and "e" side by side, then (b failing) all four in full


def test_a_candidate_that_failed_counts_as_measured(cache, monkeypatch):
    """A candidate that did not run is stored as failed, so the next process does not take it for a new one."""
    bench = Bench(monkeypatch)

    def run(cfg):
        if cfg == "c":
            raise RuntimeError("out of resources")
        return TIMES[cfg]
    assert ConfigTuner("toy", ["a", "b", "c"])._measure(("k",), run, CPU) == "b"
    entry = json.loads(cache.read_text())["entries"].popitem()[1]["toy"]["('k',)"]
    assert entry["failed"] == ["'c'"] and bench.calls == 3
    assert _fresh_process()._measure(("k",), run, CPU) == "b"
    assert bench.calls == 3
    assert tuning_cache.untimed({"choice": "'b'", "timings": [["'a'", 3.0], ["'b'", 1.0]]}, ["a", "b", "c"]) == ["'c'"]


def test_parallel_writers_merge(cache):
    one, two = tuning_cache.TuningStore(str(cache)), tuning_cache.TuningStore(str(cache))
    one.lookup("env", "toy", "k0")
    two.lookup("env", "toy", "k0")          # both read the (missing) file before either writes
    one.record("env", "toy", "k1", "'a'", [("'a'", 1.0)])
    two.record("env", "toy", "k2", "'b'", [("'b'", 1.0)])
    assert set(json.loads(cache.read_text())["entries"]["env"]["toy"]) == {"k1", "k2"}


def test_a_runs_cache_dir_holds_the_store_unless_the_variable_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
    tuning_cache.reset()
    try:
        tuning_cache.use_cache_dir(str(tmp_path / "cache"))
        assert tuning_cache.current_path() == str(tmp_path / "cache" / "tuning" / "kernel_choices.json")
        tuning_cache.reset()
        monkeypatch.setenv(tuning_cache.ENV_VAR, "0")
        tuning_cache.use_cache_dir(str(tmp_path / "cache"))
        assert tuning_cache.current_path() is None and tuning_cache.store() is None
    finally:
        tuning_cache.reset()


def test_engine_kernel_tuning_store_false_turns_the_store_off(tmp_path, monkeypatch):
    """``engine.kernel_tuning_store: false``: no store, not even the default path under ``outputs/``;
    the variable still wins when it is set."""
    from redknot.config.schema import EngineConfig

    assert EngineConfig().kernel_tuning_store is True
    monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
    tuning_cache.reset()
    try:
        tuning_cache.use_cache_dir(str(tmp_path / "cache"), enabled=False)
        assert tuning_cache.current_path() is None and tuning_cache.store() is None
        tuning_cache.reset()
        monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "mine.json"))
        tuning_cache.use_cache_dir(str(tmp_path / "cache"), enabled=False)
        assert tuning_cache.current_path() == str(tmp_path / "mine.json")
    finally:
        tuning_cache.reset()


@pytest.mark.gpu
def test_on_cuda_a_second_process_reads_the_choice_instead_of_timing(tmp_path):
    """Two real processes on the GPU: the first times ``linear_mx_decode``-style toy candidates and stores
    the choice; the second finds it (no ``do_bench`` call) under the same GPU / torch / triton key."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import json, sys, torch, triton.testing
        from redknot.kernels.triton._common import ConfigTuner
        calls = []
        real = triton.testing.do_bench
        triton.testing.do_bench = lambda fn, **kw: (calls.append(1), real(fn, **kw))[1]
        x = torch.randn(256, 256, device="cuda")
        tuner = ConfigTuner("toy_cuda", [1, 2, 4])
        got = tuner.pick(("k",), lambda reps: [x @ x for _ in range(reps)], torch.device("cuda"))
        print(json.dumps({"choice": got, "timed": len(calls), "as": tuner.timed_as.get(("k",))}))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {**os.environ, tuning_cache.ENV_VAR: str(tmp_path / "choices.json"),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True,
                                      text=True).stdout.strip().splitlines()[-1]) for _ in range(2)]
    # three candidates timed eagerly, and again as graph replays when the class is that short (under 1 ms)
    assert runs[0]["timed"] == {"eager": 3, "graph": 6}[runs[0]["as"]]
    assert runs[1]["timed"] == 0 and runs[1]["choice"] == runs[0]["choice"]
    (env_key,) = json.loads((tmp_path / "choices.json").read_text())["entries"]
    assert torch.cuda.get_device_name() in env_key and "|sm" in env_key
