"""The split-attention merge (``attention_mx.merge_splits``, one launch shared by the span and the step kernels)
against the merge written out in float64: fresh random partials, split counts that are not powers of two, and
splits that saw no key (their running max is the sink, their sum and denominator 0)."""
import math

import pytest
import torch

from redknot.kernels.triton.attention_mx import merge_splits

LOG2E = 1.0 / math.log(2.0)


def _merge64(part, ml, sink):
    m, l = ml[..., 0].double(), ml[..., 1].double()                     # [T, S, H], log2 units
    top = torch.maximum(m.amax(1), sink.double() * LOG2E)               # the sink bounds every split's max
    wgt = torch.exp2(m - top[:, None])
    denom = (wgt * l).sum(1) + torch.exp2(sink.double() * LOG2E - top)
    return (wgt[..., None] * part.double()).sum(1) / denom[..., None]


def _partials(t, s, h, d, seed, empty=()):
    g = torch.Generator().manual_seed(seed)
    sink = torch.randn(h, generator=g)
    m = sink * LOG2E + torch.rand(t, s, h, generator=g) * 6.0           # maxima start at the sink
    l = torch.rand(t, s, h, generator=g) * 40.0 + 1.0
    part = torch.randn(t, s, h, d, generator=g) * l[..., None]
    for sp in empty:                                                     # a split without keys
        m[:, sp] = sink * LOG2E
        l[:, sp] = 0.0
        part[:, sp] = 0.0
    return part, torch.stack([m, l], -1), sink


@pytest.mark.parametrize("t,s,h,d,empty", [(3, 5, 4, 64, ()), (2, 16, 3, 32, (0, 7, 15)), (1, 32, 2, 16, (31,)),
                                           (2, 3, 5, 128, (1,))])
def test_merge_matches_float64(t, s, h, d, empty, kernel_device):
    part, ml, sink = _partials(t, s, h, d, seed=t * 100 + s, empty=empty)
    want = _merge64(part, ml, sink)
    out = torch.empty(t, h, d, dtype=torch.float32, device=kernel_device)
    got = merge_splits(part.to(kernel_device), ml.to(kernel_device), sink.to(kernel_device), out).double().cpu()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


def test_merge_writes_a_strided_bf16_output(kernel_device):
    """The output may be a view (heads not innermost-contiguous rows) in bf16: each row lands in its place."""
    part, ml, sink = _partials(2, 4, 3, 32, seed=9)
    want = _merge64(part, ml, sink)
    buf = torch.zeros(2, 5, 32, dtype=torch.bfloat16, device=kernel_device)
    out = buf[:, 1:4]                                                   # [2, 3, 32], stride(0) = 160
    merge_splits(part.to(kernel_device), ml.to(kernel_device), sink.to(kernel_device), out)
    assert torch.allclose(out.double().cpu(), want, rtol=1e-2, atol=1e-2)
    assert not buf[:, 0].any() and not buf[:, 4].any()


def test_a_wrong_sink_is_caught(kernel_device):
    """Negative control: the same partials merged with another sink differ beyond the tolerance."""
    part, ml, sink = _partials(2, 5, 3, 32, seed=3, empty=(2,))
    want = _merge64(part, ml, sink)
    out = torch.empty(2, 3, 32, dtype=torch.float32, device=kernel_device)
    got = merge_splits(part.to(kernel_device), ml.to(kernel_device), (sink + 1.0).to(kernel_device), out)
    assert not torch.allclose(got.double().cpu(), want, rtol=1e-5, atol=1e-6)
