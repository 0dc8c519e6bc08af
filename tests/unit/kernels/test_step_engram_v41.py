"""The Engram gate in one launch (``step_engram_v41.engram_gate_rows``) against ``engram.engram_gate`` with fresh
random inputs: the means and the dot sum in another order, so the output is bounded by one ulp of its 16-bit
dtype and nearly all elements are equal. Triton's CPU interpreter here, the GPU with ``-m gpu``."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.step_engram_v41 import engram_gate_rows  # noqa: E402
from redknot.models.deepseek_v41.engram import engram_gate  # noqa: E402


def gate_inputs(t, hc, d, device, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(t, hc, d, generator=g) * 2).to(dtype)
    kv = torch.randn(t, (hc + 1) * d, generator=g).to(dtype)
    qw = 1 + 0.2 * torch.randn(hc, d, generator=g)
    kw = 1 + 0.2 * torch.randn(hc, d, generator=g)
    return [x.to(device) for x in (h, kv, qw, kw)]


def reference(h, kv, qw, kw, eps, mask=None):
    t, hc, d = h.shape
    kvf = kv.float()
    return engram_gate(h, kvf[:, :hc * d].view(t, hc, d), kvf[:, hc * d:], qw * kw, eps, mask)


def check_close(got, want, dtype, value):
    """One 16-bit ulp of the result, plus the gate's few fp32 ulps times the value (where h + g·v cancels)."""
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    gf, wf = got.float(), want.float()
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = ulp * torch.maximum(gf.abs(), wf.abs()) + 1e-5 * value.float().abs()[:, None, :]
    assert ((gf - wf).abs() <= tol).all()
    assert (gf != wf).float().mean().item() < 0.02


@pytest.mark.parametrize("case", [(1, 4, 64), (3, 4, 96), (5, 2, 256), (2, 4, 1000), (16, 4, 512)])
def test_gate_matches_engram_gate(case, kernel_device):
    t, hc, d = case
    h, kv, qw, kw = gate_inputs(t, hc, d, kernel_device, seed=sum(case))
    check_close(engram_gate_rows(h, kv, qw, kw, 1e-6), reference(h, kv, qw, kw, 1e-6), torch.bfloat16,
                kv[:, hc * d:])


def test_gate_with_a_token_mask_and_fp16(kernel_device):
    h, kv, qw, kw = gate_inputs(4, 4, 128, kernel_device, seed=3, dtype=torch.float16)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0], device=kernel_device)
    got = engram_gate_rows(h, kv, qw, kw, 1e-6, mask)
    check_close(got, reference(h, kv, qw, kw, 1e-6, mask), torch.float16, kv[:, 4 * 128:])
    assert torch.equal(got[1], h[1]) and not torch.equal(got[0], h[0])     # masked tokens pass through


def test_gate_refuses_a_projection_of_the_wrong_width(kernel_device):
    h, kv, qw, kw = gate_inputs(2, 4, 64, kernel_device, seed=1)
    with pytest.raises(ValueError, match="kv"):
        engram_gate_rows(h, kv[:, :-64], qw, kw, 1e-6)
