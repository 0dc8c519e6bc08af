"""V4.1's fused hyper-connection sites (``step_mhc_v41``) against the model's PyTorch mHC with fresh random
inputs: the mixing (pre, post, Sinkhorn C), the lagged collapse + RMS norm, and the post mix. Triton's CPU
interpreter here, the GPU with ``-m gpu`` (V4.1 width)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.step_mhc_v41 import site_post, site_pre  # noqa: E402
from redknot.models.deepseek_v41.mhc import hc_collapse, hc_expand, hc_mixes  # noqa: E402
from redknot.models.deepseek_v41.ref_math import rms_norm  # noqa: E402

HC, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def _case(t: int, d: int, device, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(t, HC, d, generator=g) * 2).to(dtype)
    pre_in = torch.rand(t, HC, generator=g) + 0.1
    fn = torch.randn((2 + HC) * HC, HC * d, generator=g) * 0.02
    base = torch.randn((2 + HC) * HC, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    norm_w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).float()
    return [x.to(device) for x in (h, pre_in, fn, base, scale, norm_w)]


def _want(h, pre_in, fn, base, scale, norm_w):
    pre, post, comb = hc_mixes(h, fn, base, scale, HC, ITERS, HC_EPS, NORM_EPS)
    u = rms_norm(hc_collapse(h, pre_in), norm_w, NORM_EPS)
    return u, pre, post, comb


@pytest.mark.parametrize("t,d", [(1, 64), (3, 128), (17, 96)])
@pytest.mark.parametrize("seed", [1, 2])
def test_site_pre_matches_pytorch(t, d, seed, kernel_device):
    args = _case(t, d, kernel_device, seed)
    u, pre, post, comb = site_pre(*args, ITERS, HC_EPS, NORM_EPS)
    wu, wpre, wpost, wcomb = _want(*args)
    for got, want in ((pre, wpre), (post, wpost), (comb, wcomb)):
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - want).abs().max().item() < 2e-5, (got - want).abs().max().item()
    assert u.dtype == torch.bfloat16 and u.shape == (t, d)
    # one bf16 ulp of the collapse (fp32 sums in another order round to the neighbouring bf16 value)
    err = ((u.float() - wu.float()).abs() / wu.float().abs().clamp(min=1e-2)).max().item()
    assert err <= 2 ** -7, err
    assert (u.float() != wu.float()).float().mean().item() < 0.02


@pytest.mark.parametrize("t,d", [(1, 64), (5, 96)])
def test_site_post_matches_pytorch(t, d, kernel_device):
    h, _, fn, base, scale, _ = _case(t, d, kernel_device, 3)
    _, post, comb = hc_mixes(h, fn, base, scale, HC, ITERS, HC_EPS, NORM_EPS)
    y = torch.randn(t, d, device=kernel_device).to(torch.bfloat16)
    got = site_post(y, h, post, comb).float()
    want = hc_expand(y, h, post, comb).float()
    assert ((got - want).abs() / want.abs().clamp(min=1e-2)).max().item() <= 2 ** -7


def test_site_pre_rejects_odd_streams(kernel_device):
    h = torch.zeros(1, 3, 32, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match="hc_mult=3"):
        site_pre(h, torch.ones(1, 3, device=kernel_device), torch.zeros(15, 96, device=kernel_device),
                 torch.zeros(15, device=kernel_device), torch.ones(3, device=kernel_device),
                 torch.ones(32, device=kernel_device), ITERS, HC_EPS, NORM_EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32, 128])
def test_gpu_site_pre_real_width(t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _case(t, 5120, "cuda", 4)
    u, pre, post, comb = site_pre(*args, ITERS, HC_EPS, NORM_EPS)
    wu, wpre, wpost, wcomb = _want(*args)
    for got, want in ((pre, wpre), (post, wpost), (comb, wcomb)):
        assert (got - want).abs().max().item() < 2e-5
    assert ((u.float() - wu.float()).abs() / wu.float().abs().clamp(min=1e-2)).max().item() <= 2 ** -7


@pytest.mark.parametrize("t,d", [(17, 64), (70, 160), (33, 96)])
def test_site_pre_one_pass_equals_the_two_pass_site(t, d, kernel_device):
    """The collapse taken in the mixing pass (``_mix_collapse``, from ``ONE_PASS_MIN_ROWS`` rows: token tiles and D
    slices with tails) against the split mixing GEMV + two-pass finish and against the PyTorch site."""
    from redknot.kernels.triton.step_mhc_v41 import ONE_PASS_MIN_ROWS

    assert t >= ONE_PASS_MIN_ROWS
    args = _case(t, d, kernel_device, 5 + t)
    one = site_pre(*args, ITERS, HC_EPS, NORM_EPS)
    two = site_pre(*args, ITERS, HC_EPS, NORM_EPS, one_pass=False)
    want = _want(*args)
    for a, b, c in zip(one[1:], two[1:], want[1:]):
        assert (a - b).abs().max().item() < 2e-5 and (a - c).abs().max().item() < 2e-5
    for ref in (two[0], want[0]):
        err = ((one[0].float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-2)).max().item()
        assert err <= 2 ** -7, err
        assert (one[0].float() != ref.float()).float().mean().item() < 0.02


@pytest.mark.gpu
def test_gpu_site_pre_one_pass_prefill_rows():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _case(8192, 5120, "cuda", 6)
    u, pre, post, comb = site_pre(*args, ITERS, HC_EPS, NORM_EPS)
    wu, wpre, wpost, wcomb = _want(*args)
    for got, want in ((pre, wpre), (post, wpost), (comb, wcomb)):
        assert (got - want).abs().max().item() < 2e-5
    assert ((u.float() - wu.float()).abs() / wu.float().abs().clamp(min=1e-2)).max().item() <= 2 ** -7
    assert (u.float() != wu.float()).float().mean().item() < 0.02


@pytest.mark.parametrize("form", ["split_v", "split_v_w8", "split_v_s256", "one_pass", "one_pass_v", "one_pass_v_w8",
                                  "one_pass_v_w2", "one_pass_v_w1", "one_pass_v_s256"])
@pytest.mark.parametrize("t,d", [(1, 96), (3, 160)])
def test_site_pre_decode_forms_match_pytorch(form, t, d, kernel_device):
    """``SITE_FORMS`` below ``ONE_PASS_MIN_ROWS`` rows (D 96 / 160: 3 / 5 slices, so the partials loaded at once
    are masked past the last slice) against the PyTorch site and the ``split`` form: other fp32 orders only."""
    from redknot.kernels.triton.step_mhc_v41 import SITE_TUNER

    args = _case(t, d, kernel_device, 11 + t + d)
    got = site_pre(*args, ITERS, HC_EPS, NORM_EPS, form=form)
    split = site_pre(*args, ITERS, HC_EPS, NORM_EPS, form="split")
    want = _want(*args)
    for a, b, c in zip(got[1:], split[1:], want[1:]):
        assert (a - b).abs().max().item() < 2e-5 and (a - c).abs().max().item() < 2e-5
    for ref in (split[0], want[0]):
        err = ((got[0].float() - ref.float()).abs() / ref.float().abs().clamp(min=1e-2)).max().item()
        assert err <= 2 ** -7, err
        assert (got[0].float() != ref.float()).float().mean().item() < 0.02
    assert SITE_TUNER.candidates[0] == "split"
    if kernel_device == "cpu":   # off the GPU the tuner's first form, untimed: the bits of what ran before
        for a, b in zip(site_pre(*args, ITERS, HC_EPS, NORM_EPS), split):
            assert torch.equal(a, b)


@pytest.mark.parametrize("t,d,n", [(1, 64, 4), (5, 1000, 4), (3, 2048, 2)])
def test_embed_streams_repeat_the_embedding_rows(t, d, n, kernel_device):
    """The streams entering layer 0 in one launch: every stream is the token's embedding row, bit for bit
    (repeated ids, the last row of the table, a width that is not a power of two)."""
    from redknot.kernels.triton.step_mhc_v41 import embed_streams

    g = torch.Generator().manual_seed(t + d)
    table = torch.randn(37, d, generator=g).to(torch.bfloat16).to(kernel_device)
    ids = torch.randint(0, 37, (t,), generator=g)
    ids[-1] = 36
    if t > 2:
        ids[1] = ids[0]
    ids = ids.to(kernel_device)
    got = embed_streams(ids, table, n)
    assert got.shape == (t, n, d) and got.dtype == table.dtype
    assert torch.equal(got, table[ids].unsqueeze(1).expand(-1, n, -1))
