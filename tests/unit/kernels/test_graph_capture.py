"""A capture that fails (a host sync inside it) leaves the CUDA generator and the current stream usable."""
import pytest
import torch

from redknot.kernels.capture import cuda_graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_a_refused_capture_keeps_random_ops_and_the_stream():
    x = torch.randn(64, device="cuda")
    torch.cuda.manual_seed(1234)
    want = torch.randn(8, device="cuda")
    torch.cuda.manual_seed(1234)
    stream = torch.cuda.current_stream()
    with pytest.raises(RuntimeError), cuda_graph(torch.cuda.CUDAGraph()):
        x.mul_(2.0)
        x.sum().item()                           # a host sync: the capture is invalidated
    assert torch.cuda.current_stream() == stream
    got = torch.randn(8, device="cuda")         # raised "Offset increment outside graph capture" before
    assert torch.equal(got, want)               # the seed and offset are those of before the capture
    g = torch.cuda.CUDAGraph()                   # and a later capture still works
    with cuda_graph(g):
        y = x * 3.0
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 3.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_the_tuners_refused_graph_timing_leaves_sampling_usable():
    from redknot.kernels.triton import _common

    x = torch.randn(64, device="cuda")
    assert _common._replay_times(["one", "sync"], lambda cfg: x.mul_(1.0) if cfg == "one" else x.sum().item()) \
        is None
    probs = torch.softmax(torch.randn(4, 32, device="cuda"), -1)
    assert torch.multinomial(probs, 1).shape == (4, 1)
