"""The decode step's fused FP8 linears (``step_proj_v41.proj_rows`` / ``linear_post``) with a CUDA-core GEMV
weight stream at 1-4 rows (``gemv_partials``: ``gemv_mx``'s dense decode with the rows quantised per 32 inside)
and the same epilogue launch: bit for bit the launches they stand for (``linear_mx`` with that ``gemv*`` decode,
then ``rope_rows`` / ``mhc_post``), within the op tolerance of the PyTorch reference linear, the partials equal
to ``gemv_mx.gemv_fp8``'s, and the step's choice (``small_choice``): off with the small-row class off, above 4
rows and under the tuner's first candidate. Fresh random inputs; Triton's CPU interpreter (V4.1 sizes on the GPU:
``tests/kernels/test_step_proj_v41_gpu.py``)."""
import pytest
import torch

pytest.importorskip("triton")

from step_proj_cases import fp8_weight, reference
from slow_grid import rotated_grid

from redknot.kernels import ref_v41, tuning_cache
from redknot.kernels.triton import gemm_mx, gemv_mx, gemv_plan
from redknot.kernels.triton import step_proj_v41 as sp
from redknot.kernels.triton.step_proj_v41 import (
    Proj,
    gemv_partials,
    linear_post,
    proj_rows,
)
from redknot.kernels.triton.step_rope_v41 import rope_table
from redknot.models.deepseek_v41.ref_math import rope_inv_freq

NAMES = [n for n in gemv_mx.PLANS if not n.startswith("moe")]
QNAMES = ["q" + n for n in NAMES]           # the rows quantised once before the stream
PNAMES = ["p" + n for n in NAMES]           # each program's K slice of the rows quantised first


def case_inputs(t, k, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, k, generator=g) * 2).to(torch.bfloat16).to(device)
    x[0, :32] *= 50                                        # a group of another scale
    x[-1, 64:96] *= 1e-3                                   # and a small one
    pos = torch.randint(0, 1 << 20, (t,), generator=g).to(device)
    return x, pos, g


@pytest.mark.parametrize("name,t", rotated_grid([(n,) for n in NAMES + QNAMES + PNAMES], [(1,), (4,)]))
def test_partials_equal_gemv_fp8(name, t, kernel_device):
    """Two weights in one launch, the rows quantised inside: each weight's slice sums equal ``gemv_fp8``'s fp32
    output on the same rows, bit for bit (several K slices, a partial column block)."""
    k = 2048
    x, _, g = case_inputs(t, k, 3 + t, kernel_device)
    weights = [fp8_weight(n, k, g, kernel_device) for n in (96, 48)]
    parts = gemv_partials(x, weights, 32, name)
    for p, (w, s) in zip(parts, weights):
        want = gemv_mx.gemv_fp8(x, w, s, 32, torch.empty(t, w.shape[0], device=kernel_device),
                                gemv_mx.PLANS[sp.plan_name(name)])
        got = p[0].clone()
        for i in range(1, p.shape[0]):  # slice order, as the epilogue sums them
            got += p[i]
        assert p.shape[1:] == (t, w.shape[0]) and torch.equal(got, want)
    assert parts[0].shape[0] > 1 or name.endswith("gemv_k128")


@pytest.mark.parametrize("name,t", rotated_grid([(n,) for n in NAMES], [(1,), (2,), (4,)]))
def test_quantised_once_equals_quantised_inside(name, t, kernel_device):
    """The rows quantised once (``qgemv*``: a ``qdq_bf16`` launch, or rows the caller quantised; ``pgemv*``: each
    program's K slice first, into scratch rows) give the partials of the rows quantised inside every K step, bit
    for bit, slice by slice; the quantised rows are those of the
    per-32 e4m3 + E8M0 quantisation (``act_quant_mx``) dequantised exactly."""
    from redknot.kernels.triton.dequant_mx import qdq_bf16
    from redknot.kernels.triton.quant_mx import act_quant_mx
    k = 1024
    x, _, g = case_inputs(t, k, 83 + t, kernel_device)
    x[0, 128:160] = 0.0                                    # an all-zero group
    weights = [fp8_weight(n, k, g, kernel_device) for n in (64, 96)]
    inside = gemv_partials(x, weights, 32, name)
    once = gemv_partials(x, weights, 32, "q" + name)
    xq = qdq_bf16(x)
    given = gemv_partials(x, weights, 32, "q" + name, xq=xq)
    first = gemv_partials(x, weights, 32, "p" + name)
    for a, b, c, d in zip(inside, once, given, first):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    q, e = act_quant_mx(x, 32)
    deq = q.float().view(t, k // 32, 32) * torch.exp2(e.float() - 127)[..., None]
    assert torch.equal(xq.float(), deq.view(t, k))
    with pytest.raises(ValueError, match="quantised rows"):
        gemv_partials(x, weights, 32, "q" + name, xq=xq.float())


@pytest.mark.parametrize("name", NAMES + ["qgemv", "pgemv_n16"])
@pytest.mark.parametrize("t", [1, 3])
def test_proj_rows_gemv_equals_linear_mx_gemv_and_rope_rows(name, t, kernel_device):
    """wq_a -> norm, wkv -> norm + RoPE with the kv window bytes: bit for bit ``linear_mx`` (the same GEMV decode)
    then ``rope_rows``; the linear alone within the op tolerance of ``ref_v41.linear_mx``."""
    from redknot.kernels.triton.quant_mx import cache_insert_mx
    k, dq, dkv, rope = 512, 64, 64, 16
    x, pos, g = case_inputs(t, k, 31 + t, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(rope, 10000.0, None).to(kernel_device))
    wa, sa = fp8_weight(dq, k, g, kernel_device)
    wkv, skv = fp8_weight(dkv, k, g, kernel_device)
    nq = (1 + 0.1 * torch.randn(dq, generator=g)).to(kernel_device)
    nkv = (1 + 0.1 * torch.randn(dkv, generator=g)).to(kernel_device)
    specs = [Proj(wa, sa, dq, norm_w=nq, eps=1e-6), Proj(wkv, skv, dkv, norm_w=nkv, eps=1e-6, rope=True)]
    pack = torch.zeros(t, dkv + dkv // 32, dtype=torch.uint8, device=kernel_device)
    got = proj_rows(x, specs, cos, sin, pack=pack, stream=name)
    for spec, y in zip(specs, got):
        assert torch.equal(y, reference(x, spec, cos, sin, sp.plan_name(name)))
    want = torch.zeros_like(pack)
    cache_insert_mx(want, torch.arange(t, device=kernel_device), got[1].view(t, dkv), "window")
    assert torch.equal(pack, want) and want.any()
    plain = proj_rows(x, [Proj(wa, sa, 32)], cos, sin, stream=name)[0].view(t, dq).float()
    ref = ref_v41.linear_mx(x, wa, sa, 32).float()
    assert ((plain - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2 * ref.abs().max()).all()


@pytest.mark.parametrize("stream,t", rotated_grid([("gemv_n16",), ("qgemv_n16",), ("pgemv",)], [(2,), (4,)]))
def test_heads_and_index_grid_gemv(t, stream, kernel_device):
    """wq_b -> per-head RoPE and the indexer's wq_b -> RoPE + FP4 grid with a GEMV stream (two head widths,
    several K slices) against the launches it stands for."""
    k, h, d, hi, di, rope = 1024, 3, 96, 2, 64, 32
    x, pos, g = case_inputs(t, k, 41 + t, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(rope, 160000.0, (16.0, 65536, 32.0, 1.0)).to(kernel_device))
    wq, sq = fp8_weight(h * d, k, g, kernel_device)
    wi, si = fp8_weight(hi * di, k, g, kernel_device)
    specs = [Proj(wq, sq, d, rope=True), Proj(wi, si, di, rope=True, qdq=True)]
    for spec, y in zip(specs, proj_rows(x, specs, cos, sin, stream=stream)):
        assert torch.equal(y, reference(x, spec, cos, sin, "gemv_n16"))


@pytest.mark.parametrize("name,t,d,n", rotated_grid([(n,) for n in ["gemv", "gemv_k128", "qgemv_k128", "pgemv_k128"]],
                                                     [(1, 256, 4), (4, 1024, 4)]))
def test_linear_post_gemv_equals_linear_mx_then_mhc_post(name, t, d, n, kernel_device):
    from redknot.kernels.triton.mhc import mhc_post
    k = 512
    x, _, g = case_inputs(t, k, 51 + t, kernel_device)
    w, s = fp8_weight(d, k, g, kernel_device)
    h = torch.randn(t, n, d, generator=g).to(torch.bfloat16).to(kernel_device)
    post = torch.rand(t, n, generator=g).to(kernel_device) * 2
    comb = torch.rand(t, n, n, generator=g).to(kernel_device)
    y = gemm_mx.linear_mx(x, w, s, 32, decode=sp.plan_name(name), path="splitk")
    got = linear_post(x, w, s, h, post, comb, stream=name)
    assert torch.equal(got, mhc_post(y, h, post, comb))
    ref = mhc_post(ref_v41.linear_mx(x, w, s, 32), h, post, comb).float()
    assert ((got.float() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-2 * ref.abs().max()).all()


def test_wrong_scale_is_detected(kernel_device):
    k, d = 256, 64
    x, _, g = case_inputs(2, k, 61, kernel_device)
    w, s = fp8_weight(d, k, g, kernel_device)
    good = gemv_partials(x, [(w, s)], 32, "gemv")[0].sum(0)
    bad = s.clone()
    bad.view(torch.uint8)[0, 1] += 1
    assert not torch.equal(gemv_partials(x, [(w, bad)], 32, "gemv")[0].sum(0), good)
    rot = x.clone()
    rot[1] = x[1].roll(32)
    assert not torch.equal(gemv_partials(rot, [(w, s)], 32, "gemv")[0].sum(0)[1], good[1])
    with pytest.raises(ValueError, match="gemv_partials"):
        gemv_partials(torch.cat([x, x, x]), [(w, s)], 32, "gemv")   # 6 rows


def test_small_choice(kernel_device, monkeypatch):
    """The step's choice: a forced tuner choice runs (the bits of that GEMV), the class off / more than 4 rows /
    the first candidate give the ``fp8`` stream's bits."""
    k, d = 256, 64
    x, pos, g = case_inputs(2, k, 71, kernel_device)
    cos, sin = rope_table(pos, rope_inv_freq(16, 10000.0, None).to(kernel_device))
    w, s = fp8_weight(d, k, g, kernel_device)
    specs = [Proj(w, s, 32)]
    key = ("proj", ((d, k),), 32)
    monkeypatch.setitem(sp.STEP_SMALL_TUNER.choices, key, "gemv_k128")
    assert sp.small_choice("proj", x, [w], 32, None) == "gemv_k128"
    assert torch.equal(proj_rows(x, specs, cos, sin)[0], proj_rows(x, specs, cos, sin, stream="gemv_k128")[0])
    assert sp.small_choice("proj", torch.cat([x, x, x]), [w], 32, None) is None
    try:
        tuning_cache.use_small_rows_class(False)
        assert sp.small_choice("proj", x, [w], 32, None) is None
        assert torch.equal(proj_rows(x, specs, cos, sin)[0], proj_rows(x, specs, cos, sin, stream="fp8")[0])
    finally:
        tuning_cache.use_small_rows_class(True)
    monkeypatch.setattr(gemm_mx, "SMALL_ROWS_CLASS", False)
    assert sp.small_choice("proj", x, [w], 32, None) is None
    monkeypatch.setattr(gemm_mx, "SMALL_ROWS_CLASS", True)
    monkeypatch.delitem(sp.STEP_SMALL_TUNER.choices, key)
    assert sp.small_choice("proj", x, [w], 32, None) is None  # off the GPU: the first candidate, fp8


@pytest.mark.parametrize("name,t", [pytest.param(n, t, marks=() if (n, t) in {("fpgemv", 4), ("fpgemv_n16", 1)}
                                                  else pytest.mark.slow)   # 6-28 s a case in the interpreter
                                     for n in ["fpgemv", "fpgemv_n16", "fpgemv_k128"] for t in [1, 4]])
def test_linear_post_epilogue_in_the_stream_launch(name, t, kernel_device):
    """``fpgemv*`` (``_gemv_post``: the last program of each 512-column block sums its slices and mixes the block):
    bit for bit the two launches (``pgemv*``) and ``linear_mx`` with the gemv decode then ``mhc_post``; the block
    counters are zero again after each launch (a second call gives the same bits)."""
    from redknot.kernels.triton.mhc import mhc_post
    k, d, n = 1024, 1024, 4
    x, _, g = case_inputs(t, k, 91 + t, kernel_device)
    w, s = fp8_weight(d, k, g, kernel_device)
    h = torch.randn(t, n, d, generator=g).to(torch.bfloat16).to(kernel_device)
    post = torch.rand(t, n, generator=g).to(kernel_device) * 2
    comb = torch.rand(t, n, n, generator=g).to(kernel_device)
    got = linear_post(x, w, s, h, post, comb, stream=name)
    assert torch.equal(got, linear_post(x, w, s, h, post, comb, stream=name[1:]))
    y = gemm_mx.linear_mx(x, w, s, 32, decode=sp.plan_name(name), path="splitk")
    assert torch.equal(got, mhc_post(y, h, post, comb))
    assert not sp._counters(x.device, 2).any()
    assert torch.equal(linear_post(x, w, s, h, post, comb, stream=name), got)
    assert sp.quantise_mode(name) == 2 and sp.plan_name(name) == name[2:]


def test_post_choice_and_check(kernel_device, monkeypatch):
    """``linear_post``'s launch takes ``STEP_POST_TUNER``'s choice (with the ``fpgemv*`` names), ``FORCE_SMALL``
    ``fpgemv`` gives the W1 | W3 and proj launches ``pgemv`` (W2 has ``fpgemv``)."""
    from redknot.kernels.triton.mhc import mhc_post
    k, d = 256, 512
    x, _, g = case_inputs(2, k, 97, kernel_device)
    w, s = fp8_weight(d, k, g, kernel_device)
    h = torch.randn(2, 2, d, generator=g).to(torch.bfloat16).to(kernel_device)
    post, comb = torch.rand(2, 2, generator=g).to(kernel_device), torch.rand(2, 2, 2, generator=g).to(kernel_device)
    assert {"fpgemv", "fpgemv_n16", "fpgemv_k128"} <= set(sp.STEP_POST_TUNER.candidates)
    assert not {"fpgemv", "fpgemv_n16", "fpgemv_k128"} & set(sp.STEP_SMALL_TUNER.candidates)
    monkeypatch.setitem(sp.STEP_POST_TUNER.choices, ("post", ((d, k),), 32), "fpgemv_k128")
    got = linear_post(x, w, s, h, post, comb)
    assert torch.equal(got, mhc_post(gemm_mx.linear_mx(x, w, s, 32, decode="gemv_k128", path="splitk"), h, post,
                                     comb))
    monkeypatch.setattr(sp, "FORCE_SMALL", "fpgemv")
    assert sp.small_choice("proj", x, [w], 32, None) == "pgemv"
    assert sp.small_choice("post", x, [w], 32, None, tuner=sp.STEP_POST_TUNER) == "fpgemv"
    assert sp.small_choice("w2", x, [w], 32, None, tuner=sp.STEP_W2_TUNER) == "fpgemv"


@pytest.mark.parametrize("name", ["gemv", pytest.param("fpgemv_k128", marks=pytest.mark.slow)])  # 1.4 s / ~35 s
def test_first_use_check_passes(name, kernel_device):
    """The step GEMV's first-use check passes for a right kernel (the in-loop ``gemv``, and ``fpgemv_k128``)."""
    assert sp.self_check(name, torch.device(kernel_device)) is None


# The flat-grid forms (``step_proj_stream_v41._gemv2f``): ``*_flat`` the same slices as the shape, ``*_wave`` the
# slices ``wave_slices`` cuts against ``RESIDENT``'s programs an SM.
WAVE = list(sp.WAVE_NAMES)


@pytest.mark.parametrize("name", ["qgemv_k128", "pgemv_n16"])
def test_flat_grid_equals_the_block_slice_grid(name, kernel_device, monkeypatch):
    """``*_flat``: exactly nb0·S0 + nb1·S1 programs (``gemv_plan.TARGET_PROGRAMS`` 6 here, so the two weights get
    different K slice counts, as wq_b and the indexer's wq_b do at V4.1) with the partials of the (column block,
    slice) grid, bit for bit."""
    from redknot.kernels.triton import step_proj_stream_v41 as st
    monkeypatch.setattr(gemv_plan, "TARGET_PROGRAMS", 6)  # where gemv_mx.slices reads it
    k = 2048
    x, _, g = case_inputs(2, k, 111, kernel_device)
    weights = [fp8_weight(n, k, g, kernel_device) for n in (96, 48)]
    grid = gemv_partials(x, weights, 32, name)
    flat = gemv_partials(x, weights, 32, name + "_flat")
    assert st.grid_form(name + "_flat") == "_flat" and sp.plan_name(name + "_flat") == name[1:]
    assert grid[0].shape[0] != grid[1].shape[0]
    for a, b in zip(grid, flat):
        assert torch.equal(a, b)


def test_wave_slices_at_v41_launches():
    """``wave_slices``' counts for the V4.1 step launches (the arithmetic the NOTES table reads: programs and steps
    of each launch), one count for both weights, and independent of anything but the shapes; one weight reads the
    resident count of ``_gemv2`` (the kernel a one-weight ``*_wave`` launch runs)."""
    from redknot.kernels.triton import step_proj_stream_v41 as st

    def cut(name, ns, k):
        plan = gemv_mx.PLANS[sp.plan_name(name)]
        bk = gemv_mx._block_k(k, plan.block_k)
        S, ks = st.wave_slices(ns, k, plan, st.resident(sp.plan_name(name), sp.quantise_mode(name), bk, len(ns)))
        return S, ks // bk, S * sum(-(-n // plan.block_n) for n in ns)
    assert cut("gemv_n16_wave", (1280, 512), 5120) == (3, 4, 336)       # wq_a | wkv: one wave at 3 an SM
    assert cut("qgemv_n16_wave", (1280, 512), 5120) == (4, 3, 448)
    assert cut("qgemv_k128_wave", (32768, 4096), 1280) == (1, 10, 1152)  # wq_b + indexer: no empty programs
    assert cut("qgemv_n16_wave", (5120,), 8192) == (2, 8, 640)           # wo_b: one wave at 5 an SM
    assert cut("qgemv_n16_wave", (25600,), 6144) == (2, 6, 3200)         # Engram wkv
    assert st.resident("gemv_n16", 1, 64) == 4                            # a K step not listed: the smallest


@pytest.mark.parametrize("name", ["qgemv_k128_wave", "pgemv_k128_wave"])
def test_wave_plan_within_tolerance_and_row_invariant(name, kernel_device, monkeypatch):
    """``*_wave`` with slices other than ``gemv_mx.slices``' (``SMS`` 1: few resident programs, so 2 slices of
    4 steps where the shape cuts 4 / 8): the slice sums within the op tolerance of the PyTorch reference, a row's
    partials the same bits alone and among four (the slices depend on the shapes only), and through
    ``proj_rows``' epilogue the bits of the slice sums."""
    from redknot.kernels.triton import step_proj_stream_v41 as st
    monkeypatch.setattr(st, "SMS", 1)
    k = 1024
    x, _, g = case_inputs(4, k, 121, kernel_device)
    weights = [fp8_weight(n, k, g, kernel_device) for n in (96, 64)]
    parts = gemv_partials(x, weights, 32, name)
    base = sp.plan_name(name)
    for p, (w, s) in zip(parts, weights):
        assert p.shape[0] == 2 != gemv_mx.slices(w.shape[0], k, gemv_mx.PLANS[base])[0]
        ref = ref_v41.linear_mx(x, w, s, 32).float()
        got = p.sum(0)
        assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2 * ref.abs().max()).all()
    for r in (0, 3):
        alone = gemv_partials(x[r:r + 1], weights, 32, name)
        assert all(torch.equal(a[:, 0], p[:, r]) for a, p in zip(alone, parts))
    cos, sin = rope_table(torch.arange(4, device=kernel_device), rope_inv_freq(16, 10000.0, None).to(kernel_device))
    y = proj_rows(x, [Proj(*weights[0], 32)], cos, sin, stream=name)[0]
    p0 = gemv_partials(x, weights[:1], 32, name)[0]      # one weight: its own count (3 here)
    want = p0[0].clone()
    for i in range(1, p0.shape[0]):  # slice order, as the epilogue sums them
        want += p0[i]
    assert p0.shape[0] > 1 and torch.equal(y.view(4, 96), want.to(torch.bfloat16))


def test_wave_names_are_candidates_and_checked(kernel_device):
    """Every ``*_wave`` name is a ``STEP_SMALL_TUNER`` and ``STEP_POST_TUNER`` candidate after the existing ones
    (``fp8`` stays first), and the first-use check passes for one."""
    assert len(WAVE) == 9 and sp.STEP_SMALL_TUNER.candidates[0] == "fp8"
    assert sp.STEP_SMALL_TUNER.candidates[-len(WAVE):] == WAVE and set(WAVE) <= set(sp.STEP_POST_TUNER.candidates)
    assert sp.self_check("qgemv_k128_wave", torch.device(kernel_device)) is None


def test_the_gate_up_launch_times_no_wave_name(monkeypatch):
    """The shared expert's W1 | W3 launch would run a ``*_wave`` name as its base shape: its tuner leaves them out,
    and the launch (``_gate_up_launch``, under ``route_and_gate_up``) asks that tuner."""
    from redknot.kernels.triton import step_moe_v41 as sm
    assert sp.STEP_GATE_UP_TUNER.candidates == [c for c in sp.STEP_SMALL_TUNER.candidates if c not in WAVE]
    asked = []

    def small_choice(kind, x, weights, block, run, tuner=None):
        asked.append((kind, tuner))
        raise RuntimeError("stop after the choice")
    monkeypatch.setattr(sp, "small_choice", small_choice)
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    s = torch.zeros(1, 2)
    with pytest.raises(RuntimeError, match="stop after the choice"):
        sm._gate_up_launch(x, w, s, w, s, 32)
    assert asked == [("gate_up", sp.STEP_GATE_UP_TUNER)]


@pytest.mark.slow
@pytest.mark.parametrize("name", WAVE)
@pytest.mark.parametrize("t", [1, 4])
def test_wave_plans_linear_post_and_rows(name, t, kernel_device, monkeypatch):
    """Every ``*_wave`` plan through ``linear_post`` (2 slices under ``SMS`` 1) within the op tolerance of
    ``mhc_post`` on the PyTorch reference linear, and a row alone the bits it has among ``t``."""
    from redknot.kernels.triton import step_proj_stream_v41 as st
    from redknot.kernels.triton.mhc import mhc_post
    monkeypatch.setattr(st, "SMS", 1)
    k, d, n = 1024, 256, 4
    x, _, g = case_inputs(t, k, 131 + t, kernel_device)
    w, s = fp8_weight(d, k, g, kernel_device)
    h = torch.randn(t, n, d, generator=g).to(torch.bfloat16).to(kernel_device)
    post = torch.rand(t, n, generator=g).to(kernel_device) * 2
    comb = torch.rand(t, n, n, generator=g).to(kernel_device)
    got = linear_post(x, w, s, h, post, comb, stream=name)
    ref = mhc_post(ref_v41.linear_mx(x, w, s, 32), h, post, comb).float()
    assert ((got.float() - ref).abs() <= 2 ** -6 * ref.abs() + 1e-2 * ref.abs().max()).all()
    alone = linear_post(x[-1:], w, s, h[-1:], post[-1:], comb[-1:], stream=name)
    assert torch.equal(alone[0], got[-1])
