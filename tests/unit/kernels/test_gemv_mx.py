"""The CUDA-core GEMV streams for 1-4 rows (``gemv_mx``) against ``ref_v41``, their first-use check and the
small-row class of the dense linear tuner; on the GPU or through the Triton interpreter at small sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import gemm_mx, gemv_fp4_mx, gemv_mx, stream_guard
from redknot.kernels.triton.checks_mx import TOY_V41, V41Dims, moe_inputs
from redknot.kernels.triton.gemv_mx import GemvPlan
from slow_grid import rotated_grid


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _dense(n, k, block, rows, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, block)
    x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
    return x, w, ws


def _exact(x, w, ws, block):
    """fp64 sum of the reference's exact products: QDQ(x) · dequant(W)ᵀ."""
    q, s = mx.quant_fp8_groups(x.float(), 32)
    xq = mx.dequant_fp8_groups(q, s, 32).double()
    return xq @ mx.dequant_fp8_blocks(w, ws, block).double().t()


# (N, K, block): column blocks past N, K steps of 256 / 128 / 64 / 32 (K not a multiple of the plan's step),
# V4 tiles of 128, and wo_b's 5120 columns at a small K slice (wq_b's 32768: ``-m slow``)
SHAPES = [(96, 512, 32), (100, 768, 32), (64, 1024, 128), (40, 160, 32), (5120, 256, 32)]
PLANS = [GemvPlan(32, 256), GemvPlan(16, 256, 1), GemvPlan(16, 512), GemvPlan(32, 128, 4, 4, 1)]


# each shape at one row count by default (the plan by N + rows: each plan at least once; wo_b's width ~6 s
# interpreted), the other row counts with ``-m slow``
@pytest.mark.parametrize("n,k,block,rows", rotated_grid(SHAPES, [(r,) for r in (1, 2, 3, 4)],
                                                       [f"{n}x{k}b{block}" for n, k, block in SHAPES],
                                                       ["1row", "2rows", "3rows", "4rows"]))
def test_gemv_matches_reference(n, k, block, rows, kernel_device):
    x, w, ws = _dense(n, k, block, rows, n + k + rows, kernel_device)
    plan = PLANS[(n + rows) % len(PLANS)]
    out = gemv_mx.gemv_fp8(x, w, ws, block, torch.empty(rows, n, dtype=torch.float32, device=kernel_device), plan)
    assert _rel(out, _exact(x, w, ws, block)) <= 1e-5  # fp32 sums of exact products
    y = gemv_mx.gemv_fp8(x, w, ws, block, torch.empty(rows, n, dtype=torch.bfloat16, device=kernel_device), plan)
    assert _rel(y, ref_v41.linear_mx(x, w, ws, block)) <= 1e-2


@pytest.mark.slow
def test_gemv_matches_reference_at_wq_b_width(kernel_device):
    """wq_b's 32768 columns over a 64-wide K slice, four rows (interpreted: ~1 min)."""
    x, w, ws = _dense(32768, 64, 32, 4, 3, kernel_device)
    out = gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(4, 32768, dtype=torch.float32, device=kernel_device))
    assert _rel(out, _exact(x, w, ws, 32)) <= 1e-5


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.block_n}x{p.block_k}-s{p.min_steps}")
def test_gemv_row_is_batch_invariant(plan, kernel_device):
    """A row alone equals that row among four (each row its own accumulators, the same code)."""
    x, w, ws = _dense(72, 1024, 32, 4, 9, kernel_device)
    full = gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(4, 72, dtype=torch.float32, device=kernel_device), plan)
    for r in (0, 2, 3):
        alone = gemv_mx.gemv_fp8(x[r:r + 1], w, ws, 32, torch.empty(1, 72, dtype=torch.float32,
                                                                      device=kernel_device), plan)
        assert torch.equal(alone, full[r:r + 1])


def test_gemv_detects_a_wrong_weight(kernel_device):
    """The tolerance separates right from wrong: one K group's scale off by a factor 4, a rotated row."""
    x, w, ws = _dense(64, 512, 32, 2, 4, kernel_device)
    want = _exact(x, w, ws, 32)

    def out(w, ws):
        return gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(2, 64, dtype=torch.float32, device=kernel_device))
    bad = ws.view(torch.uint8).clone()
    bad[:, 5] += 2
    assert _rel(out(w, bad), want) > 0.1
    assert _rel(out(w.view(torch.uint8).roll(16, 1).view(torch.float8_e4m3fn), ws), want) > 0.1


def test_gemv_slices_depend_on_the_weight_shape_only():
    for n, k in ((5120, 8192), (32768, 1280), (96, 512)):
        for plan in (gemv_mx.PLANS[n] for n in DENSE_NAMES):
            S, ksplit = gemv_mx.slices(n, k, plan)
            assert S * ksplit >= k and (S - 1) * ksplit < k and ksplit % 32 == 0
    assert gemv_mx.slices(32768, 1280, GemvPlan(32, 256))[0] == 1  # 1024 column blocks fill the device alone


def test_gemv_rejects_more_rows_than_it_holds(kernel_device):
    x, w, ws = _dense(32, 64, 32, gemv_mx.MAX_ROWS + 1, 1, kernel_device)
    with pytest.raises(ValueError, match="at most"):
        gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(x.shape[0], 32, device=kernel_device))


DENSE_NAMES = [n for n in gemv_mx.PLANS if n.startswith("gemv")]


@pytest.mark.parametrize("name", DENSE_NAMES)
def test_linear_gemv_decode_matches_reference_at_any_row_count(name, kernel_device):
    """``linear_mx(decode="gemv*")``: four rows per launch; a row of a 7-row call equals that row alone."""
    x, w, ws = _dense(80, 512, 32, 7, 11, kernel_device)
    y = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=name)
    assert _rel(y, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
    assert torch.equal(gemm_mx.linear_mx(x[5:6], w, ws, 32, path="splitk", decode=name), y[5:6])


@pytest.mark.parametrize("name", DENSE_NAMES)
def test_gemv_self_check_passes_and_detects_a_wrong_stream(name, kernel_device, monkeypatch):
    dev = torch.device(kernel_device)
    assert stream_guard.self_check(name, dev) is None
    real = gemv_mx.gemv_fp8

    def wrong(x2, w, ws, block, out, plan):
        real(x2, w, ws, block, out, plan)
        out[:, ::7] *= 1.01
        return out
    monkeypatch.setattr(gemv_mx, "gemv_fp8", wrong)
    assert "differs from decode='registers'" in stream_guard.self_check(name, dev)


def test_small_row_class_times_its_own_batch_and_runs_the_choice(kernel_device, monkeypatch):
    """At most ``gemv_mx.MAX_ROWS`` rows: ``LINEAR_SMALL_TUNER`` (first candidate ``stream``: the tensor-core
    stream ``LINEAR_DECODE_TUNER`` chose) times on ``LINEAR_SMALL_TUNE_ROWS`` rows; its GEMV choice then runs
    the GEMV stream; 5+ rows never ask it; with ``SMALL_ROWS_CLASS`` off it is not asked either."""
    from redknot.kernels.triton import _common
    assert gemm_mx.LINEAR_SMALL_TUNER.candidates[0] == "stream"
    assert all(c in gemv_mx.PLANS for c in gemm_mx.LINEAR_SMALL_TUNER.candidates[1:])
    asked, timed = [], {}

    class Pick(_common.ConfigTuner):
        def pick(self, key, run, device):
            asked.append(key)
            timed["rows"] = run("gemv").shape[0]
            return "gemv"
    monkeypatch.setattr(gemm_mx, "LINEAR_SMALL_TUNER", Pick("small", ["stream", "gemv"]))
    ran = []
    real = gemv_mx.gemv_fp8
    monkeypatch.setattr(gemv_mx, "gemv_fp8", lambda *a, **k: ran.append(a[0].shape[0]) or real(*a, **k))
    x, w, ws = _dense(64, 256, 32, 6, 2, kernel_device)
    y = gemm_mx.linear_mx(x[:3], w, ws, 32)
    assert asked == [((64, 256), 32)] and timed["rows"] == gemm_mx.LINEAR_SMALL_TUNE_ROWS
    assert ran[-1] == 3 and _rel(y, ref_v41.linear_mx(x[:3], w, ws, 32)) <= 1e-2
    ran.clear()
    gemm_mx.linear_mx(x, w, ws, 32)
    assert len(asked) == 1 and not ran
    from redknot.kernels import tuning_cache
    monkeypatch.setattr(tuning_cache, "_small_rows_class", True)
    tuning_cache.use_small_rows_class(False)  # what a batch-invariant engine sets
    gemm_mx.linear_mx(x[:2], w, ws, 32)
    assert len(asked) == 1 and not ran
    tuning_cache.use_small_rows_class(True)
    monkeypatch.setattr(gemm_mx, "SMALL_ROWS_CLASS", False)
    gemm_mx.linear_mx(x[:2], w, ws, 32)
    assert len(asked) == 1 and not ran


# ---------------------------------------------------------------------- MXFP4 experts (moe_gemv)
ODD = V41Dims(hidden=96, experts=7, topk_experts=3, moe_inter=96, tokens=9)  # 48 packed bytes: 16-byte K steps
WIDE = V41Dims(hidden=512, experts=8, topk_experts=6, moe_inter=256, tokens=4)  # V4.1's top-6, K steps of 128 / 256
MOE_PLANS = [GemvPlan(32, 256), GemvPlan(16, 128, 1), GemvPlan(64, 64, 4, 4, 1)]
# (dims, tokens, plan): the first four by default (each width, token count and plan once; ~0.5-2 s each
# interpreted), the rest with ``-m slow`` (WIDE's top-6 at 4 tokens ~10 s, ODD with the 16-column plan at 3 tokens ~5 s)
MOE_CASES = [(WIDE, 1, 0), (TOY_V41, 4, 1), (ODD, 2, 2), (TOY_V41, 3, 0),
             (TOY_V41, 1, 0), (ODD, 3, 1), (WIDE, 4, 0), (WIDE, 1, 1), (WIDE, 2, 2)]


@pytest.mark.parametrize("dims,tokens,plan", [
    pytest.param(d, t, MOE_PLANS[p], id=f"{d.hidden}-{t}-plan{p}", marks=[pytest.mark.slow] if i >= 4 else [])
    for i, (d, t, p) in enumerate(MOE_CASES)])
def test_moe_gemv_matches_reference(dims, tokens, plan, kernel_device):
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=tokens + 70, tokens=tokens)
    out = gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, plan)
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2


def test_moe_gemv_w1_sums_are_the_exact_products(kernel_device):
    """The W1 | W3 partials summed over slices: fp32 sums of the exact products of each pair's QDQ'd row
    and its expert's decoded weight (fp64 reference), several slices."""
    from redknot.kernels.triton.dequant_mx import qdq_bf16
    x, idx, _, (w1, s1, w3, s3, _, _) = moe_inputs(WIDE, kernel_device, seed=5, tokens=1)
    k = idx.shape[1]
    xq = qdq_bf16(x)
    p1, p3 = gemv_mx.gemv_fp4(xq, idx.reshape(-1).contiguous(), k, w1, s1, GemvPlan(64, 64, 1), w3, s3)
    assert p1.shape[0] > 1
    for p, w, s in ((p1, w1, s1), (p3, w3, s3)):
        want = torch.stack([xq[q // k].double() @ mx.dequant_mxfp4(w[idx.reshape(-1)[q]], s[idx.reshape(-1)[q]])
                            .double().t() for q in range(idx.numel())])
        assert _rel(p.sum(0), want) <= 1e-5


def test_moe_gemv_token_is_batch_invariant(kernel_device):
    x, idx, wt, w = moe_inputs(WIDE, kernel_device, seed=8, tokens=3)
    full = gemv_mx.moe_gemv(x, idx, wt, *w, 10.0)
    for t in (0, 2):
        assert torch.equal(gemv_mx.moe_gemv(x[t:t + 1], idx[t:t + 1], wt[t:t + 1], *w, 10.0), full[t:t + 1])


def test_moe_gemv_detects_a_wrong_weight(kernel_device):
    """Nibbles swapped (element order) in W2 or in W1 fail the tolerance."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(TOY_V41, kernel_device, seed=3, tokens=2)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)

    def swap(w):
        return ((w >> 4) | (w << 4)).to(torch.uint8)
    assert _rel(gemv_mx.moe_gemv(x, idx, wt, w1, s1, w3, s3, swap(w2), s2, 10.0), want) > 0.1
    assert _rel(gemv_mx.moe_gemv(x, idx, wt, swap(w1), s1, w3, s3, w2, s2, 10.0), want) > 0.1


def test_moe_gemv_self_check_passes_and_detects_a_wrong_stream(kernel_device, monkeypatch):
    dev = torch.device(kernel_device)
    assert stream_guard.self_check("moe_gemv_n16", dev) is None
    real = gemv_mx.gemv_fp4

    def wrong(x, ids, topk, w, ws, plan, w3=None, ws3=None):
        out = real(x, ids, topk, w, ws, plan, w3, ws3)
        if w3 is not None:
            out[1][..., ::5] *= 1.01
        return out
    monkeypatch.setattr(gemv_mx, "gemv_fp4", wrong)
    assert "W1 | W3 sums differ" in stream_guard.self_check("moe_gemv_n16", dev)



# ``_gemv_fp4d`` (plan.direct): the activation and scale loads in the weight words' layout
DIRECT_PLANS = [GemvPlan(32, 128, w2_block_n=32, direct=True), GemvPlan(64, 64, 1, direct=True),
                GemvPlan(16, 256, direct=True), GemvPlan(32, 32, 1, w2_block_n=64, direct=True, depth=2)]


@pytest.mark.parametrize("dims,tokens,plan", [(TOY_V41, 1, 0), (ODD, 3, 1), (TOY_V41, 2, 2), (ODD, 1, 0),
                                               (TOY_V41, 2, 3), (ODD, 2, 3)],
                         ids=["toy-1-d32", "odd-3-d64", "toy-2-d16", "odd-1-d32", "toy-2-depth2", "odd-2-depth2"])
def test_moe_gemv_direct_matches_reference(dims, tokens, plan, kernel_device):
    """The direct-load kernel against ``ref_v41.moe_mx`` on fresh random operands (odd widths: rows past N)."""
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=tokens + 90 + plan, tokens=tokens)
    out = gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, DIRECT_PLANS[plan])
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2


@pytest.mark.parametrize("aligned", [True, False])
def test_moe_gemv_direct_sums_are_the_exact_products(aligned, kernel_device):
    """The direct kernel's W1 | W3 partials (several K slices, rows past N) summed over slices: fp32 sums of the
    exact products (fp64 reference), and within fp32 reordering of ``_gemv_fp4``'s; activation rows off the
    16-byte grid (``aligned`` False: a row stride of 8 bytes more) take ``_gemv_fp4`` and the same sums."""
    from redknot.kernels.triton.dequant_mx import qdq_bf16
    dims = V41Dims(hidden=256, experts=5, topk_experts=3, moe_inter=80, tokens=2)
    x, idx, _, (w1, s1, w3, s3, _, _) = moe_inputs(dims, kernel_device, seed=31 + aligned, tokens=2)
    k = idx.shape[1]
    xq = qdq_bf16(x)
    if not aligned:
        pad = torch.zeros(xq.shape[0], xq.shape[1] + 4, dtype=xq.dtype, device=xq.device)
        pad[:, :xq.shape[1]] = xq
        xq = pad[:, :xq.shape[1]]
    ids = idx.reshape(-1).contiguous()
    plan = GemvPlan(32, 32, 1, direct=True)
    p1, p3 = gemv_mx.gemv_fp4(xq, ids, k, w1, s1, plan, w3, s3)
    o1, o3 = gemv_mx.gemv_fp4(xq, ids, k, w1, s1, GemvPlan(32, 32, 1), w3, s3)
    assert p1.shape[0] > 1 and p1.shape == o1.shape
    for p, o, w, s in ((p1, o1, w1, s1), (p3, o3, w3, s3)):
        want = torch.stack([xq[q // k].double() @ mx.dequant_mxfp4(w[ids[q]], s[ids[q]]).double().t()
                            for q in range(ids.numel())])
        assert _rel(p.sum(0), want) <= 1e-5
        assert _rel(p, o) <= 1e-5



@pytest.mark.parametrize("ksplits", [1, 3])
def test_moe_gemv_direct_depth_two_keeps_the_bits(ksplits, kernel_device):
    """Two K steps in flight (``depth`` 2) load the same words for the same steps: the bits of depth 1, with slices
    of several steps (ksplits 1: 4 steps) and of one or two (ksplits 3)."""
    dims = V41Dims(hidden=256, experts=5, topk_experts=3, moe_inter=64, tokens=2)
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=50 + ksplits, tokens=2)
    one, two = (GemvPlan(32, 32, w2_block_n=32, direct=True, ksplits=ksplits, depth=d) for d in (1, 2))
    assert torch.equal(gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, two), gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, one))


def test_moe_gemv_direct_detects_a_wrong_weight(kernel_device):
    """Nibbles swapped in W1 or W2 fail the tolerance on the direct kernel too."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(TOY_V41, kernel_device, seed=4, tokens=1)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    plan = gemv_mx.PLANS["moe_gemv_d"]

    def swap(w):
        return ((w >> 4) | (w << 4)).to(torch.uint8)
    assert _rel(gemv_mx.moe_gemv(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0, plan), want) <= 3e-2
    assert _rel(gemv_mx.moe_gemv(x, idx, wt, w1, s1, w3, s3, swap(w2), s2, 10.0, plan), want) > 0.1
    assert _rel(gemv_mx.moe_gemv(x, idx, wt, swap(w1), s1, w3, s3, w2, s2, 10.0, plan), want) > 0.1


def test_moe_gemv_direct_names_are_tuner_candidates_with_a_passing_check(kernel_device):
    """``moe_gemv_d*`` enter ``moe_mx.SMALL_TUNER`` (timed, never first) and pass their first-use check."""
    from redknot.kernels.triton import moe_mx
    names = [n for n in gemv_mx.PLANS if n.startswith("moe_gemv_d")]
    assert names and all(gemv_mx.PLANS[n].direct for n in names)
    assert all(n in moe_mx.SMALL_TUNER.candidates[1:] for n in names)
    assert stream_guard.self_check("moe_gemv_d", torch.device(kernel_device)) is None




def test_moe_gemv_direct_plans_cut_k_whatever_the_token_count():
    """The ``moe_gemv_d*`` / ``moe_gemv_f`` plans' K slices at V4.1's W1 | W3 and W2 shapes are the same at 1-4
    tokens (6-24 pairs), so a token alone and among four has the same sums (``slices``' own rule counts the
    pairs' column blocks: ``moe_gemv_k128`` cuts W1 | W3 into 2 slices at one token and 1 at four)."""
    names = [n for n in gemv_mx.PLANS if n.startswith(("moe_gemv_d", "moe_gemv_f"))]
    for name in names:
        plan = gemv_mx.PLANS[name]
        w2 = GemvPlan(plan.w2_block_n, plan.w2_block_k or plan.block_k, plan.min_steps, direct=True,
                      ksplits=min(plan.ksplits, 1))
        cuts = {(gemv_mx.fp4_slices(2304, 2560, p, plan), gemv_mx.fp4_slices(5120, 1152, p, w2)) for p in (6, 12, 24)}
        assert len(cuts) == 1, (name, cuts)
    assert gemv_mx.fp4_slices(2304, 2560, 6, gemv_mx.PLANS["moe_gemv_f"])[0] == 1
    k128 = gemv_mx.PLANS["moe_gemv_k128"]
    assert gemv_mx.fp4_slices(2304, 2560, 6, k128) != gemv_mx.fp4_slices(2304, 2560, 24, k128)


@pytest.mark.parametrize("dims,tokens", [(TOY_V41, 1), (TOY_V41, 3), (ODD, 2)], ids=["toy-1", "toy-3", "odd-2"])
def test_moe_gemv_fused_epilogues_keep_the_bits(dims, tokens, kernel_device):
    """``fuse``: the SwiGLU in the W1 | W3 launch and the combine in the W2 launch (one K slice each) give the bits of
    the same plan's five launches, twice (the counters are zero again after a launch), and the reference's values."""
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=tokens + 40, tokens=tokens)
    fused = GemvPlan(32, 32, 64, w2_block_n=64, direct=True, fuse=True, w2_block_k=16)
    plain = GemvPlan(32, 32, 64, w2_block_n=64, direct=True, w2_block_k=16)
    assert gemv_mx.fusable(x, dims.moe_inter, dims.hidden // 2, x.shape[0] * idx.shape[1], fused, True)
    launches = []
    real = gemv_fp4_mx.gemv_fp4  # moe_gemv's home reads it (gemv_mx re-exports both)

    def seen(*a, **k):
        return launches.append(k.get("act") is not None or k.get("out") is not None) or real(*a, **k)
    want = gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, plain)
    try:
        gemv_fp4_mx.gemv_fp4 = seen
        for _ in range(2):
            got = gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, fused)
            assert torch.equal(got, want)
    finally:
        gemv_fp4_mx.gemv_fp4 = real
    assert launches == [True, True, True, True]
    assert not gemv_mx._counters(torch.device(kernel_device), 1).any()
    assert _rel(got, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2


def test_moe_gemv_fused_plan_falls_back_where_a_launch_cannot_fuse(kernel_device):
    """W1 | W3 blocks of 16 columns (off the per-32 QDQ groups) and several K slices: the separate SwiGLU launch
    (W2's one slice keeps its combine), the bits of the unfused plan."""
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=9, tokens=2)
    fused = GemvPlan(16, 32, 1, direct=True, fuse=True)
    assert not gemv_mx.fusable(x, TOY_V41.moe_inter, TOY_V41.hidden // 2, 2 * idx.shape[1], fused, True)
    got = gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, fused)
    assert torch.equal(got, gemv_mx.moe_gemv(x, idx, wt, *w, 10.0, GemvPlan(16, 32, 1, direct=True)))


def test_moe_small_token_class_runs_the_gemv_choice(kernel_device, monkeypatch):
    """At most ``gemv_mx.MAX_ROWS`` tokens: ``moe_mx.SMALL_TUNER`` (first candidate ``stream``) times on
    ``SMALL_TUNE_TOKENS`` tokens and its ``moe_gemv*`` choice runs ``gemv_mx.moe_gemv``; 5+ tokens never ask it."""
    from redknot.kernels.triton import _common, moe_mx
    assert moe_mx.SMALL_TUNER.candidates[0] == "stream"
    assert all(c in gemv_mx.PLANS for c in moe_mx.SMALL_TUNER.candidates[1:])
    asked, timed = [], {}

    class Pick(_common.ConfigTuner):
        def pick(self, key, run, device):
            asked.append(key)
            timed["tokens"] = run("moe_gemv_n16").shape[0]
            return "moe_gemv_n16"
    monkeypatch.setattr(moe_mx, "SMALL_TUNER", Pick("small", ["stream", "moe_gemv_n16"]))
    ran = []
    real = gemv_mx.moe_gemv
    monkeypatch.setattr(gemv_mx, "moe_gemv", lambda *a, **k: ran.append(a[0].shape[0]) or real(*a, **k))
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=12, tokens=6)
    y = moe_mx.moe_splitk(x[:2], idx[:2], wt[:2], *w, 10.0)
    assert len(asked) == 1 and timed["tokens"] == moe_mx.SMALL_TUNE_TOKENS and ran[-1] == 2
    assert _rel(y, ref_v41.moe_mx(x[:2], idx[:2], wt[:2], *w, 10.0)) <= 3e-2
    ran.clear()
    moe_mx.moe_splitk(x, idx, wt, *w, 10.0)
    assert len(asked) == 1 and not ran
