"""V4.1's fused decode MoE pieces (``step_moe_v41``) against the PyTorch math with fresh random inputs: the
router's top-k and weights after its GEMV, and the shared expert with the routed combine (against the
registry's ``linear_mx`` with the ``fp8`` decode plus the model's SwiGLU: bit-equal; and against the
PyTorch reference linears). Triton's CPU interpreter here; real V4.1 sizes on the GPU with ``-m gpu``
(tests/kernels/test_step_moe_v41_gpu.py)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import gemm_mx  # noqa: E402
from redknot.kernels.triton.step_moe_v41 import (route_and_gate_up, route_topk,  # noqa: E402
                                                 route_topk_reference, shared_expert_combine,
                                                 shared_expert_finish)

LIMIT = 10.0


@pytest.mark.parametrize("t,e,k", [(1, 48, 6), (3, 16, 4), (5, 40, 1)])
@pytest.mark.parametrize("seed", [1, 2])
def test_route_topk_matches_pytorch(t, e, k, seed, kernel_device):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=g) * 4).to(kernel_device)
    logits[0, :3] = 25.0     # past softplus's threshold (x itself)
    bias = (torch.randn(e, generator=g) * 0.1).to(kernel_device)
    for temp, norm in ((1.0, True), (1.0, False), (0.7, True)):
        ids, w = route_topk(logits, bias, k, temp, norm, 1.5)
        wid, ww = route_topk_reference(logits, bias, k, temp, norm, 1.5)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (t, k)
        assert torch.equal(ids, wid), (ids, wid)
        # libdevice / numpy exp and log1p against PyTorch's: an ulp or two of fp32
        assert ((w - ww).abs() / ww.abs()).max().item() < 1e-6


def test_route_topk_ties_go_to_the_lower_id(kernel_device):
    e, k = 32, 6
    logits = torch.zeros(2, e, device=kernel_device)
    logits[0, [3, 9, 17, 20, 28, 30, 31]] = 4.0      # seven equal maxima: the six lowest ids win
    logits[1, 5] = 3.0
    bias = torch.zeros(e, device=kernel_device)
    bias[[1, 2]] = 1.0                               # bias selects, the unbiased scores weigh
    ids, w = route_topk(logits, bias, k, 1.0, True, 1.5)
    wid, ww = route_topk_reference(logits, bias, k, 1.0, True, 1.5)
    assert torch.equal(ids, wid)
    assert ids[0].tolist() == [3, 9, 17, 20, 28, 30]
    assert ids[1].tolist()[:3] == [0, 1, 2] and 5 in ids[1].tolist()
    assert ((w - ww).abs() / ww.abs()).max().item() < 1e-6


def test_route_topk_rejects_bad_input(kernel_device):
    logits = torch.zeros(1, 8, device=kernel_device)
    with pytest.raises(ValueError, match="k=9"):
        route_topk(logits, torch.zeros(8, device=kernel_device), 9, 1.0, True, 1.0)
    with pytest.raises(ValueError, match="float32"):
        route_topk(logits.double(), torch.zeros(8, device=kernel_device), 2, 1.0, True, 1.0)


def _fp8_weight(n: int, k: int, g: torch.Generator, device):
    w, s = mx.quant_fp8_blocks(torch.randn(n, k, generator=g) * 0.05, 32)
    return w.to(device), s.to(device)


def _shared_case(t: int, d: int, inter: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16).to(device)
    w1, s1 = _fp8_weight(inter, d, g, device)
    w3, s3 = _fp8_weight(inter, d, g, device)
    w2, s2 = _fp8_weight(d, inter, g, device)
    routed = torch.randn(t, d, generator=g).to(torch.bfloat16).to(device)
    return u, w1, s1, w3, s3, w2, s2, routed


def _want(lin, u, w1, s1, w3, s3, w2, s2, routed):
    """``moe.swiglu_expert`` (shared: no routing weight) + the step's combine, through ``lin``."""
    gate = lin(u, w1, s1).float().clamp(max=LIMIT)
    up = lin(u, w3, s3).float().clamp(-LIMIT, LIMIT)
    act = F.silu(gate) * up
    shared = lin(act.to(torch.bfloat16), w2, s2).float()
    return (routed.float() + shared).to(torch.bfloat16)


# t=32: a batch-32 decode step's rows (``e2e_v41.py --step-rows`` runs the step's launches there)
@pytest.mark.parametrize("t,d,inter", [(1, 64, 96), (3, 96, 64), (2, 2048, 64), (32, 96, 64)])
def test_shared_expert_combine_matches_linear_mx(t, d, inter, kernel_device):
    args = _shared_case(t, d, inter, 7 + t, kernel_device)
    got = shared_expert_combine(*args[:7], LIMIT, args[7], prologue=False)
    assert got.dtype == torch.bfloat16 and got.shape == (t, d)
    # the W2 stream forming its own input: the same bits in one launch fewer
    assert torch.equal(shared_expert_combine(*args[:7], LIMIT, args[7], prologue=True), got)
    fp8 = _want(lambda x, w, s: gemm_mx.linear_mx(x, w, s, 32, 32, decode="fp8"), *args)
    # same partials, same slice sums; only SiLU's exp may differ in its last fp32 bit (interpreter: numpy)
    diff = (got.float() != fp8.float()).float().mean().item()
    assert diff <= 0.01, diff
    ref = _want(lambda x, w, s: ref_v41.linear_mx(x, w, s, 32, 32), *args)
    err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 2e-2, err       # bf16 roundings of the linears in another summation order


@pytest.mark.parametrize("t", [1, 3, 32])
def test_router_and_gate_up_in_one_launch_equal_the_two_kernels(t, kernel_device):
    u, w1, s1, w3, s3, w2, s2, routed = _shared_case(t, 64, 96, 20 + t, kernel_device)
    g = torch.Generator().manual_seed(t)
    logits = (torch.randn(t, 40, generator=g) * 3).to(kernel_device)
    bias = (torch.randn(40, generator=g) * 0.1).to(kernel_device)
    ids, w, p1 = route_and_gate_up(logits, bias, 6, 1.0, True, 1.5, u, w1, s1, w3, s3)
    want_ids, want_w = route_topk(logits, bias, 6, 1.0, True, 1.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    got = shared_expert_finish(p1, w2, s2, LIMIT, routed)
    assert torch.equal(got, shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed))


def test_shared_expert_combine_rejects_bad_shapes(kernel_device):
    u, w1, s1, w3, s3, w2, s2, routed = _shared_case(1, 64, 96, 1, kernel_device)
    with pytest.raises(ValueError, match="W2"):
        shared_expert_combine(u, w1, s1, w3, s3, w1, s1, LIMIT, routed)
    with pytest.raises(ValueError, match="routed"):
        shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed[:, :32])


@pytest.mark.parametrize("t", [1, 3])
def test_shared_expert_finish_with_the_post_mix_equals_mhc_post(t, kernel_device):
    """``mix``: the last launch also runs the mHC post mix per block: bit for bit ``mhc_post`` of the output."""
    from redknot.kernels.triton.mhc import mhc_post
    from redknot.kernels.triton.step_moe_v41 import _gate_up_launch

    d, inter, n = 256, 128, 4
    g = torch.Generator().manual_seed(40 + t)
    u = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16).to(kernel_device)
    ws = [mx.quant_fp8_blocks(torch.randn(*shape, generator=g) * 0.05, 32) for shape in ((inter, d), (inter, d),
                                                                                          (d, inter))]
    (w1, s1), (w3, s3), (w2, s2) = [(a.to(kernel_device), b.to(kernel_device)) for a, b in ws]
    routed = torch.randn(t, d, generator=g).to(torch.bfloat16).to(kernel_device)
    h = torch.randn(t, n, d, generator=g).to(torch.bfloat16).to(kernel_device)
    post = (torch.rand(t, n, generator=g) * 2).to(kernel_device)
    comb = torch.rand(t, n, n, generator=g).to(kernel_device)
    for prologue in (True, False):
        p1 = _gate_up_launch(u, w1, s1.view(torch.uint8), w3, s3.view(torch.uint8), 32)
        out = shared_expert_finish(p1, w2, s2, LIMIT, routed, prologue=prologue)
        got = shared_expert_finish(p1, w2, s2, LIMIT, routed, prologue=prologue, mix=(h, post, comb))
        assert torch.equal(got, mhc_post(out, h, post, comb))
        assert not torch.equal(got, mhc_post(out, h, post * 1.5, comb))
