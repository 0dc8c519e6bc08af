"""``redknot.step.overlap``: the MoE's shared expert on a second CUDA stream beside the routed experts
(``hardware.side_stream_max_tokens``). Off the GPU both parts run in order; on it the step's output and state bytes
equal the one-stream step's bit for bit, eagerly and replayed from a CUDA graph, and the fork ran."""
import copy

import pytest
import torch

from redknot.kernels.capture import cuda_graph
from redknot.step import overlap


@pytest.fixture(autouse=True)
def _switch_back():
    before = overlap.side_stream_max_tokens()
    yield
    overlap.use_side_stream(before)


def test_switch_refuses_negative_counts_and_keeps_its_value():
    overlap.use_side_stream(32)
    with pytest.raises(ValueError, match=r"hardware.side_stream_max_tokens=-1: must be >= 0"):
        overlap.use_side_stream(-1)
    assert overlap.side_stream_max_tokens() == 32


def test_cpu_rows_run_in_order_on_one_stream():
    overlap.use_side_stream(64)
    order = []
    x = torch.ones(4, 3)
    got = overlap.beside(x, lambda: order.append("main") or x * 2, lambda: order.append("side") or x + 1)
    assert order == ["main", "side"] and torch.equal(got[0], x * 2) and torch.equal(got[1], x + 1)
    assert not overlap.concurrent(x)


def test_engine_applies_its_hardware_value_per_step(tmp_path):
    """The runner owns the process-wide switch: off the GPU it keeps one stream whatever another engine set."""
    from pathlib import Path

    from redknot.bench.typed import load_yaml_option
    from redknot.config.schema import (
        EngineConfig,
        FeaturesConfig,
        HardwareConfig,
        ModelConfig,
        SchedulerConfig,
    )
    from redknot.engine import LLM

    conf = Path(__file__).resolve().parents[4] / "conf" / "model" / "tiny-v41.yaml"
    model = load_yaml_option(conf, ModelConfig)
    model.max_position = 256
    features = FeaturesConfig()
    features.dspark.method = "none"
    llm = LLM(model, HardwareConfig(), features,
              EngineConfig(scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, block_size=16),
                           cache_dir=str(tmp_path)))
    overlap.use_side_stream(96)            # as another engine in the process would
    llm.runner._own_kernel_switches()
    assert overlap.side_stream_max_tokens() == 0


# ---------------------------------------------------------------------- GPU
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
def test_gpu_beside_in_a_graph_equals_the_parts_in_order():
    """Fresh inputs copied into the static buffer, replayed: both branches' outputs equal the parts run in
    order on one stream (same kernels, same bits)."""
    _needs_cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w2 = (torch.randn(512, 512, device="cuda", generator=g) for _ in range(2))
    x = torch.randn(24, 512, device="cuda", generator=g)

    def main():
        return torch.relu(x @ w1) @ w1

    def side():
        return torch.tanh(x @ w2) * 3

    overlap.use_side_stream(32)
    assert overlap.concurrent(x)
    overlap.beside(x, main, side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        a, b = overlap.beside(x, main, side)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(a, main()) and torch.equal(b, side()), seed


@pytest.mark.gpu
def test_gpu_each_stream_counts_into_its_own_counters():
    """The last-program counters of the fused launches: a launch on the side stream never shares the words of a
    launch on the current stream (both may run at once)."""
    _needs_cuda()
    from redknot.kernels.triton._common import DeviceCounters

    counters, dev = DeviceCounters(8), torch.device("cuda")
    here = counters(dev, 4)
    overlap.use_side_stream(8)
    with torch.cuda.stream(overlap._side(dev)):
        there = counters(dev, 4)
    assert there.data_ptr() != here.data_ptr() and counters(dev, 4) is here


@pytest.mark.gpu
def test_gpu_a_fork_inside_a_branch_runs_in_order():
    """Inside either branch of a fork a second beside() does not fork (the side stream is one per device): its
    parts run on the branch's own stream."""
    _needs_cuda()
    x = torch.ones(8, 8, device="cuda")
    overlap.use_side_stream(8)
    seen = []

    def branch():
        seen.append((overlap.concurrent(x), torch.cuda.current_stream().cuda_stream))
        return x + 1

    overlap.beside(x, branch, branch)
    side = overlap._side(x.device).cuda_stream
    assert [c for c, _ in seen] == [False, False] and sorted(s == side for _, s in seen) == [False, True]
    assert overlap.concurrent(x)


@pytest.mark.gpu
def test_gpu_v41_cut_step_on_two_streams_equals_one_stream(monkeypatch):
    """e2e_v41's toy cut on the GPU, every op on its Triton kernel, 24 decode rows (above the step kernels' 16:
    the MoE runs route + routed experts and the shared expert as separate launches): the tensor step with the side
    stream on equals the one-stream step bit for bit (output and every state byte), eager and as a graph replay."""
    _needs_cuda()
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[4] / "benchmarks"))
    import e2e_v41

    import redknot.models.deepseek_v41.tensor_step as ts
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    dev = torch.device("cuda")
    cfg = e2e_v41.cut_config(True, 100)
    model = e2e_v41.build(cfg, e2e_v41.random_tensors(cfg, dev), "reference", V41Ops(KernelSet(default="triton")), dev)
    n = 24
    batch = e2e_v41.Batch(model, n, 96, block_size=16)
    batch.step([e2e_v41.tokens(40, cfg.vocab_size, 1 + i) for i in range(n)], seqs=list(range(n)))
    step = ts.TensorStep(torch.arange(n, device=dev) + 11, torch.tensor(batch.lens, device=dev),
                         torch.arange(n + 1, dtype=torch.int32, device=dev),
                         torch.arange(n, dtype=torch.int32, device=dev),
                         torch.tensor(batch.blocks, dtype=torch.int32, device=dev))
    runs = {}
    for tokens in (0, 64):
        overlap.use_side_stream(tokens)
        eager_state = copy.deepcopy(batch.state)
        eager = ts.tensor_forward(model, step, eager_state).clone()
        graph_state = copy.deepcopy(batch.state)
        ts.tensor_forward(model, step, copy.deepcopy(batch.state))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cuda_graph(graph):
            out = ts.tensor_forward(model, step, graph_state)
        graph.replay()
        torch.cuda.synchronize()
        runs[tokens] = (eager, out.clone(), eager_state, graph_state)
    assert overlap._streams, "the side stream never forked"
    (e0, g0, s0, t0), (e1, g1, s1, t1) = runs[0], runs[64]
    assert torch.equal(e0, e1) and torch.equal(g0, g1)
    for x, y, z, v in zip(s0.tensors(), s1.tensors(), t0.tensors(), t1.tensors()):
        assert torch.equal(x, y) and torch.equal(x, z) and torch.equal(x, v)
