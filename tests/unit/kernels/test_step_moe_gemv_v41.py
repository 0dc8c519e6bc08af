"""The step's shared expert with its W1 | W3 stream as a CUDA-core GEMV at 1-4 rows (``step_moe_v41``'s
``_route_gate_up_gemv``: the router's programs in the same launch, ``step_proj_v41._gemv_tile`` for the weights):
the routing bit for bit ``route_topk``'s, each linear's slice sums bit for bit ``gemv_mx.gemv_fp8``'s, the shared
expert within the op tolerance of the PyTorch reference and equal to the per-linear form with the same GEMV
decode; with the small-row class off the ``fp8`` stream runs. Fresh random inputs, Triton's CPU interpreter."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41, tuning_cache
from redknot.kernels.triton import gemm_mx, gemv_mx
from redknot.kernels.triton import step_proj_v41 as sp
from redknot.kernels.triton.step_moe_v41 import (
    route_and_gate_up,
    route_topk,
    shared_expert_finish,
)

LIMIT = 10.0


def _case(t, d, inter, seed):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(t, d, generator=g) * 2).to(torch.bfloat16)
    u[0, :32] *= 40
    ws = [mx.quant_fp8_blocks(torch.randn(n, k, generator=g) * 0.05, 32) for n, k in ((inter, d), (inter, d),
                                                                                      (d, inter))]
    routed = torch.randn(t, d, generator=g).to(torch.bfloat16)
    logits = torch.randn(t, 24, generator=g) * 3
    bias = torch.randn(24, generator=g) * 0.1
    return u, ws, routed, logits, bias


def _want(lin, u, ws, routed):
    (w1, s1), (w3, s3), (w2, s2) = ws
    act = F.silu(lin(u, w1, s1).float().clamp(max=LIMIT)) * lin(u, w3, s3).float().clamp(-LIMIT, LIMIT)
    return (routed.float() + lin(act.to(torch.bfloat16), w2, s2).float()).to(torch.bfloat16)


NAMES = [n for n in gemv_mx.PLANS if not n.startswith("moe")]


def _cases(names, rows, default):
    """(name, rows) pairs; those not in ``default`` run with ``-m slow`` (each form keeps a default case: the
    interpreter takes 5-90 s a case at these widths)."""
    return [pytest.param(n, t, marks=() if (n, t) in default else pytest.mark.slow) for n in names for t in rows]


@pytest.mark.parametrize("name,t", _cases(NAMES + ["qgemv", "qgemv_k128", "pgemv", "pgemv_n16"], [1, 4],
                                         {("gemv", 1), ("gemv_k128", 4), ("qgemv", 1), ("pgemv", 4)}))
def test_gate_up_gemv(name, t):
    d, inter = 2048, 96
    u, ws, routed, logits, bias = _case(t, d, inter, 5 + t)
    (w1, s1), (w3, s3), (w2, s2) = ws
    ids, w, p1 = route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1, s1, w3, s3, stream=name)
    want_ids, want_w = route_topk(logits, bias, 4, 1.0, True, 1.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    got1, got3 = p1[0, :, :inter].clone(), p1[0, :, inter:].clone()
    for i in range(1, p1.shape[0]):  # slice order
        got1 += p1[i, :, :inter]
        got3 += p1[i, :, inter:]
    plan = gemv_mx.PLANS[sp.plan_name(name)]
    assert torch.equal(got1, gemv_mx.gemv_fp8(u, w1, s1, 32, torch.empty(t, inter), plan))
    assert torch.equal(got3, gemv_mx.gemv_fp8(u, w3, s3, 32, torch.empty(t, inter), plan))
    assert p1.shape[0] > 1                                    # several K slices
    out = shared_expert_finish(p1, w2, s2, LIMIT, routed)
    ref = _want(lambda x, w_, s_: ref_v41.linear_mx(x, w_, s_, 32, 32), u, ws, routed)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 2e-2, err
    # the per-linear form: W1 / W3 through linear_mx with the same GEMV decode, W2 with fp8 (the step's W2 stream)
    dec = [sp.plan_name(name), sp.plan_name(name), "fp8"]

    def lin(x, w_, s_):
        return gemm_mx.linear_mx(x, w_, s_, 32, 32, decode=dec.pop(0))
    per = _want(lin, u, ws, routed)
    assert (out.float() != per.float()).float().mean().item() <= 0.01   # SiLU's exp: numpy in the interpreter


def test_gate_up_choice_respects_the_class(monkeypatch):
    u, ws, _, logits, bias = _case(2, 256, 64, 9)
    (w1, s1), (w3, s3), _ = ws
    monkeypatch.setattr(sp, "FORCE_SMALL", "gemv")
    ran = []
    real = sp._gemv_tile

    import redknot.kernels.triton.step_moe_v41 as sm
    real_gemv = sm._gate_up_gemv

    def counted(*a, **k):
        ran.append(a[-1])
        return real_gemv(*a, **k)
    monkeypatch.setattr(sm, "_gate_up_gemv", counted)
    forced = route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1, s1, w3, s3)[2]
    assert ran == ["gemv"] and torch.equal(forced, route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1, s1,
                                                                     w3, s3, stream="gemv")[2])
    before = tuning_cache.small_rows_class()
    tuning_cache.use_small_rows_class(False)
    try:
        off = route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1, s1, w3, s3)[2]
    finally:
        tuning_cache.use_small_rows_class(before)
    assert ran == ["gemv", "gemv"] and torch.equal(off, route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1,
                                                                          s1, w3, s3, stream="fp8")[2])
    assert real is sp._gemv_tile


def test_shared_expert_combine_takes_the_choice(monkeypatch):
    """``shared_expert_combine`` (no router programs in the W1 | W3 launch) with the GEMV choice: the bits of the
    routed launch's partials finished the same way."""
    from redknot.kernels.triton.step_moe_v41 import shared_expert_combine
    u, ws, routed, logits, bias = _case(3, 512, 64, 13)
    (w1, s1), (w3, s3), (w2, s2) = ws
    monkeypatch.setattr(sp, "FORCE_SMALL", "gemv_k128")
    got = shared_expert_combine(u, w1, s1, w3, s3, w2, s2, LIMIT, routed)
    p1 = route_and_gate_up(logits, bias, 2, 1.0, True, 1.0, u, w1, s1, w3, s3, stream="gemv_k128")[2]
    assert torch.equal(got, shared_expert_finish(p1, w2, s2, LIMIT, routed))


@pytest.mark.parametrize("name,t", _cases(NAMES + ["pgemv", "pgemv_k128"], [1, 3], {("gemv", 1), ("pgemv", 3)}))
def test_w2_gemv(name, t):
    """The shared expert's W2 as a GEMV (``shared_expert_finish(stream=...)``): the SwiGLU rows quantised once as
    bf16 are the ``fp8`` path's e4m3 + E8M0 rows dequantised, W2's slice sums equal ``gemv_mx.gemv_fp8``'s on those
    rows bit for bit (several K slices; ``pgemv*``: the SwiGLU formed in the W2 launch, the same partials), and the output (plain and with the mHC post mix) is the ``fp8`` path's up
    to W2's summation order and within 2e-2 of the PyTorch reference."""
    import redknot.kernels.triton.step_moe_v41 as sm
    from redknot.kernels.triton.mhc import mhc_post
    from redknot.kernels.triton.step_moe_v41 import _swiglu_quant
    d, inter = 256, 2048
    u, ws, routed, logits, bias = _case(t, d, inter, 23 + t)
    (w1, s1), (w3, s3), (w2, s2) = ws
    p1 = route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1, s1, w3, s3, stream="fp8")[2]
    aq = torch.empty(t, inter, dtype=torch.float8_e4m3fn)
    sa = torch.empty(t, inter // 32, dtype=torch.uint8)
    act = torch.empty(t, inter, dtype=torch.bfloat16)
    for q, sc, flag in ((aq, sa, False), (act, act, True)):
        _swiglu_quant[(t, inter // 32 // 16)](p1, q, sc, inter, p1.shape[0], p1.stride(0), p1.stride(1), q.stride(0),
                                              sc.stride(0), LIMIT, BLOCK_G=16, LIBDEVICE=False, QDQ_BF16=flag)
    deq = aq.float().view(t, -1, 32) * torch.exp2(sa.float() - 127)[..., None]
    assert torch.equal(act.float(), deq.view(t, inter)) and act.float().abs().max() > 0
    p2 = sm._w2_gemv(p1, w2, s2.view(torch.uint8), LIMIT, 32, name)
    assert p2.shape[0] > 1
    if name.startswith("p"):
        assert torch.equal(p2, sm._w2_gemv(p1, w2, s2.view(torch.uint8), LIMIT, 32, sp.plan_name(name)))
    got = p2[0].clone()
    for i in range(1, p2.shape[0]):  # slice order
        got += p2[i]
    assert torch.equal(got, gemv_mx.gemv_fp8(act, w2, s2, 32, torch.empty(t, d), gemv_mx.PLANS[sp.plan_name(name)]))
    out = shared_expert_finish(p1, w2, s2, LIMIT, routed, stream=name)
    fp8 = shared_expert_finish(p1, w2, s2, LIMIT, routed, stream="fp8")
    assert not torch.equal(out, routed)
    # the W2 sums differ by order: one bf16 rounding of W2's output apart at most, then one of the sum with routed
    assert ((out.float() - fp8.float()).abs() <= 2 ** -6 * (fp8.float().abs() + routed.float().abs()) + 1e-3).all()
    ref = _want(lambda x, w_, s_: ref_v41.linear_mx(x, w_, s_, 32, 32), u, ws, routed)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err < 2e-2, err
    g = torch.Generator().manual_seed(7)
    h = torch.randn(t, 4, d, generator=g).to(torch.bfloat16)
    post, comb = torch.rand(t, 4, generator=g) * 2, torch.rand(t, 4, 4, generator=g)
    mixed = shared_expert_finish(p1, w2, s2, LIMIT, routed, mix=(h, post, comb), stream=name)
    assert torch.equal(mixed, mhc_post(out, h, post, comb))


def test_w2_choice(monkeypatch):
    """W2's stream: ``STEP_W2_TUNER``'s choice (a forced one, and ``FORCE_SMALL``'s ``qgemv*`` as its ``gemv*``
    shape), ``fp8`` off the GPU, with the class off and above 4 rows."""
    import redknot.kernels.triton.step_moe_v41 as sm
    u, ws, routed, logits, bias = _case(2, 256, 256, 31)
    (w1, s1), (w3, s3), (w2, s2) = ws
    p1 = route_and_gate_up(logits, bias, 4, 1.0, True, 1.5, u, w1, s1, w3, s3, stream="fp8")[2]
    ran = []
    real = sm._w2_gemv

    def counted(*a, **k):
        ran.append(a[-1])
        return real(*a, **k)
    monkeypatch.setattr(sm, "_w2_gemv", counted)
    fp8 = shared_expert_finish(p1, w2, s2, LIMIT, routed)
    assert ran == [] and torch.equal(fp8, shared_expert_finish(p1, w2, s2, LIMIT, routed, stream="fp8"))
    key = ("w2", (tuple(w2.shape),), 32)
    monkeypatch.setitem(sp.STEP_W2_TUNER.choices, key, "gemv_n16")
    got = shared_expert_finish(p1, w2, s2, LIMIT, routed)
    assert ran == ["gemv_n16"] and torch.equal(got, shared_expert_finish(p1, w2, s2, LIMIT, routed,
                                                                         stream="gemv_n16"))
    monkeypatch.setattr(sp, "FORCE_SMALL", "qgemv_k128")
    shared_expert_finish(p1, w2, s2, LIMIT, routed)
    assert ran[-1] == "gemv_k128"
    monkeypatch.setattr(sp, "FORCE_SMALL", None)
    before = tuning_cache.small_rows_class()
    tuning_cache.use_small_rows_class(False)
    try:
        n = len(ran)
        assert torch.equal(shared_expert_finish(p1, w2, s2, LIMIT, routed), fp8) and len(ran) == n
    finally:
        tuning_cache.use_small_rows_class(before)


def test_w2_first_use_check(monkeypatch):
    """``w2_self_check``: passes for the W2 GEMV forms, reports a stream whose sums are off."""
    import redknot.kernels.triton.step_moe_v41 as sm
    for name in ("gemv_k128", "pgemv"):
        assert sm.w2_self_check(name, torch.device("cpu")) is None
    real = sm._w2_gemv

    def off(*a, **k):
        p = real(*a, **k)
        p[0, :, 5] += 0.5
        return p
    monkeypatch.setattr(sm, "_w2_gemv", off)
    assert "differs" in sm.w2_self_check("pgemv", torch.device("cpu"))


@pytest.mark.parametrize("name,t", _cases(["fpgemv", "fpgemv_k128", "fgemv_n16"], [1, 3],
                                         {("fpgemv", 3), ("fgemv_n16", 3)}))
def test_w2_finish_in_the_w2_launch(name, t):
    """``fpgemv*``: W2 (its SwiGLU formed inside) and the combine (plain and with the mHC post mix) in one launch
    (``_w2_fused``: the last program of each 512-column block) give the bits of the ``pgemv*`` launches; the block
    counters are zero again after each launch. ``fgemv*``: ``_swiglu_quant`` first, then W2 and the combine in one
    launch: the bits of the ``gemv*`` launches."""
    import redknot.kernels.triton.step_moe_v41 as sm
    d, inter = 1024, 512
    g = torch.Generator().manual_seed(8 + t)
    p1 = torch.randn(3, t, 2 * inter, generator=g) * 2              # W1 | W3 partials, three K slices
    w2, s2 = mx.quant_fp8_blocks(torch.randn(d, inter, generator=g) * 0.05, 32)
    routed = torch.randn(t, d, generator=g).to(torch.bfloat16)
    h = torch.randn(t, 4, d, generator=g).to(torch.bfloat16)
    mix = (h, torch.rand(t, 4, generator=g) * 2, torch.rand(t, 4, 4, generator=g))
    for m in (None, mix):
        got = shared_expert_finish(p1, w2, s2, LIMIT, routed, mix=m, stream=name)
        assert torch.equal(got, shared_expert_finish(p1, w2, s2, LIMIT, routed, mix=m, stream=name[1:]))
        assert not sp._counters(torch.device("cpu"), 2).any()
        assert torch.equal(shared_expert_finish(p1, w2, s2, LIMIT, routed, mix=m, stream=name), got)
    if t == 1:
        assert sm.w2_self_check(name, torch.device("cpu")) is None
