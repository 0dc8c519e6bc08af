"""On the GPU at V4.1 shapes: the dense streams with the slice sum in the launch (``gemm_mx.FUSED_DECODES``) give
their two launches' bits, eager and in CUDA-graph replays (the tile counters reset by every launch), each passes its
first-use check; ``wo_a_v41``'s FP8 streams against the bf16 einsum at the real wo_a shape."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.capture import cuda_graph
from redknot.kernels.triton import gemm_mx, stream_guard, wo_a_v41

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("n,k", [(5120, 8192), (32768, 1280), (2304, 5120), (512, 5120)],
                         ids=["wo_b", "wq_b", "w1", "wkv"])
@pytest.mark.parametrize("rows", [32, 128])
@pytest.mark.parametrize("name", gemm_mx.FUSED_DECODES)
def test_fused_streams_at_v41_shapes(n, k, rows, name):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    assert stream_guard.self_check(name, torch.device("cuda")) is None
    out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
    got = gemm_mx._dense_stream(x, w, ws.view(torch.uint8), 32, out, name).clone()
    two = gemm_mx._dense_stream(x, w, ws.view(torch.uint8), 32, torch.empty_like(out), name, unfused=True)
    assert torch.equal(got, two)
    assert _rel(got, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        gemm_mx._dense_stream(x, w, ws.view(torch.uint8), 32, out, name)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got)


@pytest.mark.parametrize("rows", [8, 32, 128])
@pytest.mark.parametrize("name", wo_a_v41.WO_A_TUNER.candidates[1:])
def test_wo_a_streams_at_v41_shape(rows, name):
    g = torch.Generator(device="cuda").manual_seed(rows)
    w, s = mx.quant_fp8_blocks(torch.randn(8 * 1024, 4096, generator=g, device="cuda") * 0.02, 32)
    wb = mx.dequant_fp8_blocks(w, s, 32).to(torch.bfloat16).view(8, 1024, 4096)
    o2 = torch.randn(rows, 8 * 4096, generator=g, device="cuda").to(torch.bfloat16)
    assert wo_a_v41.self_check(name, torch.device("cuda")) is None
    got = wo_a_v41.grouped_stream(o2, w, s, 8, name)
    exact = torch.einsum("ngk,grk->ngr", o2.double().view(rows, 8, 4096), wb.double()).reshape(rows, -1)
    assert ((got.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-5).all()
    assert _rel(got, wo_a_v41.einsum(o2, wb)) <= 4e-3
