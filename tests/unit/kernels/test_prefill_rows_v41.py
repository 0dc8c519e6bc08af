"""V4.1 prefill row kernels (``prefill_rows_v41``) against the model's PyTorch math with fresh random inputs:
RoPE of the rotated columns in place (bit for bit ``apply_rope``, untouched columns kept), the SwiGLU activation
(one bf16 ulp: the interpreter's ``exp`` is numpy's, the GPU's libdevice's), the combine + mHC post mix (bit for
bit ``mhc_post`` of the combine, within fp32 summation order of ``hc_expand``) and the streams' collapse (one bf16
ulp of ``hc_collapse``). Row counts that leave partial blocks, rope widths that are not powers of two and column
counts that are not block multiples cover the masks. Triton's CPU interpreter here, the GPU with ``-m gpu``."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from redknot.kernels.triton.mhc import mhc_post
from redknot.kernels.triton.prefill_rows_v41 import (
    add_post,
    collapse_rows,
    rope_cols_,
    swiglu_rows,
)
from redknot.kernels.triton.step_rope_v41 import rope_table
from redknot.models.deepseek_v41.mhc import hc_collapse, hc_expand
from redknot.models.deepseek_v41.ref_math import apply_rope, rope_inv_freq

BF16_ULP = 2 ** -7


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(got, want):
    return ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-2)).max().item()


# ---------------------------------------------------------------------- RoPE of the rotated columns
@pytest.mark.parametrize("t,heads,d,rope", [(3, 4, 64, 16), (70, 0, 128, 64), (5, 3, 96, 24), (33, 2, 512, 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_cols_in_place_equals_apply_rope(t, heads, d, rope, inverse, kernel_device):
    g = _gen(d + t + heads)
    shape = (t, heads, d) if heads else (t, d)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16).to(kernel_device)
    pos = torch.randint(0, 1 << 20, (t,), generator=g).to(kernel_device)
    inv = rope_inv_freq(rope, 160000.0, (16.0, 65536, 32.0, 1.0)).to(kernel_device)
    want = apply_rope(x, pos, inv, inverse=inverse)
    cos, sin = rope_table(pos, inv)
    y = x.clone()
    got = rope_cols_(y, cos, sin, inverse=inverse)
    assert got.data_ptr() == y.data_ptr()
    assert torch.equal(got, want)
    assert torch.equal(got[..., :d - rope], x[..., :d - rope])


def test_rope_cols_on_a_strided_view(kernel_device):
    """Heads of a wider buffer (head stride > D): only the view's rotated columns change."""
    g = _gen(5)
    t, heads, d, rope = 9, 3, 64, 16
    buf = (torch.randn(t, heads, 2 * d, generator=g)).to(torch.bfloat16).to(kernel_device)
    x = buf[:, :, :d]
    pos = torch.arange(100, 100 + t, device=kernel_device)
    inv = rope_inv_freq(rope, 10000.0, None).to(kernel_device)
    want = apply_rope(x.contiguous(), pos, inv)
    before = buf.clone()
    cos, sin = rope_table(pos, inv)
    rope_cols_(x, cos, sin)
    assert torch.equal(x, want)
    assert torch.equal(buf[:, :, d:], before[:, :, d:])


@pytest.mark.parametrize("t,heads,d,rope", [(2, 70, 128, 64), (5, 64, 512, 64), (130, 1, 64, 24), (3, 5, 32, 32)])
def test_rope_cols_is_rope_rows(t, heads, d, rope, kernel_device):
    """The bits of ``step_rope_v41.rope_rows`` (the unfused path) with fresh random rows and positions: more
    heads than a program takes (two head blocks, a partial one), all heads of a token in one program, several
    tokens per program (2D rows), a rope width that is not a power of two and one that is the whole row."""
    from redknot.kernels.triton.prefill_rows_v41 import rope_cols_shape
    from redknot.kernels.triton.step_rope_v41 import rope_rows

    g = _gen(7 * t + heads + d)
    x = (torch.randn(t, heads, d, generator=g) * 5).to(torch.bfloat16).to(kernel_device)
    if heads == 1:
        x = x[:, 0]
    pos = torch.randint(0, 1 << 20, (t,), generator=g).to(kernel_device)
    inv = rope_inv_freq(rope, 160000.0, (16.0, 65536, 32.0, 1.0)).to(kernel_device)
    cos, sin = rope_table(pos, inv)
    for inverse in (False, True):
        want = rope_rows(x, cos, sin, inverse=inverse)
        got = rope_cols_(x.clone(), cos, sin, inverse=inverse)
        assert torch.equal(got, want)
    bt, bh, hp = rope_cols_shape(t, heads, rope // 2)
    assert bt * bh * 2 * hp <= 4096 and bh <= max(heads, 1) * 2 and hp >= rope // 2


def test_rope_cols_refuses_bad_shapes(kernel_device):
    x = torch.zeros(2, 7, dtype=torch.bfloat16, device=kernel_device)
    cos = torch.zeros(2, 2, device=kernel_device)
    with pytest.raises(ValueError):
        rope_cols_(x, cos, cos)


# ---------------------------------------------------------------------- SwiGLU
def _swiglu_want(gate, up, limit, weight):
    a = F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)
    if weight is not None:
        a = a * weight.unsqueeze(-1)
    return a.to(gate.dtype)


@pytest.mark.parametrize("t,n", [(5, 64), (3, 2304 // 8 + 32), (17, 1100)])
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_rows_matches_pytorch(t, n, weighted, kernel_device):
    g = _gen(t * n + weighted)
    gate = (torch.randn(t, n, generator=g) * 6).to(torch.bfloat16).to(kernel_device)   # past the clamp too
    up = (torch.randn(t, n, generator=g) * 6).to(torch.bfloat16).to(kernel_device)
    weight = (torch.rand(t, generator=g) + 0.1).to(kernel_device) if weighted else None
    got = swiglu_rows(gate, up, 10.0, weight)
    want = _swiglu_want(gate, up, 10.0, weight)
    assert got.dtype == torch.bfloat16 and got.shape == (t, n)
    assert _rel(got, want) <= BF16_ULP
    assert (got != want).float().mean().item() < 0.02


def test_swiglu_rows_fp32_output_and_clamp(kernel_device):
    gate = torch.tensor([[-50.0, 0.0, 3.0, 50.0]], dtype=torch.bfloat16, device=kernel_device)
    up = torch.tensor([[1.0, 2.0, -50.0, 50.0]], dtype=torch.bfloat16, device=kernel_device)
    got = swiglu_rows(gate, up, 10.0, dtype=torch.float32)
    want = F.silu(gate.float().clamp(max=10.0)) * up.float().clamp(-10.0, 10.0)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30)


# ---------------------------------------------------------------------- combine + post mix
def _post_case(t, n, d, device, seed):
    g = _gen(seed)
    a = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16).to(device)
    b = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16).to(device)
    h = (torch.randn(t, n, d, generator=g) * 2).to(torch.bfloat16).to(device)
    post = (2 * torch.rand(t, n, generator=g)).to(device)
    comb = torch.softmax(torch.randn(t, n, n, generator=g), -1).to(device)
    return a, b, h, post, comb


@pytest.mark.parametrize("t,n,d", [(3, 4, 64), (5, 4, 96), (2, 2, 1536), (4, 1, 32)])
def test_add_post_equals_mhc_post_of_the_combine(t, n, d, kernel_device):
    a, b, h, post, comb = _post_case(t, n, d, kernel_device, seed=t + d)
    y = (a.float() + b.float()).to(torch.bfloat16)
    got = add_post(a, b, h, post, comb)
    assert torch.equal(got, mhc_post(y, h, post, comb))
    want = hc_expand(y, h, post, comb)
    assert _rel(got, want) <= BF16_ULP and (got != want).float().mean().item() < 0.05


def test_add_post_refuses_a_stream_count_not_a_power_of_two(kernel_device):
    a, b, h, post, comb = _post_case(2, 3, 32, kernel_device, seed=1)
    with pytest.raises(ValueError):
        add_post(a, b, h, post, comb)


# ---------------------------------------------------------------------- page rows of selected entries
@pytest.mark.parametrize("t,k,ratio,bs", [(9, 12, 2, 16), (5, 1500, 1, 4), (4, 8, 2, 4)])
def test_page_entries_equal_the_pytorch_ops(t, k, ratio, bs, kernel_device):
    from redknot.kernels.triton.prefill_rows_v41 import page_entries
    from redknot.models.deepseek_v41.kernel_ops import page_rows

    g = _gen(t * k + ratio)
    spans = 3
    blocks = 2 + (k * ratio) // bs
    table = torch.randint(0, 10 * blocks, (spans, blocks), generator=g)
    seg = torch.randint(0, spans, (t,), generator=g)
    sel = torch.randint(0, k, (t, k), generator=g)
    sel[torch.rand(t, k, generator=g) < 0.3] = -1                      # pads
    live = torch.tensor([True, False, True])
    sel, seg, table, live = (x.to(kernel_device) for x in (sel, seg, table, live))
    want = torch.where((sel >= 0) & live[seg][:, None],
                       page_rows(table, seg[:, None], sel.clamp(min=0), ratio, bs), -1)
    got = page_entries(sel, seg, live, table, ratio, bs)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert (got == -1).any() and (got >= 0).any()


# ---------------------------------------------------------------------- collapse
@pytest.mark.parametrize("t,n,d", [(3, 4, 64), (7, 4, 1100), (2, 2, 32)])
def test_collapse_rows_matches_hc_collapse(t, n, d, kernel_device):
    g = _gen(t * d)
    h = (torch.randn(t, n, d, generator=g) * 2).to(torch.bfloat16).to(kernel_device)
    pre = (torch.rand(t, n, generator=g) + 0.1).to(kernel_device)
    got = collapse_rows(h, pre)
    want = hc_collapse(h, pre)
    assert got.dtype == torch.bfloat16 and got.shape == (t, d)
    assert _rel(got, want) <= BF16_ULP
    assert (got != want).float().mean().item() < 0.05


# ---------------------------------------------------------------------- V4.1 sizes on the GPU
@pytest.mark.gpu
def test_gpu_prefill_rows_real_sizes():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, t = "cuda", 8192
    g = _gen(0)
    q = (torch.randn(t, 64, 512, generator=g)).to(torch.bfloat16).to(dev)
    pos = torch.arange(8192, 8192 + t, device=dev)
    inv = rope_inv_freq(64, 160000.0, (16.0, 65536, 32.0, 1.0)).to(dev)
    cos, sin = rope_table(pos, inv)
    for inverse in (False, True):
        assert torch.equal(rope_cols_(q.clone(), cos, sin, inverse=inverse), apply_rope(q, pos, inv, inverse=inverse))
    gate = (torch.randn(t, 2304, generator=g) * 4).to(torch.bfloat16).to(dev)
    up = (torch.randn(t, 2304, generator=g) * 4).to(torch.bfloat16).to(dev)
    got, want = swiglu_rows(gate, up, 10.0), _swiglu_want(gate, up, 10.0, None)
    assert (got != want).float().mean().item() < 1e-3 and _rel(got, want) <= BF16_ULP
    a, b, h, post, comb = _post_case(t, 4, 5120, dev, seed=3)
    y = (a.float() + b.float()).to(torch.bfloat16)
    assert torch.equal(add_post(a, b, h, post, comb), mhc_post(y, h, post, comb))
    pre = torch.rand(t, 4, device=dev) + 0.1
    assert _rel(collapse_rows(h, pre), hc_collapse(h, pre)) <= BF16_ULP


# ---------------------------------------------------------------------- fp32-accumulated linears of bf16 weights
def _acc_case(t, n, k, device, seed):
    from redknot.models.deepseek_v41.ref_math import Weights

    g = _gen(seed)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16).to(device)
    w = Weights({"gate.weight": (torch.randn(n, k, generator=g) * k ** -0.5).to(torch.bfloat16).to(device)},
                torch.bfloat16)
    return x, w


def test_acc_linear_is_plain_linear_off_cuda():
    from redknot.models.deepseek_v41.ref_math import acc_linear, plain_linear

    x, w = _acc_case(9, 24, 96, "cpu", 1)
    got = acc_linear(x, w, "gate.weight", torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, plain_linear(x, w, "gate.weight", torch.float32))
    x3 = x.view(3, 3, 96)
    assert torch.equal(acc_linear(x3, w, "gate.weight", torch.float32), plain_linear(x3, w, "gate.weight", torch.float32))


@pytest.mark.gpu
def test_gpu_acc_linear_router_and_compressor_sizes():
    """The bf16 GEMM writing fp32 against the fp32 GEMM at the router's and the compressor's V4.1 sizes: both sum
    exact products in fp32, so they differ by summation order only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.models.deepseek_v41.ref_math import acc_linear, plain_linear

    for n in (384, 512):
        x, w = _acc_case(8192, n, 5120, "cuda", n)
        got = acc_linear(x, w, "gate.weight", torch.float32)
        want = plain_linear(x, w, "gate.weight", torch.float32)
        assert got.dtype == torch.float32 and got.shape == want.shape
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, err
