"""V4's MoE with the shared expert on the side stream (``hardware.side_stream_max_tokens``): on the GPU, with the
Triton kernels, the output equals the one-stream MoE's bit for bit, eagerly and replayed from a CUDA graph."""
import pytest
import torch
from v4_testutil import PARITY_CONFIG

from redknot.kernels.capture import cuda_graph
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.moe import MoE
from redknot.models.deepseek_v4.params import ParamFactory
from redknot.step import overlap


@pytest.fixture(autouse=True)
def _switch_back():
    before = overlap.side_stream_max_tokens()
    yield
    overlap.use_side_stream(before)


@pytest.mark.gpu
@pytest.mark.parametrize("hash_layer", [False, True])
def test_gpu_v4_moe_with_the_shared_expert_beside_equals_one_stream(hash_layer):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.kernels import KernelSet

    cfg = V4Config.from_hf_dict(PARITY_CONFIG)
    dev = torch.device("cuda")
    moe = MoE(ParamFactory(cfg, torch.bfloat16, device=dev), cfg, hash_layer)
    g = torch.Generator(device=dev).manual_seed(7)
    for name, t in list(moe.named_parameters()) + list(moe.named_buffers()):
        if name.endswith("tid2eid"):
            t.copy_(torch.rand(t.shape[0], cfg.n_routed_experts, generator=g, device=dev).argsort(-1)[:, :t.shape[1]])
        else:
            t.copy_(torch.randn(t.shape, generator=g, device=dev) * 0.1)
    ks = KernelSet(default="triton")
    n = 24
    x = torch.randn(n, cfg.hidden_size, generator=g, device=dev).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=g, device=dev)
    overlap._streams.clear()
    runs = {}
    for tokens in (0, 32):
        overlap.use_side_stream(tokens)
        eager = moe(ks, x, ids).clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cuda_graph(graph):
            out = moe(ks, x, ids)
        graph.replay()
        torch.cuda.synchronize()
        runs[tokens] = (eager, out.clone())
        assert bool(overlap._streams) == (tokens > 0)      # the side stream forked only when switched on
    assert torch.equal(runs[0][0], runs[32][0]) and torch.equal(runs[0][1], runs[32][1])
