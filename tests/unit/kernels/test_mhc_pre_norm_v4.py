"""V4's ``mhc_pre_norm`` op (a site's mHC collapse and the sublayer's RMSNorm) and ``mhc_post_pre_norm`` (the post
mix of a sublayer's output, then the next site's ``mhc_pre_norm``): the Triton backend's two-launch forms at 1-4
rows (``step_mhc_v41.site_pre`` with ``pre_in=None``: the collapse takes the site's own pre; ``post_site_pre``)
against the reference ops (compositions of ``mhc_post``, ``mhc_pre`` and ``rms_norm``) with fresh random inputs,
every finish form; the compositions above 4 rows; the dispatch. Triton's CPU interpreter here, the GPU with
``-m gpu`` (V4's width, in a CUDA graph)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import reference as ref  # noqa: E402
from redknot.kernels import tuning_cache  # noqa: E402
from redknot.kernels.triton import ops as triton_ops  # noqa: E402
from redknot.kernels.triton import step_mhc_v41  # noqa: E402

N, ITERS, HC_EPS, NORM_EPS = 4, 20, 1e-6, 1e-6


def _case(t: int, d: int, device, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    streams = (torch.randn(t, N, d, generator=g) * 2).to(dtype)
    fn = torch.randn((2 + N) * N, N * d, generator=g) * 0.02
    base = torch.randn((2 + N) * N, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    norm_w = 1 + 0.1 * torch.randn(d, generator=g)
    return [x.to(device) for x in (streams, fn, base, scale, norm_w)]


def _post_inputs(t: int, d: int, device, seed: int):
    """(y [t, d] bf16, post [t, n], comb [t, n, n]): a sublayer's output and a site's post / comb weights."""
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(t, d, generator=g) * 3).to(torch.bfloat16)
    post = 2 * torch.rand(t, N, generator=g)
    comb = torch.softmax(torch.randn(t, N, N, generator=g), -1)
    return [x.to(device) for x in (y, post, comb)]


def _check(got, want, t, d):
    (u, post, comb), (wu, wpost, wcomb) = got, want
    for a, b in ((post, wpost), (comb, wcomb)):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert (a - b).abs().max().item() < 2e-5, (a - b).abs().max().item()
    assert u.shape == (t, d) and u.dtype == wu.dtype
    # the collapse's fp32 sums in another order may round to the neighbouring bf16 value before the norm (up to
    # 2^-7 relative), and the normalised value's own rounding may then flip too: two bf16 ulps
    err = ((u.float() - wu.float()).abs() / wu.float().abs().clamp(min=1e-2)).max().item()
    assert err <= 2 ** -6, err
    assert (u.float() != wu.float()).float().mean().item() < 0.03


@pytest.mark.parametrize("t,d", [(1, 64), (3, 128), (4, 96)])
@pytest.mark.parametrize("form", step_mhc_v41.SITE_OWN_TUNER.candidates)
def test_own_pre_site_matches_the_reference_op(t, d, form, kernel_device):
    streams, fn, base, scale, w = _case(t, d, kernel_device, t + d)
    rms_eps = 0.25  # not the mixing eps: a swapped eps shows (the rows' mean square is about 1)
    u, pre, post, comb = step_mhc_v41.site_pre(streams, None, fn, base, scale, w, ITERS, HC_EPS, NORM_EPS,
                                               form=form, rms_eps=rms_eps)
    want = ref.mhc_pre_norm(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, rms_eps)
    _check((u, post, comb), want, t, d)
    # pre is the site's own: the reference's sigmoid weights, as the collapse used
    mix = ref._hc_mix(streams, fn, NORM_EPS)
    want_pre = torch.sigmoid(mix[:, :N] * scale[0] + base[:N]) + HC_EPS
    assert (pre - want_pre).abs().max().item() < 2e-5


def test_own_pre_site_refuses_the_forms_that_collapse_in_the_mixing_pass(kernel_device):
    streams, fn, base, scale, w = _case(1, 32, kernel_device, 0)
    with pytest.raises(ValueError, match="pre_in=None"):
        step_mhc_v41.site_pre(streams, None, fn, base, scale, w, ITERS, HC_EPS, NORM_EPS, form="one_pass_v")


@pytest.mark.parametrize("t", [1, 4, 6])
def test_triton_op_matches_the_reference_op(t, kernel_device):
    streams, fn, base, scale, w = _case(t, 128, kernel_device, 7 * t)
    got = triton_ops.mhc_pre_norm(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, 1e-5)
    _check(got, ref.mhc_pre_norm(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, 1e-5), t, 128)


def test_triton_op_takes_the_two_launch_form_at_up_to_four_rows(kernel_device, monkeypatch):
    ran = []
    real = step_mhc_v41.site_pre
    monkeypatch.setattr(step_mhc_v41, "site_pre", lambda h, *a, **kw: ran.append(h.shape[0]) or real(h, *a, **kw))
    streams, fn, base, scale, w = _case(6, 64, kernel_device, 3)
    for t in (1, 4, 5, 6):
        triton_ops.mhc_pre_norm(streams[:t], fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, NORM_EPS)
    assert ran and set(ran) <= {1, 4} and ran[-1] == 4  # (the tuner's runs among them, off the GPU none)
    ran.clear()
    monkeypatch.setattr(tuning_cache, "_small_rows_class", True)
    tuning_cache.use_small_rows_class(False)  # what a batch-invariant engine sets
    try:
        triton_ops.mhc_pre_norm(streams[:2], fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, NORM_EPS)
    finally:
        tuning_cache.use_small_rows_class(True)
    assert not ran
    triton_ops.mhc_pre_norm(streams[:2].float(), fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, NORM_EPS)
    assert not ran  # fp32 streams: the composition


@pytest.mark.parametrize("t,d", [(1, 64), (3, 128), (4, 96)])
@pytest.mark.parametrize("form", step_mhc_v41.POST_SITE_TUNER.candidates)
def test_post_site_matches_the_reference_op(t, d, form, kernel_device):
    streams, fn, base, scale, w = _case(t, d, kernel_device, 3 * t + d)
    y, post, comb = _post_inputs(t, d, kernel_device, t)
    out, u, pre, post2, comb2 = step_mhc_v41.post_site_pre(y, streams, post, comb, fn, base, scale, w, ITERS, HC_EPS,
                                                           NORM_EPS, rms_eps=0.25, form=form)
    want = ref.mhc_post_pre_norm(y, streams, post, comb, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, 0.25)
    wout = want[0].float()
    assert out.shape == want[0].shape and out.dtype == torch.bfloat16
    assert ((out.float() - wout).abs() / wout.abs().clamp(min=1e-2)).max().item() <= 2 ** -7
    assert (out.float() != wout).float().mean().item() < 0.02
    # the site's mixing and norm against the reference of the kernel's own new streams (one bf16 ulp apart where the
    # post mix's sums rounded differently)
    _check((u, post2, comb2), ref.mhc_pre_norm(out, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, 0.25), t, d)
    _check((u, post2, comb2), want[1:], t, d)


@pytest.mark.parametrize("t", [1, 4, 6])
def test_triton_post_op_matches_the_reference_op_and_dispatches_at_up_to_four_rows(t, kernel_device, monkeypatch):
    ran = []
    real = step_mhc_v41.post_site_pre
    monkeypatch.setattr(step_mhc_v41, "post_site_pre", lambda y, *a, **kw: ran.append(y.shape[0]) or real(y, *a, **kw))
    streams, fn, base, scale, w = _case(t, 128, kernel_device, 5 * t)
    y, post, comb = _post_inputs(t, 128, kernel_device, 9)
    got = triton_ops.mhc_post_pre_norm(y, streams, post, comb, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, 1e-5)
    want = ref.mhc_post_pre_norm(y, streams, post, comb, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, 1e-5)
    assert ((got[0].float() - want[0].float()).abs() / want[0].float().abs().clamp(min=1e-2)).max() <= 2 ** -7
    _check(got[1:], want[1:], t, 128)
    assert bool(ran) == (t <= 4) and set(ran) <= {t}


def test_post_site_refuses_fp32_streams(kernel_device):
    streams, fn, base, scale, w = _case(1, 32, kernel_device, 0, dtype=torch.float32)
    y, post, comb = _post_inputs(1, 32, kernel_device, 0)
    with pytest.raises(ValueError, match="16 bits"):
        step_mhc_v41.post_site_pre(y.float(), streams, post, comb, fn, base, scale, w, ITERS, HC_EPS, NORM_EPS,
                                   form="split")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_own_pre_site_at_v4_width_and_in_a_graph(t):
    """V4-Flash's 4 x 4096 streams: every form against the reference op, replayed from a CUDA graph with the eager
    bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.kernels.capture import cuda_graph
    streams, fn, base, scale, w = _case(t, 4096, "cuda", 11)
    want = ref.mhc_pre_norm(streams, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, NORM_EPS)
    for form in step_mhc_v41.SITE_OWN_TUNER.candidates:
        u, _, post, comb = step_mhc_v41.site_pre(streams, None, fn, base, scale, w, ITERS, HC_EPS, NORM_EPS,
                                                 form=form)
        _check((u, post, comb), want, t, 4096)
        g = torch.cuda.CUDAGraph()
        with cuda_graph(g):
            again = step_mhc_v41.site_pre(streams, None, fn, base, scale, w, ITERS, HC_EPS, NORM_EPS, form=form)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(again[0], u) and torch.equal(again[2], post), form


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4])
def test_gpu_post_site_at_v4_width_and_in_a_graph(t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.kernels.capture import cuda_graph
    streams, fn, base, scale, w = _case(t, 4096, "cuda", 12)
    y, post, comb = _post_inputs(t, 4096, "cuda", 13)
    want = ref.mhc_post_pre_norm(y, streams, post, comb, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, NORM_EPS)
    for form in step_mhc_v41.POST_SITE_TUNER.candidates:
        out, u, _, post2, comb2 = step_mhc_v41.post_site_pre(y, streams, post, comb, fn, base, scale, w, ITERS,
                                                             HC_EPS, NORM_EPS, form=form)
        assert ((out.float() - want[0].float()).abs() / want[0].float().abs().clamp(min=1e-2)).max() <= 2 ** -7
        _check((u, post2, comb2), ref.mhc_pre_norm(out, fn, base, scale, ITERS, HC_EPS, NORM_EPS, w, NORM_EPS), t,
               4096)
        g = torch.cuda.CUDAGraph()
        with cuda_graph(g):
            again = step_mhc_v41.post_site_pre(y, streams, post, comb, fn, base, scale, w, ITERS, HC_EPS, NORM_EPS,
                                               form=form)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(again[0], out) and torch.equal(again[1], u), form
