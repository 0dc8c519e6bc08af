"""ConfigTuner's timing rule: a class whose fastest candidate runs in under ``graph_below_ms`` eagerly is
compared again as CUDA-graph replays (how the decode step runs it), and keeps its eager timings when any
candidate cannot be captured.

No CUDA here for the rule itself: ``do_bench`` is replaced by fixed eager times and ``_replay_times`` by
fixed replay times, so which comparison decided the choice is known in advance. The capture itself runs
on a GPU (``-m gpu``)."""
import pytest
import torch
import triton.testing

from redknot.kernels import tuning_cache
from redknot.kernels.triton import _common
from redknot.kernels.triton._common import ConfigTuner

EAGER = {"one_launch": 0.030, "many_launches": 0.080}    # ms: host launch cost decides eagerly
REPLAY = {"one_launch": 0.025, "many_launches": 0.006}   # ms: the many small kernels are faster on the device


@pytest.fixture
def store_off(monkeypatch):
    monkeypatch.setenv(tuning_cache.ENV_VAR, "off")
    tuning_cache.reset()
    tuning_cache.set_seed_path(None)
    yield
    tuning_cache.reset()


@pytest.fixture
def no_store(store_off, monkeypatch):
    """The store off and ``do_bench`` replaced by the candidate's own return value (its fixed eager time)."""
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **_: fn())


def _tuner():
    return ConfigTuner("toy_graph", ["one_launch", "many_launches"])


def test_a_short_class_is_decided_by_its_replay_times(no_store, monkeypatch):
    seen = []
    monkeypatch.setattr(_common, "_replay_times",
                        lambda configs, run: seen.append(list(configs)) or [(c, REPLAY[c]) for c in configs])
    tuner = _tuner()
    assert tuner._tune(("k",), lambda cfg: EAGER[cfg]) == "many_launches"
    assert seen == [["one_launch", "many_launches"]]          # every candidate that ran, in order
    assert tuner.timed_as[("k",)] == "graph" and dict(tuner.timings[("k",)]) == REPLAY


def test_a_long_class_keeps_its_eager_times(no_store, monkeypatch):
    monkeypatch.setattr(_common, "_replay_times", lambda configs, run: pytest.fail("replayed a long class"))
    slow = {c: 100.0 * ms for c, ms in EAGER.items()}          # 3 ms and 8 ms: above graph_below_ms
    tuner = _tuner()
    assert tuner._tune(("k",), lambda cfg: slow[cfg]) == "one_launch"
    assert tuner.timed_as[("k",)] == "eager"


def test_the_rule_can_be_switched_off(no_store, monkeypatch):
    monkeypatch.setattr(ConfigTuner, "graph_below_ms", 0.0)
    monkeypatch.setattr(_common, "_replay_times", lambda configs, run: pytest.fail("replayed with the rule off"))
    assert _tuner()._tune(("k",), lambda cfg: EAGER[cfg]) == "one_launch"


def test_a_class_that_cannot_be_captured_keeps_its_eager_times(no_store, monkeypatch):
    monkeypatch.setattr(_common, "_replay_times", lambda configs, run: None)
    tuner = _tuner()
    assert tuner._tune(("k",), lambda cfg: EAGER[cfg]) == "one_launch"
    assert tuner.timed_as[("k",)] == "eager" and dict(tuner.timings[("k",)]) == EAGER


def test_failed_candidates_are_not_replayed(no_store, monkeypatch):
    seen = []
    monkeypatch.setattr(_common, "_replay_times",
                        lambda configs, run: seen.append(list(configs)) or [(c, REPLAY[c]) for c in configs])

    def run(cfg):
        if cfg == "many_launches":
            raise RuntimeError("out of resources")
        return EAGER[cfg]

    tuner = _tuner()
    assert tuner._tune(("k",), run) == "one_launch" and seen == [["one_launch"]]
    assert [c for c, _ in tuner.failures[("k",)]] == ["many_launches"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_without_cuda_nothing_is_replayed():
    assert _common._replay_times(["a"], lambda cfg: None) is None


def test_the_timing_rule_is_part_of_the_environment():
    env = tuning_cache.environment(torch.device("cpu"))
    assert env.endswith(f"|timing {tuning_cache.TIMING}")
    gpu, versions = tuning_cache._split("NVIDIA H200|sm90|torch 2.11.0|triton 3.6.0|timing graph<1ms")
    assert gpu == "NVIDIA H200|sm90" and versions == "torch 2.11.0|triton 3.6.0|timing graph<1ms"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_replays_drop_the_host_launch_cost(store_off):
    """Real capture: 64 tiny launches against one. Replayed, the 64 launches cost the device time of 64 tiny
    kernels; eagerly they also cost 64 host launches, so their replay time must be well below their eager
    time, and a capture-unsafe candidate (a host sync) sends the class back to eager timings."""
    from triton.testing import do_bench

    x = torch.randn(64, device="cuda")
    runs = {"one": lambda: x.mul_(1.0), "many": lambda: [x.mul_(1.0) for _ in range(64)]}
    replayed = dict(_common._replay_times(["one", "many"], lambda cfg: runs[cfg]()))
    eager_many = do_bench(runs["many"], warmup=3, rep=10, return_mode="median")
    assert replayed["many"] < 0.5 * eager_many, (replayed, eager_many)
    assert _common._replay_times(["one", "sync"], lambda cfg: runs["one"]() if cfg == "one" else x.sum().item()) \
        is None
    torch.cuda.synchronize()
    assert torch.isfinite(x).all()      # the device is still usable after the refused capture
