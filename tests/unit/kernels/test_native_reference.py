"""The plain-PyTorch statement of the native FP8 row packing (the CUDA kernel is compared with it on a GPU)."""
import torch

from redknot.kernels import native


def test_fp8_row_packing_reference_layout_and_error_bound():
    g = torch.Generator().manual_seed(0)
    rows = (torch.randn(40, 512, generator=g) * torch.logspace(-4, 4, 40)[:, None]).bfloat16()
    rows[5, 64:128] = 0  # an all-zero tile
    packed = native.pack_rows_reference(rows)
    assert packed.shape == (40, 584) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 448:576].contiguous().view(torch.bfloat16), rows[:, 448:])  # rope kept exactly
    exps = packed[:, 576:583].long() - 127
    amax = rows[:, :448].float().view(40, 7, 64).abs().amax(-1)
    scale = torch.ldexp(torch.ones_like(amax), exps.float())
    nz = amax > 0
    assert (amax[nz] / scale[nz] <= 448).all() and (amax[nz] / scale[nz] > 224).all()  # smallest power of two
    assert exps[5, 1] == 0 and (packed[5, 64:128] == 0).all() and (packed[:, 583] == 0).all()
    back = native.unpack_rows_reference(packed)
    err = (back[:, :448].float() - rows[:, :448].float()).abs().view(40, 7, 64)
    assert (err <= scale[..., None] * 16).all()  # half an e4m3 step in the top binade [256, 448) is 16
    assert torch.equal(back[:, 448:], rows[:, 448:])
