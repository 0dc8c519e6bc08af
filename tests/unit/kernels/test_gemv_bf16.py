"""The bf16 GEMV streams for 1-4 rows (``gemv_bf16``: V4's dense linears and experts at decode batch 1-4) against
fp64 sums and the library path (``moe._moe_rows``), a row's bits alone and among four, and the small-row dispatch
of the ``linear`` / ``moe`` ops; on the GPU or through the Triton interpreter at small sizes (``-m gpu``: V4's
real widths)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_moe, tuning_cache
from redknot.kernels.triton import _common, gemv_bf16, moe
from redknot.kernels.triton import ops as triton_ops


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _dense(n, k, rows, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
    return x, w


def _experts(e, inter, d, tokens, k, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w1 = (torch.randn(e, inter, d, generator=g, device=device) / d ** 0.5).to(torch.bfloat16)
    w3 = (torch.randn(e, inter, d, generator=g, device=device) / d ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, d, inter, generator=g, device=device) / inter ** 0.5).to(torch.bfloat16)
    x = torch.randn(tokens, d, generator=g, device=device).to(torch.bfloat16)
    ids = torch.rand(tokens, e, generator=g, device=device).topk(k, -1).indices
    wts = torch.rand(tokens, k, generator=g, device=device) + 0.1
    return x, ids, wts, w1, w2, w3


# (N, K): one K slice, column blocks past N, K slices with their reduction (few columns, long K), K not a
# multiple of the plans' step (640: steps of 128)
SHAPES = [(96, 256), (37, 512), (8, 4096), (24, 640)]


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
@pytest.mark.parametrize("plan", list(gemv_bf16.PLANS))
def test_gemv_matches_fp64_and_keeps_a_rows_bits(n, k, plan, kernel_device):
    """fp32 sums of bf16 products within fp32 rounding of the fp64 sum; a row alone gives the bits it gives
    among four rows (each row is its own accumulator set)."""
    x, w = _dense(n, k, 4, n + k, kernel_device)
    exact = x.double() @ w.double().t()
    p = gemv_bf16.PLANS[plan]
    out32 = gemv_bf16.gemv(x, w, torch.empty(4, n, dtype=torch.float32, device=kernel_device), p)
    assert _rel(out32, exact) <= 1e-5
    out = gemv_bf16.gemv(x, w, plan=p)
    assert out.dtype == torch.bfloat16 and _rel(out, exact) <= 4e-3  # one bf16 rounding
    for r in range(4):
        assert torch.equal(gemv_bf16.gemv(x[r:r + 1], w, plan=p), out[r:r + 1])


def test_gemv_slices_cover_k_once():
    """The K-slice rule covers K exactly once with steps that divide K (8 columns, K 4096: several slices)."""
    from redknot.kernels.triton.gemv_plan import GemvPlan, _block_k, slices
    for name, p in gemv_bf16.PLANS.items():
        bk = _block_k(4096, p.block_k, least=8)
        S, width = slices(8, 4096, GemvPlan(p.block_n, bk, p.min_steps), least=8)
        assert S > 1 and width % bk == 0 and (S - 1) * width < 4096 <= S * width, name


def test_gemv_refuses_more_than_max_rows():
    x, w = _dense(8, 64, gemv_bf16.MAX_ROWS + 1, 0, "cpu")
    with pytest.raises(ValueError, match="at most 4"):
        gemv_bf16.gemv(x, w)


# (experts, inter, hidden, tokens, slots, limit): routed top-3 of 5, the shared expert (one expert, one slot,
# weight 1), four tokens of top-6, no clamp
MOE_CASES = [(5, 48, 256, 2, 3, 7.0), (1, 64, 128, 3, 1, 7.0), (8, 32, 128, 4, 6, None)]


@pytest.mark.parametrize("e,inter,d,tokens,k,limit", MOE_CASES, ids=["routed", "shared", "top6"])
@pytest.mark.parametrize("plan", ["bgemv", "bgemv_n8"])
def test_moe_gemv_matches_the_grouped_path_and_the_reference(e, inter, d, tokens, k, limit, plan, kernel_device):
    """Against the library path (sort, grouped GEMMs, SwiGLU, combine: the same roundings, another summation
    order) and the reference op; a token alone gives the bits it gives among the others."""
    x, ids, wts, w1, w2, w3 = _experts(e, inter, d, tokens, k, e + tokens, kernel_device)
    if e == 1:
        ids, wts = torch.zeros_like(ids), torch.ones_like(wts)
    p = gemv_bf16.PLANS[plan]
    out = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, limit, plan=p)
    lib = moe._moe_rows(x, ids, wts, w1, w2, w3, limit, None, None, None, torch.empty_like(out))
    assert _rel(out, lib) <= 8e-3
    if limit is not None:  # the reference op always clamps
        assert _rel(out, ref_moe.moe(x, ids, wts, w1, w2, w3, limit)) <= 8e-3
    for t in range(tokens):
        alone = gemv_bf16.moe_gemv(x[t:t + 1], ids[t:t + 1], wts[t:t + 1], w1, w2, w3, limit, plan=p)
        assert torch.equal(alone, out[t:t + 1])


def test_moe_gemv_clamps_like_the_swiglu(kernel_device):
    """Large activations: the clamp of the gate and up sums must act (an unclamped result differs by O(1))."""
    x, ids, wts, w1, w2, w3 = _experts(4, 32, 64, 2, 2, 3, kernel_device)
    x = x * 64
    out = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, 1.0)
    lib = moe._moe_rows(x, ids, wts, w1, w2, w3, 1.0, None, None, None, torch.empty_like(out))
    unclamped = moe._moe_rows(x, ids, wts, w1, w2, w3, None, None, None, None, torch.empty_like(out))
    assert _rel(out, lib) <= 8e-3 and _rel(unclamped, lib) > 0.1


class _Pick(_common.ConfigTuner):
    """A tuner that answers ``choice`` (after running it once, as a tuner would) and records its keys."""

    def __init__(self, name, candidates, choice):
        super().__init__(name, candidates)
        self.choice, self.asked = choice, []

    def pick(self, key, run, device):
        self.asked.append(key)
        run(self.choice)
        return self.choice


def test_linear_op_takes_the_gemv_choice_at_up_to_four_rows(kernel_device, monkeypatch):
    """The ``linear`` op asks ``LINEAR_SMALL_TUNER`` at 1-4 rows (any leading shape) and runs its GEMV choice;
    5+ rows, the small-row class off (batch invariance) or a ``cublas`` choice run ``F.linear``."""
    tuner = _Pick("t", ["cublas", "bgemv"], "bgemv")
    monkeypatch.setattr(gemv_bf16, "LINEAR_SMALL_TUNER", tuner)
    ran = []
    real = gemv_bf16.gemv
    monkeypatch.setattr(gemv_bf16, "gemv", lambda x2, *a, **kw: ran.append(x2.shape[0]) or real(x2, *a, **kw))
    x, w = _dense(40, 256, 6, 5, kernel_device)
    y = triton_ops.linear(x[:3].view(3, 1, 256), w)
    assert y.shape == (3, 1, 40) and ran == [1, 3]  # the tuner's one-row run, then the call
    assert torch.equal(y.view(3, 40), real(x[:3], w))
    assert tuner.asked == [((40, 256), "torch.bfloat16")]
    ran.clear()
    triton_ops.linear(x, w)
    assert not ran and len(tuner.asked) == 1
    monkeypatch.setattr(tuning_cache, "_small_rows_class", True)
    tuning_cache.use_small_rows_class(False)  # what a batch-invariant engine sets
    try:
        triton_ops.linear(x[:2], w)
    finally:
        tuning_cache.use_small_rows_class(True)
    assert not ran and len(tuner.asked) == 1
    monkeypatch.setattr(gemv_bf16, "LINEAR_SMALL_TUNER", _Pick("t", ["cublas", "bgemv"], "cublas"))
    triton_ops.linear(x[:2], w)
    assert not ran


def test_moe_op_takes_the_gemv_choice_at_up_to_four_tokens(kernel_device, monkeypatch):
    """``moe.moe_experts`` asks ``MOE_SMALL_TUNER`` per expert shape at 1-4 bf16 tokens and runs its GEMV
    choice (result: the GEMV's bits); 5+ tokens run the grouped path without asking."""
    tuner = _Pick("m", ["grouped", "bgemv"], "bgemv")
    monkeypatch.setattr(gemv_bf16, "MOE_SMALL_TUNER", tuner)
    ran = []
    real = gemv_bf16.moe_gemv
    monkeypatch.setattr(gemv_bf16, "moe_gemv", lambda x, *a, **kw: ran.append(x.shape[0]) or real(x, *a, **kw))
    x, ids, wts, w1, w2, w3 = _experts(5, 32, 128, 6, 2, 9, kernel_device)
    y = moe.moe_experts(x[:2], ids[:2], wts[:2], w1, w2, w3, 7.0)
    assert ran == [1, 2] and tuner.asked == [((5, 32, 128), (5, 128, 32), 2, "torch.bfloat16")]
    assert torch.equal(y, real(x[:2], ids[:2], wts[:2], w1, w2, w3, 7.0))
    ran.clear()
    moe.moe_experts(x, ids, wts, w1, w2, w3, 7.0)
    assert not ran and len(tuner.asked) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_streams_at_v4_widths_and_in_a_graph(rows):
    """V4-Flash's dense shapes (wq_a, wkv, wq_b, wo_b) and its experts (256 x 2048 x 4096, top-6; the shared
    expert) on the GPU, every plan against fp64 sums / the grouped path, and each replayed from a CUDA graph
    with the eager bits."""
    from redknot.kernels.capture import cuda_graph
    dev = "cuda"
    for n, k in [(1024, 4096), (512, 4096), (32768, 1024), (4096, 8192)]:
        x, w = _dense(n, k, rows, n, dev)
        exact = x.double() @ w.double().t()
        for name, p in gemv_bf16.PLANS.items():
            out = gemv_bf16.gemv(x, w, plan=p)
            assert _rel(out, exact) <= 4e-3, (n, k, name)
            g = torch.cuda.CUDAGraph()
            with cuda_graph(g):
                again = gemv_bf16.gemv(x, w, plan=p)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(again, out), (n, k, name)
    for e, k in [(256, 6), (1, 1)]:
        x, ids, wts, w1, w2, w3 = _experts(e, 2048, 4096, rows, k, e, dev)
        if e == 1:
            ids, wts = torch.zeros_like(ids), torch.ones_like(wts)
        lib = moe._moe_rows(x, ids, wts, w1, w2, w3, 10.0, None, None, None, torch.empty(rows, 4096, device=dev,
                                                                                           dtype=torch.bfloat16))
        for name, p in gemv_bf16.PLANS.items():
            out = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, 10.0, plan=p)
            assert _rel(out, lib) <= 8e-3, (e, name)
            g = torch.cuda.CUDAGraph()
            with cuda_graph(g):
                again = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, 10.0, plan=p)
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(again, out), (e, name)


def test_router_scores_at_up_to_four_rows_match_the_reference(kernel_device):
    """The ``router_scores`` op at 1-4 rows (one GEMV launch, softplus and sqrt in its epilogue) against the
    reference op: bf16 and fp32 rows, logits past softplus's threshold of 20 and far below 0 included; 5+ rows
    take ``route.ROUTER_TUNER``'s choice (``test_router_mm.py``)."""
    from redknot.kernels import reference
    g = torch.Generator(device=kernel_device).manual_seed(4)
    w = (torch.randn(64, 512, generator=g, device=kernel_device) / 8).to(torch.bfloat16)
    x = torch.randn(6, 512, generator=g, device=kernel_device).to(torch.bfloat16)
    x[1] *= 40   # logits up to |~100|: both sides of the threshold, and exp(-x) underflow
    for rows in (1, 2, 4):
        for xx in (x[:rows], x[:rows].float()):
            got = triton_ops.router_scores(xx, w)
            want = reference.router_scores(xx, w)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 sums of 512 products, another order
    for plan in gemv_bf16.PLANS.values():   # the epilogue behind every launch shape, one slice and several
        for k in (4096, 512):
            wk = torch.randn(8, k, generator=g, device=kernel_device).to(torch.bfloat16) / 16
            xk = torch.randn(2, k, generator=g, device=kernel_device).to(torch.bfloat16)
            got = gemv_bf16.gemv(xk, wk, torch.empty(2, 8, device=kernel_device), plan, epilogue="softplus_sqrt")
            torch.testing.assert_close(got, reference.router_scores(xk, wk), rtol=1e-5, atol=1e-5)
    big = x[1:2].float() @ w.float().t()
    assert (big > 20).any() and (big < -20).any()
    if kernel_device == "cpu":   # 5+ rows: the tuner's first candidate off the GPU, the reference op itself
        assert torch.equal(triton_ops.router_scores(x, w), reference.router_scores(x, w))
    torch.testing.assert_close(triton_ops.router_scores(x, w), reference.router_scores(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plan", ["bgemv", "bgemv_n8", "bgemv_n2", "bgemv_n16"])
@pytest.mark.parametrize("rows,groups,r,k", [(1, 8, 40, 256), (3, 2, 24, 512), (4, 3, 17, 640)])
def test_group_gemv_matches_float64_and_the_bmm(plan, rows, groups, r, k, kernel_device):
    """V4's wo_a at 1-4 rows: each group's rows against its own weight rows (fp64 sums; the library bmm within bf16
    rounding), a row alone gives its bits among the others, a strided input (the attention output's view)."""
    from redknot.kernels import reference as ref
    g = torch.Generator().manual_seed(rows * 100 + groups * 10 + r)
    w = (torch.randn(groups * r, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(kernel_device)
    wide = torch.randn(rows, groups, k + 64, generator=g).to(torch.bfloat16).to(kernel_device)
    x = wide[:, :, 32:32 + k]   # rows not contiguous
    got = gemv_bf16.group_gemv(x, w, gemv_bf16.PLANS[plan])
    exact = torch.einsum("tgk,grk->tgr", x.double(), w.double().view(groups, r, k))
    assert got.shape == (rows, groups, r) and got.dtype == torch.bfloat16
    assert _rel(got, exact) <= 4e-3
    assert _rel(got, ref.grouped_linear(x, w)) <= 8e-3
    for t in range(rows):
        assert torch.equal(gemv_bf16.group_gemv(x[t:t + 1], w, gemv_bf16.PLANS[plan]), got[t:t + 1])


def test_grouped_linear_op_takes_the_gemv_choice_at_up_to_four_rows(kernel_device, monkeypatch):
    """The ``grouped_linear`` op asks ``GROUPED_SMALL_TUNER`` at 1-4 bf16 rows and runs its GEMV choice; 5+ rows
    or a ``bmm`` choice run the library bmm."""
    from redknot.kernels import reference as ref
    from redknot.kernels.triton import ops as triton_ops
    tuner = _Pick("g", ["bmm", "bgemv"], "bgemv")
    monkeypatch.setattr(gemv_bf16, "GROUPED_SMALL_TUNER", tuner)
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(4 * 16, 128, generator=g) / 128 ** 0.5).to(torch.bfloat16).to(kernel_device)
    x = torch.randn(6, 4, 128, generator=g).to(torch.bfloat16).to(kernel_device)
    y = triton_ops.grouped_linear(x[:2], w)
    assert tuner.asked == [(4, (64, 128), "torch.bfloat16")]
    assert torch.equal(y, gemv_bf16.group_gemv(x[:2], w))
    assert torch.equal(triton_ops.grouped_linear(x, w), ref.grouped_linear(x, w)) and len(tuner.asked) == 1
    tuner.choice = "bmm"
    tuner.asked.clear()
    monkeypatch.setattr(gemv_bf16, "GROUPED_SMALL_TUNER", tuner)
    assert torch.equal(triton_ops.grouped_linear(x[:1], w), ref.grouped_linear(x[:1], w))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4])
def test_gpu_group_gemv_at_v4_wo_a(rows):
    """V4-Flash's wo_a (8 groups of 1024 rows x 4096) on the GPU: every plan against fp64 sums, and replayed from a
    CUDA graph with the eager bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from redknot.kernels.capture import cuda_graph
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = (torch.randn(8 * 1024, 4096, generator=g, device="cuda") / 64).to(torch.bfloat16)
    x = torch.randn(rows, 8, 4096, generator=g, device="cuda").to(torch.bfloat16)
    exact = torch.einsum("tgk,grk->tgr", x.double(), w.double().view(8, 1024, 4096))
    for name, plan in gemv_bf16.PLANS.items():
        got = gemv_bf16.group_gemv(x, w, plan)
        assert _rel(got, exact) <= 4e-3, name
        graph = torch.cuda.CUDAGraph()
        with cuda_graph(graph):
            replayed = gemv_bf16.group_gemv(x, w, plan)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, got), name
