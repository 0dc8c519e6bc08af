"""The Triton backend's ``rms_norm_rope`` (one launch: the norm rounded to the row dtype, then the rotation of the
last pairs) against the reference op (``rms_norm`` then ``rope``) with fresh random inputs: keys (one row a token,
a weight), queries (heads a token, no weight), the fallback for widths that are not a power of two. Triton's CPU
interpreter here, on the GPU where there is one (V4's widths)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import reference as ref  # noqa: E402
from redknot.kernels.triton import norm  # noqa: E402
from redknot.kernels.triton import ops as triton_ops  # noqa: E402


def _case(shape, half, weighted, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=g)).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)) if weighted else None
    ang = torch.rand(shape[0], half, generator=g) * 1000
    return [None if t is None else t.to(device) for t in (x, w, ang.cos(), ang.sin())]


@pytest.mark.parametrize("shape,half,weighted", [((3, 64), 8, True), ((2, 4, 128), 32, False), ((1, 512), 32, True),
                                                 ((5, 3, 32), 16, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_norm_rope_matches_the_reference_op(shape, half, weighted, dtype, kernel_device):
    x, w, cos, sin = _case(shape, half, weighted, dtype, kernel_device, sum(shape) + half)
    assert norm.norm_rope_supported(x, cos)
    got = triton_ops.rms_norm_rope(x, w, 1e-6, cos, sin)
    want = ref.rms_norm_rope(x, w, 1e-6, cos, sin)
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        # the norm's sums in another order may round to the neighbouring bf16 value before the rotation
        err = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-1)).max().item()
        assert err <= 2 ** -6, err
        assert (got != want).float().mean().item() < 0.05
    first = shape[-1] - 2 * half
    torch.testing.assert_close(got[..., :first].float(), ref.rms_norm(x, w, 1e-6)[..., :first].float(),
                               rtol=2 ** -7, atol=1e-6)   # the columns before the pairs: the norm alone


def test_widths_that_are_not_a_power_of_two_take_the_composition(kernel_device):
    x, w, cos, sin = _case((2, 48), 8, True, torch.float32, kernel_device, 3)
    assert not norm.norm_rope_supported(x, cos)
    torch.testing.assert_close(triton_ops.rms_norm_rope(x, w, 1e-6, cos, sin), ref.rms_norm_rope(x, w, 1e-6, cos, sin),
                               rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
def test_gpu_norm_rope_at_v4_widths():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for shape, weighted in [((4, 512), True), ((4, 64, 512), False), ((32, 64, 512), False)]:
        x, w, cos, sin = _case(shape, 32, weighted, torch.bfloat16, "cuda", 9)
        got = norm.norm_rope(x, w, 1e-6, cos, sin)
        want = ref.rms_norm_rope(x, w, 1e-6, cos, sin)
        err = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-1)).max().item()
        assert err <= 2 ** -6, (shape, err)


@pytest.mark.parametrize("shape,half", [((3, 64), 8), ((2, 4, 128), 32), ((5, 3, 32), 16), ((7, 6, 512), 32)])
@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_rope_inplace_equals_rope_and_leaves_the_other_columns(shape, half, inverse, dtype, kernel_device):
    """``rope_inplace``: the trailing pairs bit for bit the Triton ``rope``'s (the same arithmetic), within rounding
    of the reference op; the columns before them untouched; x itself returned."""
    x, _w, cos, sin = _case(shape, half, False, dtype, kernel_device, 11 * shape[-1] + half + inverse)
    assert norm.rope_inplace_supported(x, cos)
    before = x.clone()
    got = triton_ops.rope_inplace(x, cos, sin, inverse)
    assert got is x
    first = shape[-1] - 2 * half
    assert torch.equal(x[..., :first], before[..., :first])
    assert torch.equal(x, triton_ops.rope(before, cos, sin, inverse))
    torch.testing.assert_close(x.float(), ref.rope(before, cos, sin, inverse).float(),
                               rtol=2 ** -7 if dtype == torch.bfloat16 else 2e-6, atol=1e-5)
    assert not torch.equal(x[..., first:], before[..., first:])   # it did rotate


def test_rope_inplace_on_a_strided_view_and_the_fallback(kernel_device):
    """Rows with a stride past their width go through the launch (a 2-D column slice, a 3-D one whose rows merge);
    a 3-D slice that cannot be viewed as rows takes the reference op; each writes only the view's trailing pairs."""
    big, _w, cos, sin = _case((4, 96), 8, False, torch.float32, kernel_device, 5)
    keep = big.clone()
    view = big[:, :64]
    assert norm.rope_inplace_supported(view, cos)
    want = ref.rope(view.clone(), cos, sin)
    triton_ops.rope_inplace(view, cos, sin)
    torch.testing.assert_close(view, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(big[:, 64:], keep[:, 64:])
    big3, _w, cos3, sin3 = _case((2, 3, 48), 8, False, torch.float32, kernel_device, 6)
    cos3, sin3 = cos3[:1].expand(3, 8).contiguous(), sin3[:1].expand(3, 8).contiguous()
    keep3 = big3.clone()
    view3 = big3.transpose(0, 1)[:, :, :32]   # [3 tokens, 2, 32]: no [rows, 32] view
    torch.testing.assert_close(triton_ops.rope_inplace(big3[:, :, :32], cos3[:2], sin3[:2]),
                               ref.rope(keep3[:, :, :32], cos3[:2], sin3[:2]), rtol=2e-6, atol=2e-6)
    big3.copy_(keep3)
    assert not norm.rope_inplace_supported(view3, cos3)
    want3 = ref.rope(view3.clone(), cos3, sin3, True)
    assert triton_ops.rope_inplace(view3, cos3, sin3, True) is view3
    torch.testing.assert_close(view3, want3, rtol=2e-6, atol=2e-6)
    assert torch.equal(big3[..., 32:], keep3[..., 32:])
