"""The q and kv row epilogues in one launch (``step_qkv_v41.rope_q_kv``) against the two ``rope_rows`` launches
they replace, bit for bit, with fresh random inputs (the tensor step and the eager layers must compute the same
bits). Triton's CPU interpreter here, the GPU with ``-m gpu`` (``tests/kernels/test_step_rows_v41_gpu.py``)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.step_qkv_v41 import rope_q_kv  # noqa: E402
from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table  # noqa: E402
from redknot.models.deepseek_v41.ref_math import apply_rope, rms_norm, rope_inv_freq  # noqa: E402


def qkv_inputs(t, heads, d, rope, device, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, heads, d, generator=g) * 3).to(dtype)
    kv = (torch.randn(t, d, generator=g) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).float()
    pos = torch.randint(0, 1 << 20, (t,), generator=g)
    inv = rope_inv_freq(rope, 160000.0, (16.0, 65536, 32.0, 1.0))
    return [x.to(device) for x in (q, kv, w, pos, inv)]


@pytest.mark.parametrize("case", [(1, 4, 64, 16), (3, 2, 128, 64), (2, 3, 512, 64), (5, 1, 96, 32)])
def test_rope_q_kv_equals_two_rope_rows_launches(case, kernel_device):
    t, heads, d, rope = case
    q, kv, w, pos, inv = qkv_inputs(t, heads, d, rope, kernel_device, seed=sum(case))
    cos, sin = rope_table(pos, inv)
    got_q, got_kv = rope_q_kv(q, kv, cos, sin, w, 1e-6)
    assert torch.equal(got_q, rope_rows(q, cos, sin))
    assert torch.equal(got_kv, rope_rows(kv, cos, sin, norm_w=w, eps=1e-6))
    assert torch.equal(got_q, apply_rope(q, pos, inv))                      # the rotation is exact
    want_kv = apply_rope(rms_norm(kv, w, 1e-6), pos, inv).float()
    assert ((got_kv.float() - want_kv).abs() <= 2 ** -7 * want_kv.abs().clamp(min=1e-2)).all()


def test_rope_q_kv_refuses_mismatched_rows(kernel_device):
    q, kv, w, pos, inv = qkv_inputs(2, 2, 64, 16, kernel_device, seed=1)
    cos, sin = rope_table(pos, inv)
    with pytest.raises(ValueError, match="kv"):
        rope_q_kv(q, kv[:1], cos, sin, w, 1e-6)
