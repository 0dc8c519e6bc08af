"""The CUDA-core GEMV streams for 1-4 rows (``gemv_mx``) against ``ref_v41``, their first-use check and the
small-row class of the dense linear tuner; on the GPU or through the Triton interpreter at small sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import gemm_mx, gemv_mx, stream_guard
from redknot.kernels.triton.gemv_mx import GemvPlan


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
PLANS = [GemvPlan(32, 256), GemvPlan(16, 256, 1), GemvPlan(16, 512), GemvPlan(64, 128, 4, 4, 1)]


@pytest.mark.parametrize("n,k,block", SHAPES, ids=[f"{n}x{k}b{b}" for n, k, b in SHAPES])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
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
    out = lambda w, ws: gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(2, 64, dtype=torch.float32,
                                                                    device=kernel_device))
    bad = ws.view(torch.uint8).clone()
    bad[:, 5] += 2
    assert _rel(out(w, bad), want) > 0.1
    assert _rel(out(w.view(torch.uint8).roll(16, 1).view(torch.float8_e4m3fn), ws), want) > 0.1


def test_gemv_slices_depend_on_the_weight_shape_only():
    for n, k in ((5120, 8192), (32768, 1280), (96, 512)):
        for plan in gemv_mx.PLANS.values():
            S, ksplit = gemv_mx.slices(n, k, plan)
            assert S * ksplit >= k and (S - 1) * ksplit < k and ksplit % 32 == 0
    assert gemv_mx.slices(32768, 1280, GemvPlan(32, 256))[0] == 1  # 1024 column blocks fill the device alone


def test_gemv_rejects_more_rows_than_it_holds(kernel_device):
    x, w, ws = _dense(32, 64, 32, gemv_mx.MAX_ROWS + 1, 1, kernel_device)
    with pytest.raises(ValueError, match="at most"):
        gemv_mx.gemv_fp8(x, w, ws, 32, torch.empty(x.shape[0], 32, device=kernel_device))


@pytest.mark.parametrize("name", list(gemv_mx.PLANS))
def test_linear_gemv_decode_matches_reference_at_any_row_count(name, kernel_device):
    """``linear_mx(decode="gemv*")``: four rows per launch; a row of a 7-row call equals that row alone."""
    x, w, ws = _dense(80, 512, 32, 7, 11, kernel_device)
    y = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=name)
    assert _rel(y, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
    assert torch.equal(gemm_mx.linear_mx(x[5:6], w, ws, 32, path="splitk", decode=name), y[5:6])


@pytest.mark.parametrize("name", list(gemv_mx.PLANS))
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
    monkeypatch.setattr(gemm_mx, "SMALL_ROWS_CLASS", False)
    gemm_mx.linear_mx(x[:2], w, ws, 32)
    assert len(asked) == 1 and not ran
