"""The fused MoE decode streams (every ``StreamPlan`` of ``moe_mx.DECODE_TUNER``) and the wide-tile dense
register stream on the GPU at real V4.1 shapes: against ``ref_v41`` (MoE 3e-2, linear 1e-2), the first-use
check, CUDA-graph replay equal to eager, and batch invariance."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import gemm_mx, moe_mx, moe_stream, stream_guard  # noqa: E402
from redknot.kernels.triton.checks_mx import REAL_V41, capture_graph, moe_batch, moe_inputs  # noqa: E402
from redknot.kernels.triton.moe_stream import StreamPlan  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PLANS = [c for c in moe_mx.DECODE_TUNER.candidates if isinstance(c, StreamPlan)]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def moe_weights():
    return moe_inputs(REAL_V41, "cuda", seed=5, tokens=1)[3]


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_stream_plans_at_v41_shapes(plan, moe_weights):
    assert stream_guard.stream_check(plan, torch.device("cuda")) is None
    for t in (1, 32, 128):
        x, idx, wt = moe_batch(REAL_V41, t, 300 + t, "cuda")
        out = moe_stream.moe_stream(x, idx, wt, *moe_weights, 10.0, plan)
        assert _rel(out, ref_v41.moe_mx(x, idx, wt, *moe_weights, 10.0)) <= 3e-2
        _, replay = capture_graph(lambda: moe_stream.moe_stream(x, idx, wt, *moe_weights, 10.0, plan))
        assert torch.equal(replay, out)
    x, idx, wt = moe_batch(REAL_V41, 64, 7, "cuda")
    full = moe_stream.moe_stream(x, idx, wt, *moe_weights, 10.0, plan)
    alone = moe_stream.moe_stream(x[9:10], idx[9:10], wt[9:10], *moe_weights, 10.0, plan)
    assert torch.equal(alone, full[9:10])


@pytest.mark.parametrize("rows", [1, 32, 128])
def test_registers_wide_at_v41_shapes(rows):
    for n, k in ((5120, 8192), (32768, 1280)):
        g = torch.Generator(device="cuda").manual_seed(rows + n + 5)
        w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, 32)
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        wide = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode="registers_wide")
        assert torch.equal(wide[-1:], gemm_mx.linear_mx(x[-1:], w, ws, 32, path="splitk", decode="registers_wide"))
        assert _rel(wide, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
    assert "registers_wide" not in stream_guard.DECODE_ERRORS
