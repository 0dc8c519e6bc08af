"""The decode router's logits (``step_router_v41``): the Triton GEMV and every tuner candidate against the exact
products' fp64 sums, row invariance, and the step's call (``moe._step_router_logits``); on the GPU or through the
Triton interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import step_router_v41 as sr


def _inputs(e, k, rows, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
    w = (torch.randn(e, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    return u, w


def _exact(u, w):
    return u.double() @ w.double().t()


@pytest.mark.parametrize("block_e", sr.GEMV_BLOCK_E)
@pytest.mark.parametrize("e,k,rows", [(48, 2048, 1), (37, 1536 + 96, 4), (16, 256, 3)])
def test_router_gemv_matches_the_exact_sums(block_e, e, k, rows, kernel_device):
    """fp32 sums of exact products: within a few fp32 ulps of the fp64 sums (E not a multiple of the block, K with
    a tail step)."""
    u, w = _inputs(e, k, rows, e + k + rows, kernel_device)
    got = sr.router_gemv(u, w, block_e)
    want = _exact(u, w)
    assert got.dtype == torch.float32 and got.shape == (rows, e)
    scale = u.double().abs() @ w.double().abs().t()
    assert ((got.double() - want).abs() <= scale * 1e-6).all()


def test_router_gemv_row_alone_equals_row_among_four(kernel_device):
    u, w = _inputs(40, 1024, 4, 3, kernel_device)
    full = sr.router_gemv(u, w, 2)
    for r in range(4):
        assert torch.equal(sr.router_gemv(u[r:r + 1], w, 2), full[r:r + 1])


def test_router_gemv_refuses_what_it_does_not_cover(kernel_device):
    u, w = _inputs(8, 256, 1, 1, kernel_device)
    with pytest.raises(ValueError):
        sr.router_gemv(u.float(), w)
    with pytest.raises(ValueError):
        sr.router_gemv(torch.cat([u] * 5), w)
    with pytest.raises(ValueError):
        sr.router_gemv(u, w, 3)


@pytest.mark.parametrize("choice", sr.ROUTER_TUNER.candidates)
def test_router_logits_candidates_agree(choice, kernel_device):
    """Every candidate: the exact products' sums in fp32 (``fp32`` reads the fp32 weight copy it is given); without a
    choice off the GPU the first candidate, ``fp32``, runs."""
    u, w = _inputs(24, 512, 2, 8, kernel_device)
    w32 = w.float()
    if choice == "mm":
        try:
            torch.mm(u, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pytest.skip("torch.mm has no out_dtype overload for these tensors here")
    got = sr.router_logits(u, w, lambda: w32, choice)
    assert ((got.double() - _exact(u, w)).abs() <= (u.double().abs() @ w.double().abs().t()) * 1e-6).all()
    assert sr.ROUTER_TUNER.candidates[0] == "fp32"
    if kernel_device == "cpu":
        assert torch.equal(sr.router_logits(u, w, lambda: w32), torch.nn.functional.linear(u.float(), w32))


def test_step_router_logits_takes_the_router_for_few_bf16_rows(kernel_device, monkeypatch):
    """``moe._step_router_logits``: 1-4 bf16 rows on a bf16-stored gate ask ``router_logits`` (fails if the step
    still ran its own F.linear), more rows the fp32 F.linear."""
    from redknot.models.deepseek_v41 import moe
    from redknot.models.deepseek_v41.ref_math import Numerics, Weights

    u, wt = _inputs(16, 256, 2, 4, kernel_device)
    w = Weights({"gate.weight": wt}, torch.bfloat16)
    num = Numerics("reference", torch.bfloat16)
    assert num.acc == torch.float32
    asked = []
    real = sr.router_logits
    monkeypatch.setattr(sr, "router_logits", lambda *a, **k: asked.append(a[0].shape[0]) or real(*a, **k))
    got = moe._step_router_logits(u, w, "gate.weight", num)
    assert asked == [2]
    assert ((got.double() - _exact(u, wt)).abs() <= (u.double().abs() @ wt.double().abs().t()) * 1e-6).all()
    u5 = torch.cat([u] * 3)[:5]
    got5 = moe._step_router_logits(u5, w, "gate.weight", num)
    assert asked == [2] and torch.equal(got5, torch.nn.functional.linear(u5.float(), wt.float()))
