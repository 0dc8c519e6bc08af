"""The fused row epilogue (``step_rope_v41.rope_rows``) against the model's PyTorch math with fresh random
inputs: RoPE (forward and inverse) and RoPE + FP4 grid bit for bit, RMS norm + RoPE within one bf16 ulp
(the norm's mean sums in another order). Triton's CPU interpreter here, the GPU with ``-m gpu``."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table  # noqa: E402
from redknot.models.deepseek_v41.ref_math import apply_rope, index_qdq, rope_inv_freq, rms_norm  # noqa: E402


def _inputs(t, heads, d, rope, device, seed, yarn=True):
    g = torch.Generator().manual_seed(seed)
    shape = (t, heads, d) if heads else (t, d)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16).to(device)
    pos = torch.randint(0, 1 << 20, (t,), generator=g).to(device)
    inv = rope_inv_freq(rope, 160000.0 if yarn else 10000.0, (16.0, 65536, 32.0, 1.0) if yarn else None)
    return x, pos, inv.to(device)


CASES = [(3, 4, 64, 16), (5, 0, 128, 64), (2, 3, 512, 64), (1, 2, 64, 64)]   # tokens, heads (0: [T, D]), D, rope


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_rows_equal_apply_rope_bit_for_bit(case, inverse, kernel_device):
    t, heads, d, rope = case
    x, pos, inv = _inputs(t, heads, d, rope, kernel_device, seed=d + t)
    cos, sin = rope_table(pos, inv)
    assert torch.equal(rope_rows(x, cos, sin, inverse=inverse), apply_rope(x, pos, inv, inverse=inverse))


@pytest.mark.parametrize("case", CASES[:3])
def test_rope_then_fp4_grid_equals_index_qdq_bit_for_bit(case, kernel_device):
    t, heads, d, rope = case
    x, pos, inv = _inputs(t, heads, d, rope, kernel_device, seed=7 + d)
    cos, sin = rope_table(pos, inv)
    assert torch.equal(rope_rows(x, cos, sin, qdq=True), index_qdq(apply_rope(x, pos, inv)))


@pytest.mark.parametrize("case", [(3, 0, 64, 16), (4, 0, 512, 64), (2, 3, 128, 32)])
def test_norm_then_rope_within_a_bf16_ulp(case, kernel_device):
    t, heads, d, rope = case
    x, pos, inv = _inputs(t, heads, d, rope, kernel_device, seed=11 + d, yarn=False)
    w = (1 + 0.1 * torch.randn(d)).to(torch.bfloat16).float().to(kernel_device)
    cos, sin = rope_table(pos, inv)
    got = rope_rows(x, cos, sin, norm_w=w, eps=1e-6).float()
    want = apply_rope(rms_norm(x, w, 1e-6), pos, inv).float()
    assert ((got - want).abs() / want.abs().clamp(min=1e-2)).max().item() <= 2 ** -7
    assert (got != want).float().mean().item() < 0.05


@pytest.mark.parametrize("d,rope", [(80, 0), (96, 16), (1280, 0)])   # widths that are not powers of two
def test_norm_rows_of_any_even_width(d, rope, kernel_device):
    x, pos, inv = _inputs(3, 0, d, max(rope, 2), kernel_device, seed=d)
    inv = inv[:rope // 2]
    w = (1 + 0.1 * torch.randn(d)).to(torch.bfloat16).float().to(kernel_device)
    cos, sin = rope_table(pos, inv)
    got = rope_rows(x, cos, sin, norm_w=w, eps=1e-6).float()
    want = rms_norm(x, w, 1e-6)
    want = (apply_rope(want, pos, inv) if rope else want).float()
    assert ((got - want).abs() / want.abs().clamp(min=1e-2)).max().item() <= 2 ** -7
    assert (got != want).float().mean().item() < 0.05


def test_rope_rows_reject_bad_widths(kernel_device):
    x = torch.zeros(2, 47, dtype=torch.bfloat16, device=kernel_device)
    cos = torch.ones(2, 8, device=kernel_device)
    with pytest.raises(ValueError, match="last dim 47"):
        rope_rows(x, cos, cos)
    with pytest.raises(ValueError, match="last dim 48"):
        rope_rows(torch.zeros(2, 48, dtype=torch.bfloat16, device=kernel_device), cos, cos, qdq=True)


@pytest.mark.gpu
@pytest.mark.parametrize("qdq", [False, True])
def test_gpu_rope_rows_real_widths(qdq):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    heads, d = (32, 128) if qdq else (64, 512)
    x, pos, inv = _inputs(128, heads, d, 64, "cuda", seed=3)
    cos, sin = rope_table(pos, inv)
    want = apply_rope(x, pos, inv)
    assert torch.equal(rope_rows(x, cos, sin, qdq=qdq), index_qdq(want) if qdq else want)


@pytest.mark.parametrize("form", ["kernel", "torch"])
def test_rope_table_equals_the_fp64_angles_cast_after(form, kernel_device, monkeypatch):
    """The one-launch table (``_rope_table``) and the PyTorch form it replaces against the angles ``apply_rope``
    computes (fp64, cast after), bit for bit, over positions up to 2^24 and a table width that is not a power
    of two."""
    from redknot.kernels.triton import step_rope_v41
    from redknot.models.deepseek_v41.ref_math import rope_inv_freq

    if form == "torch":
        if kernel_device == "cuda":
            pytest.skip("the PyTorch form runs only on CPU tensors outside the interpreter")
        monkeypatch.setenv("TRITON_INTERPRET", "0")   # read by interpreting(): the kernel is not taken
    g = torch.Generator().manual_seed(3)
    pos = torch.cat([torch.arange(64), torch.randint(0, 1 << 24, (2000,), generator=g)]).to(kernel_device)
    for inv in (rope_inv_freq(64, 160000.0, (16.0, 65536, 32.0, 1.0)), rope_inv_freq(16, 10000.0, None),
                rope_inv_freq(64, 10000.0, None)[:11]):
        ang = pos.cpu().to(torch.float64)[:, None] * inv[None, :]
        cos, sin = step_rope_v41.rope_table(pos, inv)
        assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (pos.shape[0], inv.shape[0])
        assert torch.equal(cos.cpu(), ang.cos().float()) and torch.equal(sin.cpu(), ang.sin().float())
        c32, s32 = step_rope_v41.rope_table(pos.float(), inv)          # the general form
        assert torch.equal(c32, cos) and torch.equal(s32, sin)
