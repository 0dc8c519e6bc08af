"""The shipped tuning seed (redknot/kernels/tuned/*.json): consulted when the store has no entry for a class,
only for the same GPU and torch/triton versions, never written, switched off by the config key or the
variable; a broken seed file is named in a warning; ``export`` writes a seed from a store.

No CUDA: ``ConfigTuner._measure`` is driven directly with ``do_bench`` replaced by fixed times, as in
test_tuning_cache.py, and the environment string is fixed so the seed's keys are known."""
import json
import logging
import os

import pytest
import torch
import triton.testing

from redknot.kernels import tuning_cache
from redknot.kernels.triton._common import ConfigTuner

ENV = "NVIDIA H200|sm90|torch 2.9.0+cu128|triton 3.6.0"
TIMES = {"a": 3.0, "b": 1.0, "c": 2.0}   # "b" is the fastest: a seed that says "c" is visibly used
KEY = ((7168, 4096), 32)


class Bench:
    def __init__(self, monkeypatch):
        self.calls = 0
        monkeypatch.setattr(triton.testing, "do_bench", self)

    def __call__(self, fn, **_):
        self.calls += 1
        return fn()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A store file and a seed folder under tmp_path, the environment fixed to ``ENV``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(tuning_cache.ENV_VAR, raising=False)
    monkeypatch.delenv(tuning_cache.SEED_ENV_VAR, raising=False)
    monkeypatch.setattr(tuning_cache, "environment", lambda device: ENV)
    tuning_cache.reset()
    store, seeds = tmp_path / "choices.json", tmp_path / "tuned"
    seeds.mkdir()
    tuning_cache.set_path(str(store))
    tuning_cache.set_seed_path(str(seeds))
    yield store, seeds
    tuning_cache.reset()


def write_seed(path, env=ENV, choice="'c'", key=KEY, tuner="toy"):
    """A seed entry choosing ``choice`` with every candidate timed (the others slower), as the export writes."""
    timings = [[c, 0.5 if c == choice else 3.0] for c in ("'a'", "'b'", "'c'")]
    path.write_text(json.dumps({"format": tuning_cache.FORMAT, "entries": {env: {tuner: {repr(key): {
        "choice": choice, "timings": timings}}}}}))


def measure(key=KEY, run=None):
    ran = []

    def go(cfg):
        ran.append(cfg)
        return (run or TIMES.__getitem__)(cfg)
    got = ConfigTuner("toy", ["a", "b", "c"])._measure(key, go, torch.device("cpu"))
    return got, ran


def test_a_seed_entry_is_used_when_the_store_lacks_it(env, monkeypatch):
    store, seeds = env
    bench = Bench(monkeypatch)
    write_seed(seeds / "h200.json")
    got, ran = measure()
    assert got == "c" and bench.calls == 0 and ran == ["c"]   # no timing; the first-use guard ran it once
    assert not store.exists()                                 # a seed hit writes nothing
    # another class the seed does not hold is measured and stored as before
    assert measure(key=("other",))[0] == "b" and bench.calls == 3
    assert set(json.loads(store.read_text())["entries"][ENV]["toy"]) == {"('other',)"}
    assert json.loads((seeds / "h200.json").read_text())["entries"][ENV]["toy"][repr(KEY)]["choice"] == "'c'"


def test_the_store_wins_over_the_seed(env, monkeypatch):
    store, seeds = env
    bench = Bench(monkeypatch)
    store.write_text(json.dumps({"format": tuning_cache.FORMAT, "entries": {ENV: {"toy": {repr(KEY): {
        "choice": "'a'", "timings": []}}}}}))
    write_seed(seeds / "h200.json")
    assert measure() == ("a", ["a"]) and bench.calls == 0
    assert tuning_cache.lookup(ENV, "toy", repr(KEY))[1] == "stored"


def test_a_seed_choice_that_fails_its_first_use_is_tuned_and_stored(env, monkeypatch):
    store, seeds = env
    bench = Bench(monkeypatch)
    write_seed(seeds / "h200.json", choice="'b'")

    def run(cfg):
        if cfg == "b":
            raise RuntimeError("out of resources")
        return TIMES[cfg]
    assert measure(run=run)[0] == "c" and bench.calls == 3
    assert json.loads(store.read_text())["entries"][ENV]["toy"][repr(KEY)]["choice"] == "'c'"


@pytest.mark.parametrize("other", [
    "NVIDIA H200|sm90|torch 2.9.0+cu128|triton 3.5.1",     # another triton
    "NVIDIA H200|sm90|torch 2.10.0+cu128|triton 3.6.0",    # another torch
    "NVIDIA H100 80GB HBM3|sm90|torch 2.9.0+cu128|triton 3.6.0",   # another GPU
    "NVIDIA H200|sm100|torch 2.9.0+cu128|triton 3.6.0",    # another capability
])
def test_a_seed_for_another_gpu_or_versions_is_not_used(env, monkeypatch, caplog, other):
    _, seeds = env
    bench = Bench(monkeypatch)
    write_seed(seeds / "h200.json", env=other)
    with caplog.at_level(logging.WARNING, logger=tuning_cache.__name__):
        assert measure()[0] == "b" and bench.calls == 3
        assert measure(key=("k2",))[0] == "b" and bench.calls == 6
    warned = [r.getMessage() for r in caplog.records if r.name == tuning_cache.__name__]
    if other.startswith("NVIDIA H200|sm90|"):   # same GPU, other versions: said once, naming file and versions
        assert len(warned) == 1, warned
        assert str(seeds / "h200.json") in warned[0] and other.split("|", 2)[2] in warned[0]
        assert "torch 2.9.0+cu128|triton 3.6.0" in warned[0] and "not used" in warned[0]
    else:
        assert warned == []


def test_the_switches_turn_the_seed_off(env, monkeypatch):
    from redknot.config.schema import EngineConfig

    assert EngineConfig().kernel_tuning_seed is True
    store, seeds = env
    bench = Bench(monkeypatch)
    write_seed(seeds / "h200.json")
    tuning_cache.use_seed(False)                 # engine.kernel_tuning_seed: false
    assert tuning_cache.seed() is None
    assert measure()[0] == "b" and bench.calls == 3
    store.unlink()
    tuning_cache.reset()
    tuning_cache.set_path(str(store))
    tuning_cache.use_seed(True)                  # the packaged folder, not the test's
    assert tuning_cache.current_seed_path() == tuning_cache.SEED_DIR
    monkeypatch.setenv(tuning_cache.SEED_ENV_VAR, str(seeds))    # the variable names a folder: it wins
    tuning_cache.reset()
    tuning_cache.set_path(str(store))
    tuning_cache.use_seed(False)
    assert measure() == ("c", ["c"]) and bench.calls == 3
    monkeypatch.setenv(tuning_cache.SEED_ENV_VAR, "off")        # ... or turns it off, whatever the config says
    tuning_cache.reset()
    tuning_cache.set_path(str(store))
    tuning_cache.use_seed(True)
    assert tuning_cache.seed() is None
    assert measure()[0] == "b" and bench.calls == 6


def test_the_seed_works_without_the_store(env, monkeypatch):
    _, seeds = env
    bench = Bench(monkeypatch)
    write_seed(seeds / "h200.json")
    tuning_cache.set_path(None)                  # engine.kernel_tuning_store: false
    assert measure() == ("c", ["c"]) and bench.calls == 0
    assert measure(key=("k2",))[0] == "b" and bench.calls == 3
    assert os.listdir(".") == ["tuned"]          # nothing written anywhere


@pytest.mark.parametrize("text", ["{not json", json.dumps({"format": 99, "entries": {}}), "[1, 2]",
                                  json.dumps({"format": 1, "entries": {ENV: ["toy"]}})])
def test_a_bad_seed_file_is_named_and_ignored(env, monkeypatch, caplog, text):
    _, seeds = env
    bench = Bench(monkeypatch)
    (seeds / "broken.json").write_text(text)
    write_seed(seeds / "good.json", key=("k2",))
    with caplog.at_level(logging.WARNING, logger=tuning_cache.__name__):
        assert measure()[0] == "b" and bench.calls == 3
        assert measure(key=("k2",)) == ("c", ["c"]) and bench.calls == 3   # the other file still counts
    warned = [r.getMessage() for r in caplog.records if r.name == tuning_cache.__name__]
    assert len(warned) == 1 and str(seeds / "broken.json") in warned[0], warned
    with pytest.raises(ValueError, match="broken.json"):
        tuning_cache.read_seed_file(str(seeds / "broken.json"))


def test_export_writes_a_seed_that_a_fresh_process_uses(env, monkeypatch, tmp_path, capsys):
    store, _ = env
    bench = Bench(monkeypatch)
    assert measure()[0] == "b" and bench.calls == 3       # measured, in the store
    other = dict(json.loads(store.read_text()))
    other["entries"]["cpu|torch 2.13.0|triton 3.6.0"] = {"toy": {"('x',)": {"choice": "'a'", "timings": []}}}
    store.write_text(json.dumps(other))
    out = tmp_path / "seed" / "h200.json"
    assert tuning_cache.main(["export", str(store), str(out), "--gpu", "h200"]) == 0
    assert f"{ENV}: 1 classes" in capsys.readouterr().out
    assert list(tuning_cache.read_seed_file(str(out))) == [ENV]
    tuning_cache.reset()
    tuning_cache.set_path(None)
    tuning_cache.set_seed_path(str(out))                # one file works as well as a folder
    assert measure() == ("b", ["b"]) and bench.calls == 3
    assert tuning_cache.main(["export", str(store), str(tmp_path / "none.json"), "--gpu", "B200"]) == 1
    assert "no environment to export matching GPU 'B200'" in capsys.readouterr().out
    assert tuning_cache.main(["export", str(tmp_path / "missing.json"), str(tmp_path / "x.json")]) == 1
    assert "missing.json" in capsys.readouterr().out


def test_export_pin_as_gives_a_sibling_gpu_the_choices_untimed(env, monkeypatch, tmp_path, capsys):
    """``export --pin-as ENV``: another GPU's choices under this environment, without timings: used as they
    are (no candidate timed, even one the entry never saw); a selection of several environments, or a text
    that is no environment string, is refused by name."""
    store, _ = env
    sibling = "NVIDIA H100 80GB HBM3|sm90|torch 2.9.0+cu128|triton 3.6.0"
    write_seed(store, env=sibling, choice="'c'")                       # the sibling measured "c"
    out = tmp_path / "pinned.json"
    assert tuning_cache.main(["export", str(store), str(out), "--gpu", "H100", "--pin-as", ENV]) == 0
    assert f"{ENV}: 1 classes" in capsys.readouterr().out
    written = tuning_cache.read_seed_file(str(out))
    assert written == {ENV: {"toy": {repr(KEY): {"choice": "'c'"}}}}
    tuning_cache.reset()
    tuning_cache.set_path(None)
    tuning_cache.set_seed_path(str(out))
    bench = Bench(monkeypatch)
    assert measure() == ("c", ["c"]) and bench.calls == 0             # the pinned choice runs once, untimed
    two = json.loads(store.read_text())
    two["entries"][ENV] = two["entries"][sibling]
    store.write_text(json.dumps(two))
    assert tuning_cache.main(["export", str(store), str(out), "--pin-as", ENV]) == 1
    assert "2 environments selected" in capsys.readouterr().out
    assert tuning_cache.main(["export", str(store), str(out), "--gpu", "H100", "--pin-as", "H200"]) == 1
    assert "--pin-as: 'H200' is not an environment string" in capsys.readouterr().out


def test_the_packaged_seeds_are_valid():
    """Every shipped seed file parses as the store's format (a broken one fails here, not in a user's run)."""
    names = [n for n in os.listdir(tuning_cache.SEED_DIR) if n.endswith(".json")]
    for name in names:
        entries = tuning_cache.read_seed_file(os.path.join(tuning_cache.SEED_DIR, name))
        for env_key, tuners in entries.items():
            assert "|sm" in env_key and "|torch " in env_key and "|triton " in env_key, (name, env_key)
            for keys in tuners.values():
                assert all(isinstance(e.get("choice"), str) for e in keys.values()), name
    assert os.path.isfile(os.path.join(tuning_cache.SEED_DIR, "__init__.py"))   # shipped with the package


@pytest.mark.gpu
def test_on_cuda_an_exported_seed_spares_a_fresh_process_the_timing(tmp_path):
    """Real processes on the GPU: one times toy candidates into a store, ``export`` turns the store into a
    seed, and a process with no store (``off``) and that seed picks the same choice without timing."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import json, torch, triton.testing
        from redknot.kernels.triton._common import ConfigTuner
        calls = []
        real = triton.testing.do_bench
        triton.testing.do_bench = lambda fn, **kw: (calls.append(1), real(fn, **kw))[1]
        x = torch.randn(256, 256, device="cuda")
        tuner = ConfigTuner("toy_seed", [1, 2, 4])
        got = tuner.pick(("k",), lambda reps: [x @ x for _ in range(reps)], torch.device("cuda"))
        print(json.dumps({"choice": got, "timed": len(calls), "as": tuner.timed_as.get(("k",))}))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}

    def run(**env):
        out = subprocess.run([sys.executable, "-c", script], env={**base, **env}, check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    store, seed = tmp_path / "choices.json", tmp_path / "seed.json"
    first = run(**{tuning_cache.ENV_VAR: str(store), tuning_cache.SEED_ENV_VAR: "off"})
    assert first["timed"] == {"eager": 3, "graph": 6}[first["as"]]   # a class under 1 ms is also replayed
    assert tuning_cache.main(["export", str(store), str(seed), "--gpu", torch.cuda.get_device_name()]) == 0
    second = run(**{tuning_cache.ENV_VAR: "off", tuning_cache.SEED_ENV_VAR: str(seed)})
    assert second == {"choice": first["choice"], "timed": 0, "as": None}


def test_a_seed_entry_predating_a_candidate_is_measured_again(env, monkeypatch):
    """A seed measured before a candidate was added does not hide it: the new candidate is timed here against
    the seed's choice and the class stored."""
    store, seeds = env
    bench = Bench(monkeypatch)
    write_seed(seeds / "h200.json")
    times = {**TIMES, "d": 0.25}
    got = ConfigTuner("toy", ["a", "b", "c", "d"])._measure(KEY, times.__getitem__, torch.device("cpu"))
    assert got == "d" and bench.calls == 2   # the seed's "c" and the new "d"
    assert json.loads(store.read_text())["entries"][ENV]["toy"][repr(KEY)]["choice"] == "'d'"
