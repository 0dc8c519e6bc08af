"""The fused decode MoE pieces (``step_moe_v41``) on the GPU at real V4.1 sizes (384 experts, top-6, hidden
and shared-expert width of ``checks_mx.REAL_V41``): the router's ids equal PyTorch's and its weights within
an ulp or two, the shared expert + combine equal to the registry's ``linear_mx`` (``fp8`` decode) with the
model's SwiGLU and within the reference contract of ``ref_v41`` (1e-2), and CUDA-graph replay equal to eager."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import gemm_mx  # noqa: E402
from redknot.kernels.triton.checks_mx import REAL_V41, capture_graph  # noqa: E402
from redknot.kernels.triton.step_moe_v41 import (route_and_gate_up, route_topk,  # noqa: E402
                                                 route_topk_reference, shared_expert_combine,
                                                 shared_expert_finish)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

LIMIT = 10.0
D, INTER, E, K = REAL_V41.hidden, REAL_V41.moe_inter, REAL_V41.experts, REAL_V41.topk_experts


@pytest.fixture(autouse=True)
def _small_rows_class_off():
    """These tests compare the shared expert with ``linear_mx``'s ``fp8`` decode: the 1-4-row GEMV class of the
    W1 | W3 launch off (its GEMV form: ``tests/kernels/test_step_proj_gemv_v41_gpu.py``)."""
    from redknot.kernels import tuning_cache
    before = tuning_cache.small_rows_class()
    tuning_cache.use_small_rows_class(False)
    yield
    tuning_cache.use_small_rows_class(before)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("t", [1, 4, 16])
def test_route_topk_at_v41_sizes(t):
    g = torch.Generator(device="cuda").manual_seed(t)
    u = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
    gate = (torch.randn(E, D, generator=g, device="cuda") * D ** -0.5).to(torch.bfloat16).float()
    bias = torch.randn(E, generator=g, device="cuda") * 0.05
    logits = F.linear(u.float(), gate)
    ids, w = route_topk(logits, bias, K, 1.0, True, 1.5)
    wid, ww = route_topk_reference(logits, bias, K, 1.0, True, 1.5)
    assert torch.equal(ids, wid)
    assert ((w - ww).abs() / ww.abs()).max().item() < 1e-6
    _, out = capture_graph(lambda: route_topk(logits, bias, K, 1.0, True, 1.5))
    assert torch.equal(out[0], ids) and torch.equal(out[1], w)


@pytest.fixture(scope="module")
def shared_weights():
    g = torch.Generator(device="cuda").manual_seed(11)
    out = []
    for n, k in ((INTER, D), (INTER, D), (D, INTER)):
        out += list(mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, 32))
    return out


@pytest.mark.parametrize("t", [1, 4, 16])
def test_shared_expert_combine_at_v41_sizes(t, shared_weights):
    w1, s1, w3, s3, w2, s2 = shared_weights
    g = torch.Generator(device="cuda").manual_seed(100 + t)
    u = (torch.randn(t, D, generator=g, device="cuda") * 2).to(torch.bfloat16)
    routed = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
    got = shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed)

    def want(lin):
        gate = lin(u, w1, s1).float().clamp(max=LIMIT)
        up = lin(u, w3, s3).float().clamp(-LIMIT, LIMIT)
        shared = lin((F.silu(gate) * up).to(torch.bfloat16), w2, s2).float()
        return (routed.float() + shared).to(torch.bfloat16)

    fp8 = want(lambda x, w, s: gemm_mx.linear_mx(x, w, s, 32, 32, path="splitk", decode="fp8"))
    differ = (got != fp8).float().mean().item()
    assert differ <= 1e-3, differ          # the same partials and sums: bit-equal but for a SiLU ulp
    assert _rel(got, want(lambda x, w, s: ref_v41.linear_mx(x, w, s, 32, 32))) <= 1e-2
    _, replay = capture_graph(lambda: shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed))
    assert torch.equal(replay, got)
    alone = shared_expert_combine(u[-1:], w1, s1, w3, s3, w2, s2, LIMIT, routed[-1:])
    assert torch.equal(alone, got[-1:])    # batch invariance: a row's bits do not depend on the others
    for prologue in (False, True):         # the W2 stream forming its own input: the same bits
        assert torch.equal(shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed, prologue=prologue), got)


@pytest.mark.parametrize("t", [1, 16])
def test_router_and_gate_up_in_one_launch_at_v41_sizes(t, shared_weights):
    w1, s1, w3, s3, w2, s2 = shared_weights
    g = torch.Generator(device="cuda").manual_seed(200 + t)
    u = (torch.randn(t, D, generator=g, device="cuda") * 2).to(torch.bfloat16)
    routed = torch.randn(t, D, generator=g, device="cuda").to(torch.bfloat16)
    logits = torch.randn(t, E, generator=g, device="cuda") * 2
    bias = torch.randn(E, generator=g, device="cuda") * 0.05
    ids, w, p1 = route_and_gate_up(logits, bias, K, 1.0, True, 1.5, u, w1, s1, w3, s3)
    want_ids, want_w = route_topk(logits, bias, K, 1.0, True, 1.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    out = shared_expert_finish(p1, w2, s2, LIMIT, routed)
    assert torch.equal(out, shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed))
    _, replay = capture_graph(lambda: shared_expert_finish(
        route_and_gate_up(logits, bias, K, 1.0, True, 1.5, u, w1, s1, w3, s3)[2], w2, s2, LIMIT, routed))
    assert torch.equal(replay, out)
