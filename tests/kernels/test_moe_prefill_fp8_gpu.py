"""The FP8 tensor-core MoE prefill plans (``moe_prefill_fp8``) on the GPU at real V4.1 shapes against ``ref_v41``
(fresh random inputs, tolerance 3e-2 as ``checks_mx``), called directly and through ``moe_prefill`` (whose
first-use check must accept every plan)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import moe_mx, moe_prefill_fp8, stream_guard
from redknot.kernels.triton.checks_mx import REAL_V41, moe_batch, moe_inputs

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

FP8_PLANS = [p for p in moe_mx.PREFILL_TUNER.candidates if p.path == "fp8"]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def case():
    w = moe_inputs(REAL_V41, "cuda", seed=5, tokens=1)[3]
    x, idx, wt = moe_batch(REAL_V41, 2048, 23, "cuda")
    return x, idx, wt, w, ref_v41.moe_mx(x, idx, wt, *w, 10.0)


IDS = [f"{p.decode}-{p.block_m}x{p.block_n}-bk{p.block_k}" for p in FP8_PLANS]


@pytest.mark.parametrize("plan", FP8_PLANS, ids=IDS)
def test_fp8_prefill_plans_at_v41_shapes(plan, case):
    x, idx, wt, w, want = case
    direct = moe_prefill_fp8.moe_prefill_fp8(x, idx, wt, *w, 10.0, plan)
    assert _rel(direct, want) <= 3e-2
    through = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
    assert plan not in stream_guard.DECODE_ERRORS, stream_guard.DECODE_ERRORS.get(plan)
    assert torch.equal(through, direct)


FOLD_PLANS = [p for p in FP8_PLANS if p.decode == "fp8f"]


@pytest.mark.parametrize("plan", FOLD_PLANS, ids=[f"{p.block_m}x{p.block_n}-w{p.num_warps}" for p in FOLD_PLANS])
def test_fold_is_the_per_group_scaling_bit_for_bit(plan, case):
    """``moe_prefill_fold`` at V4.1 shapes: every program of these weights folds (scale bytes within its exact range)
    and the W1 | W3 launch's W2 input equals the per-group scaling's (``fold=False``) bit for bit: the folded MMA
    results are the unfolded ones times powers of two on the tensor cores too."""
    from redknot.kernels.triton.moe_prefill_fold import prefill_gemm_fold
    from redknot.kernels.triton.splitk_mx import tile_map
    x, idx, wt, w, _ = case
    rows, _, offs, wsort, xq, xs = moe_prefill_fp8.prefill_inputs(x, idx, wt, w[0].shape[0], plan)
    M = idx.numel()
    tiles = tile_map(offs, plan.block_m, M)
    flags = torch.full((tiles[3] * -(-w[0].shape[1] // plan.block_n),), -1, dtype=torch.int32, device="cuda")
    kw = {"offs": offs, "rowid": rows, "w3": w[2], "ws3": w[3], "wt": wsort, "limit": 10.0, "tiles": tiles}
    aq, sa = prefill_gemm_fold(xq, xs, w[0], w[1], M, plan, flags=flags, **kw)
    bq, sb = prefill_gemm_fold(xq, xs, w[0], w[1], M, plan, fold=False, **kw)
    live = tiles[0].repeat_interleave(-(-w[0].shape[1] // plan.block_n)) >= 0
    assert bool((flags[live] == 1).all())
    assert torch.equal(aq.view(torch.uint8), bq.view(torch.uint8)) and torch.equal(sa, sb)
