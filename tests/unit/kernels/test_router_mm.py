"""``route.router_mm``: the router's affinities ``sqrt(softplus(x · Wᵀ))`` at many rows as one tiled GEMM with the
epilogue, against float64 and the reference op, every launch shape of its tuner; and the ``router_scores`` op's
dispatch past the GEMV rows (the tuner's choice: the reference untimed off the GPU, a plan where one is chosen).
On the GPU, or through the Triton interpreter at small sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import reference
from redknot.kernels.triton import ops as triton_ops
from redknot.kernels.triton import route

PLANS = [c for c in route.ROUTER_TUNER.candidates if isinstance(c, route.RouterPlan)]


def _operands(rows, experts, dim, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(experts, dim, generator=g, device=device) / 8).to(torch.bfloat16)
    x = torch.randn(rows, dim, generator=g, device=device).to(torch.bfloat16)
    x[1] *= 40   # logits up to |~100|: past softplus's threshold of 20, and exp underflow far below 0
    return x, w


def _float64(x, w):
    return torch.nn.functional.softplus((x.double() @ w.double().t()), threshold=20).sqrt()


@pytest.mark.parametrize("plan", PLANS, ids=repr)
@pytest.mark.parametrize("rows,experts,dim", [(40, 72, 320), (17, 256, 256), (5, 8, 96)])
def test_router_mm_matches_float64_and_the_reference(plan, rows, experts, dim, kernel_device):
    """Rows and experts past the tile, K not a multiple of the step: within fp32 summation of the reference."""
    x, w = _operands(rows, experts, dim, rows + experts, kernel_device)
    out = torch.full((rows, experts), float("nan"), device=kernel_device)
    got = route.router_mm(x, w, plan, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.float32
    assert not got.isnan().any()
    logits = x.double() @ w.double().t()
    assert (logits > 20).any() and (logits < -20).any()
    torch.testing.assert_close(got.double(), _float64(x, w), rtol=1e-5, atol=1e-5)   # fp32 sums of D products
    torch.testing.assert_close(got, reference.router_scores(x, w), rtol=1e-5, atol=1e-5)


def test_router_mm_refuses_what_it_cannot_take(kernel_device):
    x, w = _operands(8, 16, 64, 1, kernel_device)
    for bad_x, bad_w in ((x.float(), w), (x, w.float()), (x, w[:, :32]), (x.t().contiguous().t(), w)):
        assert not route.router_mm_supported(bad_x, bad_w)
        with pytest.raises(ValueError, match="router_mm"):
            route.router_mm(bad_x, bad_w, PLANS[0])
    assert route.router_mm(x[:0], w, PLANS[0]).shape == (0, 16)


def test_router_scores_op_past_the_gemv_rows_takes_the_tuners_choice(kernel_device, monkeypatch):
    """Off the GPU the tuner's first candidate, the reference, runs (bit for bit); with a plan chosen for the class,
    the op runs ``router_mm`` with it; fp32 rows stay on the reference."""
    x, w = _operands(24, 64, 128, 3, kernel_device)
    key = (32, tuple(w.shape), str(x.dtype))
    monkeypatch.setattr(route.ROUTER_TUNER, "choices", {})
    if kernel_device == "cpu":
        assert torch.equal(triton_ops.router_scores(x, w), reference.router_scores(x, w))
    plan = route.RouterPlan(16, 32, 32, 4, 2)
    route.ROUTER_TUNER.choices[key] = plan
    launched = []
    kernel = route.router_mm
    monkeypatch.setattr(route, "router_mm", lambda *a, **k: launched.append(a[2]) or kernel(*a, **k))
    got = triton_ops.router_scores(x, w)
    assert launched == [plan]
    assert torch.equal(got, kernel(x, w, plan))
    torch.testing.assert_close(got, reference.router_scores(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(triton_ops.router_scores(x.float(), w), reference.router_scores(x.float(), w))
    route.ROUTER_TUNER.choices[key] = "reference"
    assert torch.equal(triton_ops.router_scores(x, w), reference.router_scores(x, w))
    assert launched == [plan]
