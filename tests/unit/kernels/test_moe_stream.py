"""The fused MoE decode streams (``moe_stream``) and the wide-tile dense register stream against ``ref_v41``,
on the GPU or through the Triton interpreter at small sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import gemm_mx, moe_mx, moe_stream, stream_guard  # noqa: E402
from redknot.kernels.triton.checks_mx import TOY_V41, V41Dims, moe_inputs  # noqa: E402
from redknot.kernels.triton.moe_stream import StreamPlan  # noqa: E402
from slow_grid import rotated_grid  # noqa: E402

ODD = V41Dims(hidden=96, experts=7, topk_experts=3, moe_inter=96, tokens=9)
# small launch shapes that cover each code path: both decodes, one K slice (fused epilogues) and K slices
# (partials + the split-K reductions), the tile map and the inline tile lookup
PLANS = [StreamPlan("regs", 32, 64), StreamPlan("scaled", 32, 64), StreamPlan("regs", 32, 32, min_steps=1),
         StreamPlan("regs", 64, 128, inline=True), StreamPlan("fp8", 32, 64), StreamPlan("fp8", 32, 32, min_steps=1),
         StreamPlan("fp8", 64, 128, inline=True)]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _stream_id(p):
    return f"{p.decode}-{p.block_n}x{p.block_k}-s{p.min_steps}-i{p.inline}"


@pytest.mark.parametrize("plan,dims,tokens", rotated_grid([(p,) for p in PLANS], [(TOY_V41, 1), (ODD, 11)],
                                                          [_stream_id(p) for p in PLANS], ["toy-1", "odd-11"]))
def test_fused_stream_matches_reference(plan, dims, tokens, kernel_device):
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=tokens + 60, tokens=tokens)
    out = moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan)
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[1], PLANS[4]], ids=["regs", "scaled", "fp8"])
def test_fused_stream_detects_a_wrong_weight(plan, kernel_device):
    """The tolerance separates right from wrong: nibbles swapped (element order) in W2 or in W1 fail it."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(TOY_V41, kernel_device, seed=3)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    swap = lambda w: ((w >> 4) | (w << 4)).to(torch.uint8)  # noqa: E731
    assert _rel(moe_stream.moe_stream(x, idx, wt, w1, s1, w3, s3, swap(w2), s2, 10.0, plan), want) > 0.1
    assert _rel(moe_stream.moe_stream(x, idx, wt, swap(w1), s1, w3, s3, w2, s2, 10.0, plan), want) > 0.1


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[2], PLANS[4], PLANS[5]],
                         ids=["fused", "slices", "fp8-fused", "fp8-slices"])
def test_fused_stream_token_is_batch_invariant(plan, kernel_device):
    x, idx, wt, w = moe_inputs(ODD, kernel_device, seed=8, tokens=9)
    full = moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan)
    alone = moe_stream.moe_stream(x[4:5], idx[4:5], wt[4:5], *w, 10.0, plan)
    assert torch.equal(alone, full[4:5])


def test_decode_tuner_plans_run_through_moe_splitk(kernel_device):
    """A ``StreamPlan`` given as the decode runs the fused stream (the tuner's candidates are such plans)."""
    assert any(isinstance(c, StreamPlan) for c in moe_mx.DECODE_TUNER.candidates)
    assert isinstance(moe_mx.DECODE_TUNER.candidates[0], str)  # untimed default unchanged
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=4, tokens=5)
    plan = StreamPlan("regs", 32, 64)
    assert torch.equal(moe_mx.moe_splitk(x, idx, wt, *w, 10.0, decode=plan),
                       moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan))


@pytest.mark.parametrize("decode", ["regs", "fp8"])
def test_stream_check_passes_and_detects_a_wrong_stream(decode, kernel_device, monkeypatch):
    from redknot.kernels.triton import moe_stream_fp8
    device = torch.device(kernel_device)
    plan = StreamPlan(decode, 32, 64)
    # self_check of a StreamPlan is stream_check(plan, device) itself: run once, through self_check
    real_check, routed = stream_guard.stream_check, []
    monkeypatch.setattr(stream_guard, "stream_check", lambda *args: routed.append(args[:2]) or real_check(*args))
    assert stream_guard.self_check(plan, device) is None and routed == [(plan, device)]
    monkeypatch.setattr(stream_guard, "stream_check", real_check)
    mod, name = (moe_stream, "stream_gemm") if decode == "regs" else (moe_stream_fp8, "stream_gemm_fp8")
    real = getattr(mod, name)

    def off_by_one_scale(a, *args, **kw):
        if decode == "regs":
            w, ws, *rest = args
        else:
            sa, w, ws, *rest = args
            return real(a, sa, w, ws.view(torch.uint8) + 1, *rest, **kw)
        return real(a, w, ws.view(torch.uint8) + 1, *rest, **kw)
    monkeypatch.setattr(mod, name, off_by_one_scale)
    assert "W1 | W3 sums differ from decode='registers'" in stream_guard.stream_check(plan, device)


def test_stream_check_catches_a_wrong_epilogue(kernel_device, monkeypatch):
    """The W1 | W3 partials agree but the fused SwiGLU epilogue is wrong: the output comparison fails."""
    device = torch.device(kernel_device)
    real = moe_stream.stream_gemm

    def wrong_limit(*args, **kw):
        if kw.get("epi") == 1:
            kw["limit"] = 0.01
        return real(*args, **kw)
    monkeypatch.setattr(moe_stream, "stream_gemm", wrong_limit)
    assert "MoE output differs" in stream_guard.stream_check(StreamPlan("regs", 32, 64), device)


def test_failing_stream_plan_falls_back_to_registers(monkeypatch):
    plan = StreamPlan("regs", 64, 128)
    monkeypatch.setattr(stream_guard, "DECODE_ERRORS", {})
    monkeypatch.setattr(stream_guard, "_CHECKED", {plan})  # the check itself needs a GPU

    def broken():
        raise RuntimeError("out of resource: shared memory")
    with pytest.warns(UserWarning, match="is not used"):
        assert stream_guard.with_fallback(torch.device("cuda"), plan, broken, lambda: "registers") == "registers"
    assert "out of resource" in stream_guard.DECODE_ERRORS[plan]


def test_stream_plan_rejects_bad_values(kernel_device):
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=1, tokens=2)
    with pytest.raises(ValueError, match="decode='fast'"):
        moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fast"))
    with pytest.raises(ValueError, match="block_n=48"):
        moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("regs", 48, 64))


@pytest.mark.parametrize("rows", [1, 17, 40])
def test_registers_wide_equals_registers_bits(rows, kernel_device):
    """One row tile for all rows (and the separate quantisation pass above 16 rows): the same products in the
    same order as 16-row tiles, so the same bits; and against the reference."""
    g = torch.Generator(device=kernel_device).manual_seed(rows)
    w, ws = mx.quant_fp8_blocks(torch.randn(96, 128, generator=g, device=kernel_device) * 0.02, 32)
    x = torch.randn(rows, 128, generator=g, device=kernel_device).to(torch.bfloat16)
    wide = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode="registers_wide")
    assert torch.equal(wide, gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode="registers"))
    assert torch.equal(wide[:1], gemm_mx.linear_mx(x[:1], w, ws, 32, path="splitk", decode="registers_wide"))
    assert _rel(wide, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2


@pytest.mark.slow
def test_kernel_bench_stream_table_smoke(tmp_path, kernels_v41_main):
    """``kernels_v41.py --only stream`` (CPU interpreter, toy sizes): every variant row runs, is checked
    against the reference, and lands in the variant table."""
    assert kernels_v41_main(["--smoke", "--only", "stream", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "kernels_v41.md").read_text()
    assert "## Decode streams by variant" in text
    for variant in ("split-K scaled", "fused regs 32x64", "fused scaled 32x64", "ladder: bytes only 32x64 w4",
                    "registers_wide"):
        assert f"| {variant} |" in text
    assert "| fused fp8 32x64 |" in text
    assert "err vs ref" in text and "FAIL" not in text


@pytest.mark.parametrize("route_kernel", [True, False], ids=["kernel", "sort"])
@pytest.mark.parametrize("tokens,dim", [(3, 64), (5, 1056)])
def test_routing_writes_the_fp8_rows_of_act_quant(route_kernel, tokens, dim, kernel_device, monkeypatch):
    """The routing step's e4m3 + E8M0 token rows are the bits of ``act_quant_mx`` (both routing paths)."""
    from redknot.kernels.triton.quant_mx import act_quant_mx
    if not route_kernel:
        monkeypatch.setattr(moe_mx, "ROUTE_KERNEL_MAX_PAIRS", 0)
    g = torch.Generator(device=kernel_device).manual_seed(tokens)
    x = (torch.randn(tokens, dim, generator=g, device=kernel_device) * 3).to(torch.bfloat16)
    idx = torch.randint(0, 4, (tokens, 2), generator=g, device=kernel_device)
    got = moe_mx._sorted_pairs(idx, torch.rand(tokens, 2, generator=g, device=kernel_device), 4, x, fp8=True)
    q, s = act_quant_mx(x)
    assert torch.equal(got[4].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[5], s)


@pytest.mark.parametrize("rows", [1, 17])
def test_linear_fp8_n32_matches_reference(rows, kernel_device):
    g = torch.Generator(device=kernel_device).manual_seed(rows + 3)
    w, ws = mx.quant_fp8_blocks(torch.randn(96, 128, generator=g, device=kernel_device) * 0.02, 32)
    x = torch.randn(rows, 128, generator=g, device=kernel_device).to(torch.bfloat16)
    out = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode="fp8_n32")
    assert _rel(out, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2


def test_linear_fp8_n32_passes_its_check(kernel_device, monkeypatch):
    """``self_check("fp8_n32")`` (its own shapes and operands, the same for any caller's rows): it passes, and a
    wrong narrow-tile stream fails it."""
    from redknot.kernels.triton import splitk_mx
    assert stream_guard.self_check("fp8_n32", torch.device(kernel_device)) is None
    real = splitk_mx.splitk_mm

    def wrong_when_narrow(a, w, ws, *args, **kw):
        if kw.get("block_n") == 32:
            ws = ws.view(torch.uint8) + 1
        return real(a, w, ws, *args, **kw)
    monkeypatch.setattr(splitk_mx, "splitk_mm", wrong_when_narrow)
    assert "differs from decode='registers'" in stream_guard.self_check("fp8_n32", torch.device(kernel_device))


def test_decode_tuners_time_a_fixed_batch(kernel_device, monkeypatch):
    """The tuners time every candidate on a fixed decode batch, not on the call that triggers them: a
    1-token call's MoE candidates run on ``TUNE_TOKENS`` tokens, a 1-row linear's on ``LINEAR_TUNE_ROWS``."""
    from redknot.kernels.triton import _common
    seen = {}

    class Recorder(_common.ConfigTuner):
        def pick(self, key, run, device):
            seen[self.name] = run(self.candidates[0])
            return self.candidates[0]
    monkeypatch.setattr(moe_mx, "DECODE_TUNER", Recorder("moe", moe_mx.DECODE_TUNER.candidates))
    monkeypatch.setattr(gemm_mx, "LINEAR_DECODE_TUNER", Recorder("linear", gemm_mx.LINEAR_DECODE_TUNER.candidates))
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=6, tokens=1)
    moe_mx.moe_splitk(x, idx, wt, *w, 10.0)
    assert seen["moe"].shape == (moe_mx.TUNE_TOKENS, TOY_V41.hidden)
    wl, wls = mx.quant_fp8_blocks(torch.randn(64, 96, device=kernel_device), 32)
    gemm_mx.linear_mx(torch.randn(1, 96, device=kernel_device).to(torch.bfloat16), wl, wls, 32, path="splitk")
    assert seen["linear"].shape == (gemm_mx.LINEAR_TUNE_ROWS, 64)


def test_wide_calls_have_their_own_linear_class(kernel_device, monkeypatch):
    """A dense decode call of ``WIDE_ROWS_MIN`` rows or more asks ``LINEAR_DECODE_TUNER`` under its own key, timed
    on ``LINEAR_WIDE_TUNE_ROWS`` rows; a narrower call under the shape's key on ``LINEAR_TUNE_ROWS`` rows; with the
    row classes off (batch invariance) every call takes the shape's key."""
    from redknot.kernels import tuning_cache
    from redknot.kernels.triton import _common
    seen = []

    class Recorder(_common.ConfigTuner):
        def pick(self, key, run, device):
            seen.append((key, run(self.candidates[0]).shape[0]))
            return self.candidates[0]
    monkeypatch.setattr(gemm_mx, "LINEAR_DECODE_TUNER", Recorder("linear", gemm_mx.LINEAR_DECODE_TUNER.candidates))
    wl, wls = mx.quant_fp8_blocks(torch.randn(64, 96, device=kernel_device), 32)
    before = tuning_cache.small_rows_class()
    try:
        for rows in (gemm_mx.WIDE_ROWS_MIN - 1, gemm_mx.WIDE_ROWS_MIN):
            x = torch.randn(rows, 96, device=kernel_device).to(torch.bfloat16)
            got = gemm_mx.linear_mx(x, wl, wls, 32, path="splitk")
            want = ref_v41.linear_mx(x, wl, wls, 32)
            assert ((got.float() - want.float()).abs() <= 2e-2 * want.float().abs().max()).all()
        tuning_cache.use_small_rows_class(False)
        gemm_mx.linear_mx(torch.randn(gemm_mx.WIDE_ROWS_MIN, 96, device=kernel_device).to(torch.bfloat16), wl, wls,
                          32, path="splitk")
    finally:
        tuning_cache.use_small_rows_class(before)
    shape = ((64, 96), 32)
    assert seen == [(shape, gemm_mx.LINEAR_TUNE_ROWS), (shape + (gemm_mx.LINEAR_WIDE_TUNE_ROWS,),
                                                        gemm_mx.LINEAR_WIDE_TUNE_ROWS), (shape, gemm_mx.LINEAR_TUNE_ROWS)]


# ``fp8h`` (``moe_stream_fp8h``): hidden and intermediate sizes multiples of 128 (4 groups per loop step);
# 384 hidden with 256 columns leaves column blocks partly past N (the masked loads)
HALVES_DIMS = V41Dims(hidden=256, experts=5, topk_experts=2, moe_inter=128, tokens=9)
HALVES_WIDE = V41Dims(hidden=384, experts=4, topk_experts=2, moe_inter=128, tokens=7)
HALVES_PLANS = [StreamPlan("fp8h", 64, 128), StreamPlan("fp8h", 128, 128), StreamPlan("fp8h", 64, 128, w2_block_n=128),
                StreamPlan("fp8h", 64, 128, min_steps=1), StreamPlan("fp8h", 64, 128, inline=True),
                StreamPlan("fp8hd", 64, 128), StreamPlan("fp8hd", 32, 128, min_steps=1),
                StreamPlan("fp8hd", 64, 128, inline=True), StreamPlan("fp8hd4", 64, 128),
                StreamPlan("fp8hd4", 64, 128, min_steps=1), StreamPlan("fp8hd4", 128, 128),
                StreamPlan("fp8hd", 128, 128, w2_block_n=64), StreamPlan("fp8hd4", 64, 128, w2_block_n=128)]


def _plan_id(p):
    return f"{p.decode}-{p.block_n}-w2{p.w2_block_n}-s{p.min_steps}-i{p.inline}"


@pytest.mark.parametrize("plan", HALVES_PLANS, ids=_plan_id)
def test_halves_stream_matches_reference(plan, kernel_device):
    x, idx, wt, w = moe_inputs(HALVES_DIMS, kernel_device, seed=21, tokens=9)
    out = moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan)
    assert out.shape == (9, HALVES_DIMS.hidden) and out.dtype == torch.bfloat16
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2


def test_halves_stream_with_partial_column_blocks(kernel_device):
    """256 columns over W1 | W3's 128 and W2's 384: the second column block of a program lies partly or wholly
    past N."""
    x, idx, wt, w = moe_inputs(HALVES_WIDE, kernel_device, seed=22, tokens=7)
    out = moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fp8h", 256, 128))
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2


@pytest.mark.parametrize("plan", [HALVES_PLANS[1], HALVES_PLANS[3], HALVES_PLANS[5], HALVES_PLANS[6], HALVES_PLANS[8]],
                         ids=["fused", "slices", "diag", "diag-slices", "diag4"])
def test_halves_stream_token_is_batch_invariant(plan, kernel_device):
    """Token 4 alone and among 13 (26 pairs over 5 experts: some experts past one 8-row tile)."""
    x, idx, wt, w = moe_inputs(HALVES_DIMS, kernel_device, seed=23, tokens=13)
    full = moe_stream.moe_stream(x, idx, wt, *w, 10.0, plan)
    alone = moe_stream.moe_stream(x[4:5], idx[4:5], wt[4:5], *w, 10.0, plan)
    assert torch.equal(alone, full[4:5])


@pytest.mark.parametrize("plan", [HALVES_PLANS[0], HALVES_PLANS[5], HALVES_PLANS[8]], ids=["halves", "diag", "diag4"])
def test_halves_stream_detects_a_wrong_weight(plan, kernel_device):
    """Nibbles swapped in W1 or in W2 (each group's low and high halves exchanged) fail the tolerance."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(HALVES_DIMS, kernel_device, seed=24, tokens=5)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    swap = lambda w: ((w >> 4) | (w << 4)).to(torch.uint8)  # noqa: E731
    assert _rel(moe_stream.moe_stream(x, idx, wt, w1, s1, w3, s3, swap(w2), s2, 10.0, plan), want) > 0.1
    assert _rel(moe_stream.moe_stream(x, idx, wt, swap(w1), s1, w3, s3, w2, s2, 10.0, plan), want) > 0.1


@pytest.mark.parametrize("decode", ["fp8h", "fp8hd", "fp8hd4"])
def test_halves_stream_check_passes_and_detects_a_wrong_scale(decode, kernel_device, monkeypatch):
    from redknot.kernels.triton import moe_stream_fp8h
    device = torch.device(kernel_device)
    plan = StreamPlan(decode, 64, 128)
    assert stream_guard.stream_check(plan, device) is None
    real = moe_stream_fp8h.stream_gemm_fp8h

    def off_by_one_scale(a, sa, w, ws, *rest, **kw):
        return real(a, sa, w, ws.view(torch.uint8) + 1, *rest, **kw)
    monkeypatch.setattr(moe_stream_fp8h, "stream_gemm_fp8h", off_by_one_scale)
    assert "W1 | W3 sums differ from decode='registers'" in stream_guard.stream_check(plan, device)


def test_halves_plan_runs_fp8_where_sizes_are_not_multiples_of_128(kernel_device):
    """TOY_V41 (64 hidden / intermediate): ``fp8h`` runs the ``fp8`` kernels with its launch shape."""
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=25, tokens=3)
    got = moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fp8h", 64, 128))
    assert torch.equal(got, moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fp8", 64, 128)))


@pytest.mark.parametrize("route_kernel", [True, False], ids=["kernel", "sort"])
def test_routing_writes_fp8_rows_in_halves_order(route_kernel, kernel_device, monkeypatch):
    """With ``halves`` the routing step's e4m3 rows are ``halves_order`` of ``act_quant_mx``'s (both routing
    paths), its scales the fp32 powers of two of the E8M0 bytes; ``halves_order`` puts each group's even K
    elements first."""
    from redknot.kernels.triton.moe_stream_fp8h import halves_order, scales_f32
    from redknot.kernels.triton.quant_mx import act_quant_mx
    if not route_kernel:
        monkeypatch.setattr(moe_mx, "ROUTE_KERNEL_MAX_PAIRS", 0)
    g = torch.Generator(device=kernel_device).manual_seed(7)
    x = (torch.randn(3, 1024, generator=g, device=kernel_device) * 3).to(torch.bfloat16)
    idx = torch.randint(0, 4, (3, 2), generator=g, device=kernel_device)
    got = moe_mx._sorted_pairs(idx, torch.rand(3, 2, generator=g, device=kernel_device), 4, x, fp8=True, halves=True)
    q, s = act_quant_mx(x)
    assert torch.equal(got[4].view(torch.uint8), halves_order(q).view(torch.uint8))
    assert got[5].dtype == torch.float32 and torch.equal(got[5], scales_f32(s))
    assert torch.equal(scales_f32(torch.tensor([127, 120, 130], dtype=torch.uint8)), torch.tensor([1.0, 2**-7, 8.0]))
    h = halves_order(torch.arange(64, dtype=torch.uint8, device=kernel_device)[None])[0].tolist()
    assert h == list(range(0, 32, 2)) + list(range(1, 32, 2)) + list(range(32, 64, 2)) + list(range(33, 64, 2))


def test_halves_plan_runs_fp8_where_scale_words_are_misaligned(kernel_device):
    """Weight scales whose rows cannot be read as 32-bit words (a view one byte in): ``fp8`` kernels, same bits."""
    from redknot.kernels.triton import moe_stream_fp8h
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(HALVES_DIMS, kernel_device, seed=26, tokens=3)
    shifted = torch.empty(s1.numel() + 1, dtype=torch.uint8, device=kernel_device)[1:].view(s1.shape)
    shifted.copy_(s1.view(torch.uint8))
    assert not moe_stream_fp8h.words_ok(shifted) and moe_stream_fp8h.words_ok(s1)
    w = (w1, shifted, w3, s3, w2, s2)
    got = moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fp8h", 64, 128))
    assert torch.equal(got, moe_stream.moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fp8", 64, 128)))
