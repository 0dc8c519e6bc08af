"""The library-GEMM MoE prefill plans (``moe_prefill_scaled``: e4m3 experts, ``torch._scaled_grouped_mm``) on the GPU
at real V4.1 shapes against ``ref_v41`` (fresh random inputs, tolerance 3e-2 as ``checks_mx``), called directly and
through ``moe_prefill`` (whose first-use check must accept every plan); the expansion against its PyTorch reference
bit for bit at V4.1 shapes (no inexact column at these weights' scale spreads); the library GEMM against the PyTorch
reference of rowwise-scaled grouped GEMM (groups of zero rows included)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import moe_mx, stream_guard
from redknot.kernels.triton import moe_prefill_scaled as sc
from redknot.kernels.triton.checks_mx import REAL_V41, moe_batch, moe_inputs

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PLANS = [p for p in moe_mx.PREFILL_TUNER.candidates if p.path == "scaled"] + [
    moe_mx.MoePlan("scaled", decode="e4m3_all"), moe_mx.MoePlan("scaled", decode="e4m3f_c128")]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def case():
    w = moe_inputs(REAL_V41, "cuda", seed=5, tokens=1)[3]
    x, idx, wt = moe_batch(REAL_V41, 2048, 29, "cuda")
    return x, idx, wt, w, ref_v41.moe_mx(x, idx, wt, *w, 10.0)


@pytest.mark.parametrize("plan", PLANS, ids=[p.decode for p in PLANS])
def test_scaled_prefill_plans_at_v41_shapes(plan, case):
    x, idx, wt, w, want = case
    sc.reset_inexact_columns("cuda")
    direct = sc.moe_prefill_scaled(x, idx, wt, *w, 10.0, plan)
    assert _rel(direct, want) <= 3e-2
    assert int(sc.inexact_columns("cuda")) == 0  # scale bytes 117..121: every column exact
    through = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
    assert plan not in stream_guard.DECODE_ERRORS, stream_guard.DECODE_ERRORS.get(plan)
    assert torch.equal(through, direct)


def test_expansion_bit_for_bit_at_v41_shapes(case):
    w = case[3]
    for packed, scales in ((w[0], w[1]), (w[4], w[5])):
        sub, ssub = packed[5:8].clone(), scales[5:8].clone()
        ssub[0, :16, 3] -= 20  # 16 inexact columns in the first expert
        q = torch.empty(3, sub.shape[1], sub.shape[2] * 2, dtype=torch.float8_e4m3fn, device="cuda")
        cs = torch.empty(3, sub.shape[1], device="cuda")
        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
        sc.expand_e4m3(sub, ssub, 0, 3, q, cs, bad=bad)
        want_q, want_cs, want_bad = sc.expand_e4m3_ref(sub, ssub)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(cs, want_cs) and int(bad) == want_bad == 16


@pytest.mark.parametrize("fast", [False, True])
def test_library_gemm_against_reference(fast):
    g = torch.Generator(device="cuda").manual_seed(3)
    G, N, K, M = 6, 512, 1024, 700
    a = torch.randn(M, K, generator=g, device="cuda").mul(16).to(torch.float8_e4m3fn)
    b = torch.randn(G, N, K, generator=g, device="cuda").mul(16).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-10, 4, (M,), generator=g, device="cuda").float())
    sb = torch.exp2(torch.randint(-10, 4, (G, N), generator=g, device="cuda").float())
    offs = torch.tensor([100, 100, 350, 351, 351, 650], dtype=torch.int32, device="cuda")  # empty groups, a tail
    got = sc.scaled_grouped_mm(a, sa, b, sb, offs, fast)
    want = sc.scaled_grouped_mm_ref(a, sa, b, sb, offs)
    assert _rel(got[:650], want[:650]) <= (2e-2 if fast else 2e-3)


def test_row_kernels_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(9)
    T, D, inter, M = 300, 5120, 2304, 1000
    x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
    rowid = torch.randint(0, T, (M,), generator=g, device="cuda", dtype=torch.int32)
    bounds = torch.tensor([0, 400, M], dtype=torch.int32, device="cuda")
    q = torch.empty(M, D, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(M, device="cuda")
    sc.rows_e4m3(x, rowid, bounds, 1, 2, q, s)
    wq, ws = sc.row_quant_ref(x[rowid[400:].long()])
    assert torch.equal(q[:600].view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s[:600], ws)
    h = torch.randn(M, 2 * inter, generator=g, device="cuda").mul(3).to(torch.bfloat16)
    wt = torch.rand(M, generator=g, device="cuda") + 0.1
    aq = torch.empty(M, inter, dtype=torch.float8_e4m3fn, device="cuda")
    asc = torch.empty(M, device="cuda")
    sc.swiglu_e4m3(h, wt, bounds, 0, 2, 10.0, aq, asc)
    gg, uu = h[:, :inter].float().clamp(max=10.0), h[:, inter:].float().clamp(-10.0, 10.0)
    wq, ws = sc.row_quant_ref((torch.nn.functional.silu(gg) * uu * wt[:, None]).to(torch.bfloat16))
    assert float((aq.view(torch.uint8) == wq.view(torch.uint8)).float().mean()) > 0.99
    assert _rel(aq.float() * asc[:, None], wq.float() * ws[:, None]) < 1e-2
