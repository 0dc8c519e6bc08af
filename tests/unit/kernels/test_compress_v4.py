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


def _decode_state(ratio, overlap, hd, positions, device, ring_len=None, seed=0, dtype=torch.bfloat16):
    """Rings, pool and one decode step's rows for sequences at ``positions`` (slots 0..B-1), with index tensors
    as ``compressor_decode_rows`` makes them (random pool rows and angles)."""
    from redknot.kernels.ref_attention import ring_window_rows
    g = torch.Generator(device=device).manual_seed(seed)
    c = 2 * hd if overlap else hd
    span = 2 * ratio if overlap else ratio
    R = ring_len or span
    B = len(positions)
    pos = torch.tensor(positions, device=device)
    slots = torch.arange(B, device=device)
    kv_ring = torch.randn(B, R, c, generator=g, device=device)
    gate_ring = 2 * torch.randn(B, R, c, generator=g, device=device)
    pool = torch.randn(B * 8, 4, hd, generator=g, device=device).to(dtype)
    kv = torch.randn(B, c, generator=g, device=device).to(dtype)  # the projections' dtype
    gate = (2 * torch.randn(B, c, generator=g, device=device)).to(dtype)
    ape = torch.randn(ratio, c, generator=g, device=device)
    weight = 1 + 0.1 * torch.randn(hd, generator=g, device=device)
    half = min(32, hd // 4)
    ang = torch.rand(B, half, generator=g, device=device) * 6.28
    ring_dest = slots * R + pos % R
    src, valid = ring_window_rows(pos, slots, span, R)
    closes = ((pos + 1) % ratio == 0)[:, None]
    dest = torch.randperm(B * 8 * 4, generator=g, device=device)[:B]
    return (kv, gate, kv_ring, gate_ring, ring_dest, src, valid, ape, weight, 1e-6, ratio, overlap, ang.cos(),
            ang.sin(), closes, dest, pool)


# (ratio, overlap, hd, positions): CSA-like windows of 4 with the window before (closing, not closing, the first
# window: positions 3 and 1, before any previous window), HCA-like windows of 16 and 128 (one position closes)
DECODE_CASES = [(4, True, 32, [11, 6, 3, 1]), (16, False, 64, [31, 40, 15]), (128, False, 32, [127, 300])]


@pytest.mark.parametrize("ratio,overlap,hd,positions", DECODE_CASES,
                         ids=[f"r{r}-{'csa' if o else 'hca'}-{h}" for r, o, h, _ in DECODE_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_compress_decode_matches_the_reference_op(ratio, overlap, hd, positions, dtype, kernel_device):
    """The decode launch against the reference composition: the rings get this step's rows exactly, the pool
    rows of closing positions the normed, roped entry (fp32 sums in another order; bf16 rows and pool: one
    rounding apart at most), every other pool row keeps its bits."""
    args = _decode_state(ratio, overlap, hd, positions, kernel_device, dtype=dtype)
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref_attention.compressor_decode(*want)
    got = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert compress.decode_supported(got[0], got[1], got[2], got[3], got[7], got[8], ratio, got[12], got[16])
    compress.compress_decode(*got)
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])  # the rings
    closes, dest = args[14].reshape(-1), args[15]
    assert closes.any() and not closes.all()
    pool_got, pool_want = got[16].view(-1, hd), want[16].view(-1, hd)
    keep = torch.ones(pool_got.shape[0], dtype=torch.bool, device=kernel_device)
    keep[dest[closes]] = False
    assert torch.equal(pool_got[keep], pool_want[keep])
    assert not torch.equal(pool_want[dest[closes]], args[16].view(-1, hd)[dest[closes]])  # the op wrote them
    tol = 2e-6 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(pool_got[dest[closes]].float(), pool_want[dest[closes]].float(), rtol=tol, atol=tol)


def test_the_decode_op_runs_in_the_model_and_falls_back(kernel_device):
    """The Triton backend's ``compressor_decode`` takes the launch where it applies and the composition of its
    own ops where it does not (an entry width that is not a power of two): both equal the reference op."""
    args = _decode_state(4, True, 32, [7, 2], kernel_device, seed=5)
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    ref_attention.compressor_decode(*want)
    got = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    triton_ops.compressor_decode(*got)
    torch.testing.assert_close(got[16].float(), want[16].float(), rtol=1.6e-2, atol=1e-2)
    odd = _decode_state(4, True, 24, [7, 2], kernel_device, seed=5)
    assert not compress.decode_supported(odd[0], odd[1], odd[2], odd[3], odd[7], odd[8], 4, odd[12], odd[16])
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in odd]
    ref_attention.compressor_decode(*want)
    got = [a.clone() if isinstance(a, torch.Tensor) else a for a in odd]
    triton_ops.compressor_decode(*got)
    torch.testing.assert_close(got[16].float(), want[16].float(), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(got[2], want[2])


@pytest.mark.gpu
def test_gpu_compress_decode_at_v4_widths():
    """The decode launch at V4's widths on the GPU (CSA 512 + 512 channels, the indexer's 128 + 128, HCA 512 with
    windows of 128; 32 rows at positions that close and that do not) against the reference op."""
    for ratio, overlap, hd in [(4, True, 512), (4, True, 128), (128, False, 512)]:
        span = 2 * ratio if overlap else ratio
        positions = [(7 * i + (ratio - 1 if i % 3 == 0 else 1)) * span + span - 1 if i % 3 == 0 else 5 * i + 2
                     for i in range(32)]
        for dtype in (torch.float32, torch.bfloat16):
            args = _decode_state(ratio, overlap, hd, positions, "cuda", ring_len=span, dtype=dtype)
            want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            ref_attention.compressor_decode(*want)
            got = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            compress.compress_decode(*got)
            assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
            tol = 1e-5 if dtype == torch.float32 else 1.6e-2
            torch.testing.assert_close(got[16].float(), want[16].float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("ratio,overlap,ring,per_block", [(4, True, 8, 16), (4, True, 128, 4), (128, False, 128, 2)])
def test_decode_rows_match_the_reference_op(ratio, overlap, ring, per_block, kernel_device):
    """The compressor's per-step index tensors in one launch against the reference op: rows before position 0,
    positions that close a window and that do not, shuffled slots, block tables, far positions' angles."""
    g = torch.Generator().manual_seed(ratio + ring)
    positions = torch.tensor([0, 2, ratio - 1, 2 * ratio - 1, 5 * ratio + 1, 40 * ratio - 1, 300000 * ratio - 1],
                             dtype=torch.long)
    b = positions.shape[0]
    slots = torch.randperm(b + 2, generator=g)[:b].to(torch.int32)
    blocks = (positions // ratio) // per_block + 2
    tables = torch.randint(0, 1000, (b, int(blocks.max())), generator=g, dtype=torch.int32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    args = [x.to(kernel_device) for x in (positions, slots, tables)]
    want = ref_attention.compressor_decode_rows(*args, ring, ratio, overlap, per_block, inv.to(kernel_device))
    got = triton_ops.compressor_decode_rows(*args, ring, ratio, overlap, per_block, inv.to(kernel_device))
    names = ("ring_dest", "window_src", "window_valid", "cos", "sin", "closes", "pool_dest")
    for name, x, y in zip(names, got, want):
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if name in ("cos", "sin"):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
        else:
            assert torch.equal(x, y), name
    assert want[5].any() and not want[5].all() and not want[2].all()
    # positions 32 bits wide (a graph's buffer): the same tensors
    again = triton_ops.compressor_decode_rows(args[0].to(torch.int32), *args[1:], ring, ratio, overlap, per_block,
                                              inv.to(kernel_device))
    assert all(torch.equal(x, y) for x, y in zip(again, got))
