"""The CUDA-core GEMV streams (``gemv_mx``) on the GPU at real V4.1 sizes: dense FP8 wo_b / wq_b and the
MXFP4 experts at 1-4 rows against ``ref_v41`` (fresh random inputs; linear 1e-2, MoE 3e-2 as ``checks_mx``)
and against fp64 sums of the exact products, CUDA-graph replay == eager, a row alone == that row among four,
every GEMV passing its first-use check, and the small-row classes of the tuners."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import gemm_mx, gemv_mx, moe_mx, stream_guard
from redknot.kernels.triton.checks_mx import (
    REAL_V41,
    capture_graph,
    moe_batch,
    moe_inputs,
)

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

DENSE = [n for n in gemv_mx.PLANS if n.startswith("gemv")]
MOE = [n for n in gemv_mx.PLANS if n.startswith("moe_gemv")]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def moe_weights():
    return moe_inputs(REAL_V41, "cuda", seed=5, tokens=1)[3]


@pytest.mark.parametrize("name", DENSE + MOE)
def test_every_gemv_passes_its_first_use_check(name):
    assert stream_guard.self_check(name, torch.device("cuda")) is None


@pytest.mark.parametrize("n,k", [(5120, 8192), (32768, 1280)], ids=["wo_b", "wq_b"])
@pytest.mark.parametrize("name", DENSE)
def test_dense_gemv_at_v41_shapes(n, k, name):
    g = torch.Generator(device="cuda").manual_seed(n + len(name))
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(4, k, generator=g, device="cuda").to(torch.bfloat16)
    plan = gemv_mx.PLANS[name]
    q, s = mx.quant_fp8_groups(x.float(), 32)
    exact = mx.dequant_fp8_groups(q, s, 32).double() @ mx.dequant_fp8_blocks(w, ws, 32).double().t()
    full = gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(4, n, dtype=torch.float32, device="cuda"), plan)
    assert _rel(full, exact) <= 1e-5
    for rows in (1, 2, 3):
        part = gemv_mx.gemv_fp8(x[:rows], w, ws, 32, torch.empty(rows, n, dtype=torch.float32, device="cuda"), plan)
        assert torch.equal(part, full[:rows])
    y = gemm_mx.linear_mx(x[:1], w, ws, 32, path="splitk", decode=name)
    assert _rel(y, ref_v41.linear_mx(x[:1], w, ws, 32)) <= 1e-2
    _graph, out = capture_graph(lambda: gemm_mx.linear_mx(x[:1], w, ws, 32, path="splitk", decode=name))
    assert torch.equal(out, y)


@pytest.mark.parametrize("name", MOE)
def test_moe_gemv_at_v41_shapes(name, moe_weights):
    plan = gemv_mx.PLANS[name]
    x, idx, wt = moe_batch(REAL_V41, 4, len(name), "cuda")
    full = gemv_mx.moe_gemv(x, idx, wt, *moe_weights, 10.0, plan)
    assert _rel(full, ref_v41.moe_mx(x, idx, wt, *moe_weights, 10.0)) <= 3e-2
    for t in (0, 3):
        alone = gemv_mx.moe_gemv(x[t:t + 1], idx[t:t + 1], wt[t:t + 1], *moe_weights, 10.0, plan)
        assert torch.equal(alone, full[t:t + 1])
    one = lambda: moe_mx.moe_splitk(x[:1], idx[:1], wt[:1], *moe_weights, 10.0, decode=name)
    eager = one()
    _graph, out = capture_graph(one)
    assert torch.equal(out, eager)


def test_small_row_classes_choose_and_match_the_reference(moe_weights):
    """The tuners' small-row classes on a first call of 1 row / 1 token: a choice among their candidates,
    every candidate timed or refused with a reason, the result within the op's tolerance, no GEMV refused."""
    g = torch.Generator(device="cuda").manual_seed(11)
    w, ws = mx.quant_fp8_blocks(torch.randn(5120, 8192, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(1, 8192, generator=g, device="cuda").to(torch.bfloat16)
    assert _rel(gemm_mx.linear_mx(x, w, ws, 32), ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
    key = ((5120, 8192), 32)
    assert gemm_mx.LINEAR_SMALL_TUNER.choices[key] in gemm_mx.LINEAR_SMALL_TUNER.candidates
    xs, idx, wt = moe_batch(REAL_V41, 1, 12, "cuda")
    out = moe_mx.moe_splitk(xs, idx, wt, *moe_weights, 10.0)
    assert _rel(out, ref_v41.moe_mx(xs, idx, wt, *moe_weights, 10.0)) <= 3e-2
    mkey = (tuple(moe_weights[0].shape), tuple(moe_weights[4].shape))
    assert moe_mx.SMALL_TUNER.choices[mkey] in moe_mx.SMALL_TUNER.candidates
    assert not [d for d in stream_guard.DECODE_ERRORS if isinstance(d, str) and "gemv" in d]
