"""Two FP8 linears over the same rows with their row epilogues in two launches (``step_proj_v41.proj_rows``)
against the launches they replace: ``gemm_mx.linear_mx`` with the ``fp8`` decode, then ``rope_rows`` (norm,
RoPE, FP4 grid), bit for bit, with fresh random inputs; and against the PyTorch reference linear. Triton's CPU
interpreter here, V4.1 sizes on the GPU with ``-m gpu`` (``tests/kernels/test_step_proj_v41_gpu.py``)."""
import pytest
import torch

pytest.importorskip("triton")

from step_proj_cases import fp8_weight, reference

from redknot.kernels import ref_v41
from redknot.kernels.triton import gemm_mx
from redknot.kernels.triton.step_proj_v41 import Proj, proj_rows
from redknot.kernels.triton.step_rope_v41 import rope_table
from redknot.models.deepseek_v41.ref_math import rope_inv_freq


@pytest.fixture(autouse=True)
def _small_rows_class_off():
    """These tests compare the step's launches with the ``fp8`` launches they replace, bit for bit: the 1-4-row
    GEMV class (``step_proj_v41.small_choice``) off, so the ``fp8`` stream runs at every row count (the GEMV
    forms: ``test_step_proj_gemv_v41*``)."""
    from redknot.kernels import tuning_cache
    before = tuning_cache.small_rows_class()
    tuning_cache.use_small_rows_class(False)
    yield
    tuning_cache.use_small_rows_class(before)


def case_inputs(t, k, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=g) * 2).to(torch.bfloat16).to(device)
    x[0, :32] *= 50                                        # a group of another scale
    pos = torch.randint(0, 1 << 20, (t,), generator=g).to(device)
    return x, pos, g


# t=32: the rows of a batch-32 decode step, one 32-row MMA tile (``e2e_v41.py --step-rows`` runs the step there)
@pytest.mark.parametrize("t", [1, 3, 32])
@pytest.mark.parametrize("seed", [1, 2])
def test_qa_kv_pair_equals_linear_mx_and_rope_rows(t, seed, kernel_device):
    """wq_a -> norm, wkv -> norm + RoPE (the attention's first pair) at toy widths."""
    k, dq, dkv, rope = 256, 64, 64, 16
    x, pos, g = case_inputs(t, k, seed, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(rope, 10000.0, None).to(kernel_device))
    wa, sa = fp8_weight(dq, k, g, kernel_device)
    wkv, skv = fp8_weight(dkv, k, g, kernel_device)
    nq = (1 + 0.1 * torch.randn(dq, generator=g)).to(kernel_device)
    nkv = (1 + 0.1 * torch.randn(dkv, generator=g)).to(kernel_device)
    specs = [Proj(wa, sa, dq, norm_w=nq, eps=1e-6), Proj(wkv, skv, dkv, norm_w=nkv, eps=1e-6, rope=True)]
    got = proj_rows(x, specs, cos, sin)
    for spec, y in zip(specs, got):
        want = reference(x, spec, cos, sin)
        assert y.shape == want.shape and torch.equal(y, want)
    # and the linear itself against the PyTorch reference linear (QDQ'd rows x dequantised weight)
    plain = proj_rows(x, [Proj(wa, sa, dq)], cos, sin)[0].view(t, dq).float()
    ref = ref_v41.linear_mx(x, wa, sa, 32).float()
    assert ((plain - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2 * ref.abs().max()).all()


# t=1 with -m slow (~10 s interpreted): one row through the same two launches is held by the qa / kv pair test
# above (t=1, 3); t=4 keeps the head widths, the FP4 grid and the K slices by default
@pytest.mark.parametrize("t", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_heads_rope_and_index_query_grid(t, kernel_device):
    """wq_b -> per-head RoPE and the indexer's wq_b -> per-head RoPE + FP4 grid, different head widths and
    several K slices."""
    k, h, d, hi, di, rope = 2048, 3, 96, 2, 64, 32      # two K slices
    x, pos, g = case_inputs(t, k, 7 + t, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(rope, 160000.0, (16.0, 65536, 32.0, 1.0)).to(kernel_device))
    wq, sq = fp8_weight(h * d, k, g, kernel_device)
    wi, si = fp8_weight(hi * di, k, g, kernel_device)
    specs = [Proj(wq, sq, d, rope=True), Proj(wi, si, di, rope=True, qdq=True)]
    got = proj_rows(x, specs, cos, sin)
    for spec, y in zip(specs, got):
        assert torch.equal(y, reference(x, spec, cos, sin))


def test_wrong_weight_or_scale_is_detected(kernel_device):
    k, d = 128, 64
    x, pos, g = case_inputs(2, k, 3, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(16, 10000.0, None).to(kernel_device))
    w, s = fp8_weight(d, k, g, kernel_device)
    spec = Proj(w, s, d, rope=True)
    want = reference(x, spec, cos, sin)
    s2 = s.clone()
    s2.view(torch.uint8)[0, 0] += 1
    assert not torch.equal(proj_rows(x, [Proj(w, s2, d, rope=True)], cos, sin)[0], want)
    assert torch.equal(proj_rows(x, [spec], cos, sin)[0], want)


def test_refuses_bad_shapes(kernel_device):
    x, pos, g = case_inputs(1, 128, 4, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(16, 10000.0, None).to(kernel_device))
    w, s = fp8_weight(64, 128, g, kernel_device)
    with pytest.raises(ValueError, match="weight"):
        proj_rows(x[:, :96], [Proj(w, s, 64)], cos, sin)
    with pytest.raises(ValueError, match="qdq"):
        proj_rows(x, [Proj(w, s, 64, qdq=True), Proj(w[:48], s, 48, qdq=True)], cos, sin)


@pytest.mark.parametrize("t", [1, 3])
def test_kv_window_bytes_equal_cache_insert(t, kernel_device):
    """``pack``: the kv rows' window-cache bytes from the epilogue equal ``cache_insert_mx``'s of the kv output."""
    from redknot.kernels.triton.quant_mx import cache_insert_mx

    k, dq, dkv, rope = 256, 64, 64, 16
    x, pos, g = case_inputs(t, k, 11 + t, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(rope, 10000.0, None).to(kernel_device))
    wa, sa = fp8_weight(dq, k, g, kernel_device)
    wkv, skv = fp8_weight(dkv, k, g, kernel_device)
    nkv = (1 + 0.1 * torch.randn(dkv, generator=g)).to(kernel_device)
    specs = [Proj(wa, sa, dq), Proj(wkv, skv, dkv, norm_w=nkv, eps=1e-6, rope=True)]
    pack = torch.zeros(t, dkv + dkv // 32, dtype=torch.uint8, device=kernel_device)
    _, kv = proj_rows(x, specs, cos, sin, pack=pack)
    want = torch.zeros_like(pack)
    cache_insert_mx(want, torch.arange(t, device=kernel_device), kv.view(t, dkv), "window")
    assert torch.equal(pack, want) and want.any()
    assert torch.equal(kv, reference(x, specs[1], cos, sin))
    with pytest.raises(ValueError, match="pack"):
        proj_rows(x, specs[:1], cos, sin, pack=pack)


@pytest.mark.parametrize("t,d,n", [(1, 256, 4), (3, 1024, 4), (2, 96, 2)])
def test_linear_post_equals_linear_mx_then_mhc_post(t, d, n, kernel_device):
    """``linear_post``: the attention's output linear and the mHC post mix in two launches, bit for bit
    ``mhc_post(linear_mx(x, W))`` (``fp8`` decode); a shape ``mhc_post``'s blocks do not tile is refused."""
    from redknot.kernels.triton.mhc import mhc_post
    from redknot.kernels.triton.step_proj_v41 import linear_post

    k = 512
    x, _, g = case_inputs(t, k, 21 + t, kernel_device)
    w, s = fp8_weight(d, k, g, kernel_device)
    h = torch.randn(t, n, d, generator=g).to(torch.bfloat16).to(kernel_device)
    post = torch.rand(t, n, generator=g).to(kernel_device) * 2
    comb = torch.rand(t, n, n, generator=g).to(kernel_device)
    if d == 96:
        with pytest.raises(ValueError, match="linear_post"):
            linear_post(x, w, s, h, post, comb)
        return
    y = gemm_mx.linear_mx(x, w, s, 32, decode="fp8", path="splitk")
    got = linear_post(x, w, s, h, post, comb)
    assert torch.equal(got, mhc_post(y, h, post, comb))
    assert not torch.equal(linear_post(x, w, s, h, post * 1.5, comb), got)
