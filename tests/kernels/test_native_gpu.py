"""The native FP8 row packing (csrc/kv_fp8.cu) against its PyTorch statement, bit for bit."""
import pytest
import torch

from redknot.kernels import native

pytestmark = pytest.mark.gpu


def test_cuda_packing_equals_reference_bitwise(tmp_path):
    native.load("kv_fp8", build_root=tmp_path)
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(300, 512, generator=g) * torch.logspace(-6, 6, 300)[:, None]).bfloat16()
    rows[7, :64] = 0
    rows[8, 100] = 448.0 * 2 ** 3  # a tile whose amax / 448 is an exact power of two
    rows = rows.cuda()
    packed = native.pack_rows(rows)
    assert torch.equal(packed, native.pack_rows_reference(rows))
    assert torch.equal(native.unpack_rows(packed), native.unpack_rows_reference(packed))
    strided = torch.randn(64, 1024, device="cuda").bfloat16()[:, :512]  # rows with a stride
    assert torch.equal(native.pack_rows(strided), native.pack_rows_reference(strided))
