"""The b1 step's wo_a GEMV, router logits and mHC site forms on the GPU at V4.1 sizes: every candidate against the
exact (fp64) result with fresh random inputs, its first-use check, CUDA-graph replay == eager, a row alone == that
row among four, and the tuners' choice made eagerly then kept under capture."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton import step_mhc_v41, step_router_v41, step_wo_a_v41
from redknot.kernels.triton.checks_mx import capture_graph

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

WO_A = [*step_wo_a_v41.WO_A_PLANS, *(n for n in step_wo_a_v41.WO_A_TUNER.candidates if n != "einsum")]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def wo_a():
    g = torch.Generator(device="cuda").manual_seed(7)
    w, ws = mx.quant_fp8_blocks(torch.randn(8192, 4096, generator=g, device="cuda") * 0.02, 32)
    o = torch.randn(4, 8, 4096, generator=g, device="cuda").to(torch.bfloat16)
    return o, w, ws


@pytest.mark.parametrize("name", WO_A)
def test_wo_a_gemv_at_v41(name, wo_a):
    o, w, ws = wo_a
    assert step_wo_a_v41.self_check(name, torch.device("cuda")) is None
    full = step_wo_a_v41.wo_a_gemv(o, w, ws, 32, name)
    want = step_wo_a_v41.wo_a_reference(o, w, ws, 32)
    assert ((full.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-5).all()
    for r in range(4):
        assert torch.equal(step_wo_a_v41.wo_a_gemv(o[r:r + 1], w, ws, 32, name), full[r:r + 1])
    _, got = capture_graph(lambda: step_wo_a_v41.wo_a_gemv(o[:1], w, ws, 32, name))
    assert torch.equal(got, full[:1])


def test_wo_a_rows_tunes_eagerly_and_keeps_the_choice_in_a_graph(wo_a):
    o, w, ws = wo_a
    bf = mx.dequant_fp8_blocks(w, ws, 32).to(torch.bfloat16).view(8, 1024, 4096)
    eager = step_wo_a_v41.wo_a_rows(o[:1], w, ws, bf, 32)
    key = ((8192, 4096), 32, 1)
    assert step_wo_a_v41.WO_A_TUNER.choices[key] in step_wo_a_v41.WO_A_TUNER.candidates
    _, got = capture_graph(lambda: step_wo_a_v41.wo_a_rows(o[:1], w, ws, bf, 32))
    assert torch.equal(got, eager)
    print("wo_a choice", step_wo_a_v41.WO_A_TUNER.choices[key], step_wo_a_v41.WO_A_TUNER.timings.get(key))


@pytest.mark.parametrize("choice", step_router_v41.ROUTER_TUNER.candidates)
def test_router_logits_at_v41(choice):
    g = torch.Generator(device="cuda").manual_seed(8)
    u = torch.randn(4, 5120, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(384, 5120, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    w32 = w.float()
    if choice == "mm":
        try:
            torch.mm(u, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pytest.skip("torch.mm has no out_dtype overload here")
    full = step_router_v41.router_logits(u, w, lambda: w32, choice)
    exact = u.double() @ w.double().t()
    assert ((full.double() - exact).abs() <= (u.double().abs() @ w.double().abs().t()) * 1e-5).all()
    _, got = capture_graph(lambda: step_router_v41.router_logits(u[:1], w, lambda: w32, choice))
    assert torch.equal(got, step_router_v41.router_logits(u[:1], w, lambda: w32, choice))
    if choice.startswith("gemv"):
        for r in range(4):
            assert torch.equal(step_router_v41.router_logits(u[r:r + 1], w, lambda: w32, choice), full[r:r + 1])


@pytest.mark.parametrize("form", list(step_mhc_v41.SITE_FORMS))
def test_mhc_site_forms_at_v41(form):
    from redknot.models.deepseek_v41.mhc import hc_collapse, hc_mixes
    from redknot.models.deepseek_v41.ref_math import rms_norm

    g = torch.Generator(device="cuda").manual_seed(9)
    n, d = 4, 5120
    h = (torch.randn(1, n, d, generator=g, device="cuda") * 2).to(torch.bfloat16)
    pre_in = torch.rand(1, n, generator=g, device="cuda") + 0.1
    fn = torch.randn((2 + n) * n, n * d, generator=g, device="cuda") * 0.02
    base = torch.randn((2 + n) * n, generator=g, device="cuda") * 0.5
    scale = torch.rand(3, generator=g, device="cuda") + 0.5
    norm_w = (1 + 0.1 * torch.randn(d, generator=g, device="cuda")).to(torch.bfloat16).float()
    args = (h, pre_in, fn, base, scale, norm_w, 20, 1e-6, 1e-6)
    u, pre, post, comb = step_mhc_v41.site_pre(*args, form=form)
    wpre, wpost, wcomb = hc_mixes(h, fn, base, scale, n, 20, 1e-6, 1e-6)
    for got, want in ((pre, wpre), (post, wpost), (comb, wcomb)):
        assert (got - want).abs().max().item() < 2e-5
    wu = rms_norm(hc_collapse(h, pre_in), norm_w, 1e-6)
    assert ((u.float() - wu.float()).abs() / wu.float().abs().clamp(min=1e-2)).max().item() <= 2 ** -7
    _, got = capture_graph(lambda: step_mhc_v41.site_pre(*args, form=form)[0])
    assert torch.equal(got, u)
