"""V4's compressor pooling in one launch (``triton.compress``, the Triton backend's ``compressor`` op) against the
reference op; through the Triton interpreter on the CPU, or on the GPU (``-m gpu``: V4's widths)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_attention
from redknot.kernels.triton import compress
from redknot.kernels.triton import ops as triton_ops

# (ratio, overlap, has_prev, windows, hd): CSA's overlapping windows of 4 with and without the previous window,
# HCA-like plain windows (8, and 128 as V4's HCA), a channel count that is not a power of two
CASES = [(4, True, True, 5, 32), (4, True, False, 3, 32), (8, False, False, 3, 48), (128, False, False, 2, 64),
         (4, True, False, 2, 40)]


def _inputs(ratio, overlap, windows, hd, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    c = 2 * hd if overlap else hd
    kv = torch.randn(windows * ratio, c, generator=g, device=device).to(dtype)
    gate = (2 * torch.randn(windows * ratio, c, generator=g, device=device)).to(dtype)
    ape = torch.randn(ratio, c, generator=g, device=device)
    return kv, gate, ape


@pytest.mark.parametrize("ratio,overlap,has_prev,windows,hd", CASES,
                         ids=[f"r{r}-{'csa' if o else 'hca'}{'-prev' if p else ''}-{w}x{h}" for r, o, p, w, h in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compress_matches_the_reference_op(ratio, overlap, has_prev, windows, hd, dtype, kernel_device):
    kv, gate, ape = _inputs(ratio, overlap, windows, hd, dtype, kernel_device)
    got = compress.compress(kv, gate, ape, ratio, overlap, has_prev)
    want = ref_attention.compressor(kv, gate, ape, ratio, overlap, has_prev)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_compress_with_rows_before_position_zero(kernel_device):
    """A decode step pools rings whose rows before position 0 hold kv 0 and gate -inf (``pool_ring_windows``):
    they take no weight, as in the reference."""
    kv, gate, ape = _inputs(4, True, 4, 32, torch.float32, kernel_device, seed=3)
    kv[:6], gate[:6] = 0.0, float("-inf")
    got = compress.compress(kv, gate, ape, 4, True, False)
    want = ref_attention.compressor(kv, gate, ape, 4, True, False)
    torch.testing.assert_close(got[1:], want[1:], rtol=2e-6, atol=2e-6)  # entry 0: every slot -inf (NaN in both)
    assert torch.isfinite(got[1:]).all()


def test_the_op_falls_back_where_the_kernel_does_not_apply(kernel_device):
    """A ratio that is not a power of two runs the reference op (same values); ``compress`` itself refuses it
    with a message naming the shapes."""
    kv, gate, ape = _inputs(3, False, 2, 16, torch.float32, kernel_device)
    assert not compress.supported(kv, gate, ape, 3)
    torch.testing.assert_close(triton_ops.compressor(kv, gate, ape, 3, False, False),
                               ref_attention.compressor(kv, gate, ape, 3, False, False))
    with pytest.raises(ValueError, match="ratio 3"):
        compress.compress(kv, gate, ape, 3, False, False)
    kv, gate, ape = _inputs(4, True, 3, 16, torch.float32, kernel_device)
    assert compress.supported(kv, gate, ape, 4)
    torch.testing.assert_close(triton_ops.compressor(kv, gate, ape, 4, True, True),
                               ref_attention.compressor(kv, gate, ape, 4, True, True), rtol=2e-6, atol=2e-6)


@pytest.mark.gpu
def test_gpu_compress_at_v4_widths():
    """V4's compressors: CSA (ratio 4, overlapping, 512 channels a half), the indexer's (ratio 4, 128), HCA
    (ratio 128, 512), decode-sized (2 windows) and prefill-sized (a 4096-row chunk)."""
    for ratio, overlap, hd in [(4, True, 512), (4, True, 128), (128, False, 512)]:
        for rows in (2 * ratio, 4096):
            for has_prev in ((False, True) if overlap else (False,)):
                kv, gate, ape = _inputs(ratio, overlap, rows // ratio, hd, torch.bfloat16, "cuda")
                got = compress.compress(kv, gate, ape, ratio, overlap, has_prev)
                want = ref_attention.compressor(kv, gate, ape, ratio, overlap, has_prev)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
