"""``step_attention_mx`` with ``AttnMxConfig.window_two_loads``: a window row's bytes as two masked loads (the ring,
the step's own rows) combined by value instead of one load through a per-row pointer. The same values, so the same
output bits as the one-load launch of the same shape, on fresh random rings, step rows and compressed pages (rows
reading both the ring and their request's own step rows, a row at position 0, rows without compressed entries), and
within tolerance of ``step_attention_reference``. GPU when there is one, else the Triton interpreter."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton.attention_mx import (
    ATTN_MX_PREFILL_TUNER,
    ATTN_MX_TUNER,
    AttnMxConfig,
)
from redknot.kernels.triton.step_attention_mx import (
    step_attention_mx,
    step_attention_reference,
)


def _case(device, seed, heads, d, window, ring_size, rows_per_req, ctx, n_comp, k):
    g = torch.Generator().manual_seed(seed)
    pos, back, slot = [], [], []
    for b, (n, c) in enumerate(zip(rows_per_req, ctx)):
        pos += list(range(c, c + n))
        back += list(range(n))
        slot += [b] * n
    pos, back, slot = torch.tensor(pos), torch.tensor(back), torch.tensor(slot)
    t, s = pos.shape[0], len(rows_per_req) + 1
    ring = mx.pack_window_rows(torch.randn(s * ring_size, d, generator=g))
    new = mx.pack_window_rows(torch.randn(t, d, generator=g))
    comp = mx.pack_compressed_entries(torch.randn(n_comp, d, generator=g))
    cidx = torch.randint(0, n_comp, (t, k), generator=g)
    cidx = torch.where(torch.rand(t, k, generator=g) < 0.3, torch.full_like(cidx, -1), cidx)
    cidx[0] = -1
    q = (torch.randn(t, heads, d, generator=g) * 0.2).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=g)
    return [q.to(device), ring.to(device), ring_size, new.to(device), slot.to(device), pos.to(device),
            back.to(device), window, sinks.to(device), d ** -0.5, comp.to(device), cidx.to(device)]


CASES = [(4, 64, 16, 16, [1, 1, 1], [40, 3, 0], 50, 8), (3, 64, 16, 19, [4, 1, 3], [30, 2, 17], 33, 12)]


def test_the_tuner_holds_two_load_shapes_for_the_step_only():
    assert any(c.window_two_loads for c in ATTN_MX_TUNER.candidates)
    assert not any(getattr(c, "window_two_loads", False) for c in ATTN_MX_PREFILL_TUNER.candidates)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("cfg", [AttnMxConfig(64, 32, 8, 1), AttnMxConfig(32, 16, 8, 3), AttnMxConfig(16, 16, 4, 2)],
                         ids=str)
def test_two_loads_give_the_one_load_bits(case, cfg, kernel_device):
    args = _case(kernel_device, 3 + case, *CASES[case])
    one = step_attention_mx(*args, config=cfg)
    two = step_attention_mx(*args, config=dataclasses.replace(cfg, window_two_loads=True))
    assert torch.equal(one, two)
    want = step_attention_reference(*args).float()
    assert (two.float() - want).abs().max().item() / want.abs().max().item() < 1.5e-2
    # without compressed entries
    one = step_attention_mx(*args[:-2], config=cfg)
    two = step_attention_mx(*args[:-2], config=dataclasses.replace(cfg, window_two_loads=True))
    assert torch.equal(one, two)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [[1] * 32, [4, 2, 3, 1]])
def test_gpu_two_loads_at_real_width(rows):
    """V4.1 width (64 heads of 512, 128-row window ring, 512 compressed entries): every two-load tuner shape gives the
    bits of its one-load shape."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _case("cuda", 5, 64, 512, 128, 128, rows, [8000 + 7 * i for i in range(len(rows))], 4096, 512)
    for cfg in [c for c in ATTN_MX_TUNER.candidates if c.window_two_loads]:
        one = step_attention_mx(*args, config=dataclasses.replace(cfg, window_two_loads=False))
        assert torch.equal(step_attention_mx(*args, config=cfg), one), cfg
