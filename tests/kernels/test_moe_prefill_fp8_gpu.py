"""The FP8 tensor-core MoE prefill plans (``moe_prefill_fp8``) on the GPU at real V4.1 shapes against ``ref_v41``
(fresh random inputs, tolerance 3e-2 as ``checks_mx``), called directly and through ``moe_prefill`` (whose
first-use check must accept every plan)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import moe_mx, moe_prefill_fp8, stream_guard  # noqa: E402
from redknot.kernels.triton.checks_mx import REAL_V41, moe_batch, moe_inputs  # noqa: E402

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
