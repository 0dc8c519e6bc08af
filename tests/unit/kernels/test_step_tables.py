"""The step tables' Triton launches (``step_tables``: ``rope_cos_sin``, ``ring_write``) against the reference ops
on fresh random inputs: angles at far positions and several table widths (rows over several programs), 32- and
64-bit positions; ring rows of shuffled slots at positions that wrap, values cast to the ring's dtype, values that
are a column slice of a wider row (the projection group's outputs)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import reference as ref
from redknot.kernels.triton import ops as triton_ops


def _seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


@pytest.mark.parametrize("rows,half", [(1, 32), (3, 16), (150, 32), (7, 5)])
@pytest.mark.parametrize("dtype", [torch.long, torch.int32])
def test_rope_cos_sin_matches_the_reference(rows, half, dtype, kernel_device):
    g = torch.Generator().manual_seed(_seed())
    pos = torch.randint(0, 1 << 20, (rows,), generator=g)
    pos[0] = 0
    inv = 1.0 / (160000.0 ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    p, i = pos.to(kernel_device, dtype), inv.to(kernel_device)
    want = ref.rope_cos_sin(p, i)
    got = triton_ops.rope_cos_sin(p, i)
    for x, y in zip(got, want):
        assert x.shape == y.shape == (rows, half) and x.dtype == torch.float32
        torch.testing.assert_close(x, y, rtol=0, atol=2e-6)
    assert not torch.equal(got[0], got[1])  # cos and sin, not one table twice


@pytest.mark.parametrize("ring_dtype,val_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("width", [64, 1536])
def test_ring_write_matches_the_reference(ring_dtype, val_dtype, width, kernel_device):
    g = torch.Generator().manual_seed(_seed())
    slots, ring_len, b = 6, 16, 4
    ring = torch.randn(slots, ring_len, width, generator=g).to(ring_dtype)
    wide = torch.randn(b, width + 96, generator=g).to(val_dtype)
    values = wide[:, 32:32 + width]   # a column slice: rows strided
    seq = torch.randperm(slots, generator=g)[:b].to(torch.int32)
    pos = torch.tensor([0, 15, 16, 1000003])
    want = ring.clone().to(kernel_device)
    got = ring.clone().to(kernel_device)
    args = (values.to(kernel_device), seq.to(kernel_device), pos.to(kernel_device))
    ref.ring_write(args[0], want, *args[1:])
    triton_ops.ring_write(args[0], got, *args[1:])
    assert torch.equal(got, want)
    assert not torch.equal(want.cpu(), ring)  # rows were written


@pytest.mark.parametrize("ratio,width", [(128, 64), (4, 2048), (8, 3)])
def test_visible_entries_match_the_reference(ratio, width, kernel_device):
    """Rows before their first entry (all -1), rows that see part of the width and rows past it."""
    g = torch.Generator().manual_seed(_seed())
    pos = torch.cat([torch.tensor([0, ratio - 2, ratio - 1]), torch.randint(0, ratio * width * 2, (5,), generator=g)])
    p = pos.to(kernel_device)
    want = ref.visible_entries(p, ratio, width)
    got = triton_ops.visible_entries(p, ratio, width)
    assert got.dtype == want.dtype == torch.long and torch.equal(got, want)
    assert (want[0] == -1).all() and want[2, 0] == 0
