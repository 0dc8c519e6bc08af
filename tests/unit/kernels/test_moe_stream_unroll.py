"""The block-diagonal FP8 MoE streams (``fp8hd`` / ``fp8hd4``) with several 4-group steps per loop iteration
(``StreamPlan.block_k`` above 128, ``moe_stream_fp8h.diag_unroll``) against ``ref_v41`` and against the one-step
plans, on the GPU or through the Triton interpreter at small sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import moe_mx, moe_stream, stream_guard
from redknot.kernels.triton.checks_mx import V41Dims, moe_inputs
from redknot.kernels.triton.moe_stream import StreamPlan
from redknot.kernels.triton.moe_stream_fp8h import diag_unroll
from slow_grid import rotated_grid

# W1 | W3: K = 512 (4 steps of 128), W2: K = 384 (3 steps): block_k 512 unrolls 4 / 3, 256 unrolls 2 / 1
DIMS = V41Dims(hidden=512, experts=5, topk_experts=2, moe_inter=384, tokens=9)
# W2 K = 256 (2 steps): block_k 256 unrolls W1 | W3 (K = 384, 3 steps) not at all and W2 by 2
DIMS_B = V41Dims(hidden=256, experts=4, topk_experts=3, moe_inter=384, tokens=7)
UNROLLED = [StreamPlan("fp8hd4", 64, 512, 4, 2), StreamPlan("fp8hd4", 64, 256, 4, 3), StreamPlan("fp8hd4", 64, 256, 4, 4),
            StreamPlan("fp8hd", 64, 512, 4, 2)]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _id(p):
    return f"{p.decode}-{p.block_n}x{p.block_k}-s{p.num_stages}-m{p.min_steps}"


def test_diag_unroll_divides_every_slice():
    # V4.1: W1 | W3 K = 5120 (40 steps), W2 K = 2304 (18 steps), one K slice
    assert diag_unroll(5120, 5120, 512) == 4 and diag_unroll(5120, 5120, 256) == 2
    assert diag_unroll(2304, 2304, 512) == 3 and diag_unroll(2304, 2304, 256) == 2
    assert diag_unroll(2304, 2304, 128) == 1 and diag_unroll(2304, 2304, 64) == 1
    # K slices of 6 steps, the last one 4 (K = 2048 in slices of 768): both divisible by 2, not by 3 or 4
    assert diag_unroll(2048, 768, 512) == 2
    for K, ksplit, bk in [(5120, 1280, 512), (2304, 1152, 512), (1664, 640, 512), (384, 384, 512)]:
        u = diag_unroll(K, ksplit, bk)
        lo = list(range(0, K, ksplit))
        assert all(((min(K, k + ksplit) - k) // 128) % u == 0 for k in lo), (K, ksplit, u)


@pytest.mark.parametrize("plan,dims,tokens,seed",
                         rotated_grid([(p,) for p in UNROLLED], [(DIMS, 9, 71), (DIMS_B, 7, 72)],
                                      [_id(p) for p in UNROLLED], ["k512", "k256"]))
def test_unrolled_stream_matches_reference(plan, dims, tokens, seed, kernel_device):
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=seed, tokens=tokens)
    out = moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan)
    assert out.shape == (tokens, dims.hidden) and out.dtype == torch.bfloat16
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2


@pytest.mark.parametrize("plan", [UNROLLED[0], pytest.param(UNROLLED[1], marks=pytest.mark.slow),
                                  pytest.param(UNROLLED[3], marks=pytest.mark.slow)], ids=_id)
def test_unrolled_stream_has_the_bits_of_one_step_per_iteration(plan, kernel_device):
    """The unrolled loop runs the same operations on the accumulators in the same K order as block_k 128."""
    x, idx, wt, w = moe_inputs(DIMS, kernel_device, seed=73, tokens=11)
    one = StreamPlan(plan.decode, plan.block_n, 128, plan.num_warps, plan.num_stages)
    assert torch.equal(moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan),
                       moe_stream.moe_stream(x, idx, wt, *w, 10.0, one))


def test_unrolled_stream_with_k_slices(kernel_device):
    """K slices (fp32 partials and the split-K reductions) with an unrolled loop in each slice."""
    x, idx, wt, w = moe_inputs(DIMS, kernel_device, seed=74, tokens=6)
    plan = StreamPlan("fp8hd4", 64, 256, 4, 3, min_steps=1)
    assert moe_stream.slices(DIMS.moe_inter, DIMS.hidden, plan) > 1
    assert _rel(moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan), ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2


def test_unrolled_stream_token_is_batch_invariant(kernel_device):
    x, idx, wt, w = moe_inputs(DIMS, kernel_device, seed=75, tokens=13)
    plan = UNROLLED[0]
    full = moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan)
    alone = moe_stream.moe_stream(x[4:5], idx[4:5], wt[4:5], *w, 10.0, plan)
    assert torch.equal(alone, full[4:5])


@pytest.mark.parametrize("which", ["w1", "w2"])
def test_unrolled_stream_detects_a_wrong_weight(which, kernel_device):
    """A wrong byte in one 128-wide K step past the first of an iteration fails the tolerance."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(DIMS, kernel_device, seed=76, tokens=5)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    w1, w2 = w1.clone(), w2.clone()
    bad = w1 if which == "w1" else w2
    bad.view(torch.uint8)[:, :, 128:192] ^= 0x77  # K elements 256-383: the third step of W1 | W3, W2's last
    assert _rel(moe_stream.moe_stream(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0, UNROLLED[0]), want) > 0.1


def test_unrolled_plans_are_tuner_candidates_and_pass_the_stream_check(kernel_device):
    device = torch.device(kernel_device)
    held = [p for p in moe_mx.DECODE_TUNER.candidates if isinstance(p, StreamPlan) and p.block_k > 128]
    assert held and all(p.decode in ("fp8hd", "fp8hd4") for p in held)
    for plan in held:
        assert stream_guard.stream_check(plan, device) is None, plan
