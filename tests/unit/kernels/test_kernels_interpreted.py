"""Every Triton kernel against its reference at toy dimensions (Triton's CPU interpreter without a GPU).

The same checks run at V4 dimensions on a GPU (tests/kernels) and in ``benchmarks/kernels_v4.py``.
fp32 uses exact (FMA) dots: tolerance 1e-5; bf16 rounds operands: 1e-2 (norm-wise relative error).
"""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.checks import ALL_CHECKS, TOY  # noqa: E402

FAST = [(name, torch.float32) for name in ALL_CHECKS] + [
    (name, torch.bfloat16) for name in ("moe", "linear", "rms_norm+rope", "mhc")]
SLOW = [(name, torch.bfloat16) for name in ("sparse_attention", "indexer_topk")]


def _assert_all_pass(rows):
    assert rows, "the check produced no comparisons"
    failed = [r.line() for r in rows if not r.ok]
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("name,dtype", FAST, ids=[f"{n}-{str(d)[6:]}" for n, d in FAST])
def test_kernel_matches_reference(name, dtype, kernel_device):
    _assert_all_pass(ALL_CHECKS[name](TOY, kernel_device, dtype, seed=1))


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", SLOW, ids=[f"{n}-{str(d)[6:]}" for n, d in SLOW])
def test_kernel_matches_reference_bf16(name, dtype, kernel_device):
    _assert_all_pass(ALL_CHECKS[name](TOY, kernel_device, dtype, seed=2))
