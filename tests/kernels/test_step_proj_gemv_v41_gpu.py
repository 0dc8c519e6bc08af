"""The decode step's fused linears with a CUDA-core GEMV weight stream (``step_proj_v41.gemv_partials``) on the
GPU at V4.1 sizes, 1 and 4 rows: ``wq_a`` | ``wkv`` (5120 -> 1280 normalised, 512 normalised + rotated, the kv
window bytes), ``wq_b`` | the indexer's ``wq_b`` (1280 -> 64 x 512 rotated, 32 x 128 rotated + FP4 grid) and
``wo_b`` + the mHC post mix (8192 -> 5120, 4 streams): bit for bit ``linear_mx`` with the same ``gemv*`` decode
followed by ``rope_rows`` / ``mhc_post``, no first-use failure, a CUDA-graph replay equal to the eager call, and
the step's own choice (``stream=None``, timed outside capture) the same in a graph as eagerly; the shared expert's
W1 | W3 GEMV launch with the router (D 5120, I 2304, 384 experts) likewise, and its W2 GEMV (``stream=`` of
``shared_expert_finish``). ``qgemv*`` / ``pgemv*``: the same shapes with the rows quantised once before the
stream / by each program first into scratch rows (the same bits as the ``gemv*`` shape); ``fpgemv*``: ``pgemv*``
with ``linear_post``'s epilogue in the stream launch (the last program of each block; replayed 20 times)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.capture import cuda_graph
from redknot.kernels.triton import gemm_mx, gemv_mx, stream_guard
from redknot.kernels.triton.mhc import mhc_post
from redknot.kernels.triton.quant_mx import cache_insert_mx
from redknot.kernels.triton.step_proj_v41 import Proj, linear_post, plan_name, proj_rows
from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table
from redknot.models.deepseek_v41.ref_math import rope_inv_freq

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

DEV = "cuda"
NAMES = [n for n in gemv_mx.PLANS if not n.startswith("moe")]
QNAMES = ["q" + n for n in NAMES] + ["p" + n for n in NAMES] + ["fp" + n for n in NAMES]


def weight(n, k, g):
    q, s = mx.quant_fp8_blocks(torch.randn(n, k, generator=g) * 0.02, 32)
    return q.to(DEV), s.to(DEV)


def reference(x, spec, cos, sin, name):
    y = gemm_mx.linear_mx(x, spec.weight, spec.scale, 32, decode=plan_name(name), path="splitk")
    c, s = (cos, sin) if spec.rope else (cos[:, :0], sin[:, :0])
    return rope_rows(y.view(x.shape[0], spec.heads, spec.dim), c, s, norm_w=spec.norm_w, eps=spec.eps, qdq=spec.qdq)


def problem(rows, seed):
    g = torch.Generator().manual_seed(seed)
    u = (torch.randn(rows, 5120, generator=g) * 2).to(torch.bfloat16).to(DEV)
    pos = torch.randint(0, 1 << 20, (rows,), generator=g).to(DEV)
    cos, sin = rope_table(pos, rope_inv_freq(64, 160000.0, (16.0, 65536, 32.0, 1.0)).to(DEV))
    (wa, sa), (wkv, skv) = weight(1280, 5120, g), weight(512, 5120, g)
    (wb, sb), (wi, si) = weight(64 * 512, 1280, g), weight(32 * 128, 1280, g)
    nq = (1 + 0.1 * torch.randn(1280, generator=g)).to(DEV)
    nkv = (1 + 0.1 * torch.randn(512, generator=g)).to(DEV)
    first = [Proj(wa, sa, 1280, norm_w=nq, eps=1e-6), Proj(wkv, skv, 512, norm_w=nkv, eps=1e-6, rope=True)]
    second = [Proj(wb, sb, 512, rope=True), Proj(wi, si, 128, rope=True, qdq=True)]
    z = torch.randn(rows, 8192, generator=g).to(torch.bfloat16).to(DEV)
    wo = weight(5120, 8192, g)
    h = torch.randn(rows, 4, 5120, generator=g).to(torch.bfloat16).to(DEV)
    post = (torch.rand(rows, 4, generator=g) * 2).to(DEV)
    comb = torch.rand(rows, 4, 4, generator=g).to(DEV)
    return u, cos, sin, first, second, z, wo, (h, post, comb)


def step(u, cos, sin, first, second, z, wo, mix, stream):
    rows = u.shape[0]
    pack = torch.zeros(rows, 512 + 16, dtype=torch.uint8, device=DEV)
    qr, kv = proj_rows(u, first, cos, sin, pack=pack, stream=stream)
    q, qi = proj_rows(qr.view(rows, 1280), second, cos, sin, stream=stream)
    hp = linear_post(z, *wo, *mix, stream=stream)
    return [qr, kv, pack, q, qi, hp]


@pytest.mark.parametrize("name", NAMES + QNAMES)
@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_forms_equal_linear_mx_gemv_then_epilogues_at_v41_sizes(name, rows):
    u, cos, sin, first, second, z, wo, mix = problem(rows, 10 + rows)
    qr, kv, pack, q, qi, hp = step(u, cos, sin, first, second, z, wo, mix, name)
    assert not [k for k in stream_guard.DECODE_ERRORS if k == ("step_proj", name)], stream_guard.DECODE_ERRORS
    assert torch.equal(qr, reference(u, first[0], cos, sin, name))
    assert torch.equal(kv, reference(u, first[1], cos, sin, name))
    want = torch.zeros_like(pack)
    cache_insert_mx(want, torch.arange(rows, device=DEV), kv.view(rows, 512), "window")
    assert torch.equal(pack, want)
    qr2 = qr.view(rows, 1280)
    assert torch.equal(q, reference(qr2, second[0], cos, sin, name))
    assert torch.equal(qi, reference(qr2, second[1], cos, sin, name))
    assert torch.equal(hp, mhc_post(gemm_mx.linear_mx(z, *wo, 32, decode=plan_name(name), path="splitk"), *mix))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        got = step(u, cos, sin, first, second, z, wo, mix, name)
    for _ in range(20 if name.startswith("fp") else 1):   # the block counters: every replay the same bits
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, [qr, kv, pack, q, qi, hp]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 4])
def test_step_choice_is_the_same_in_a_graph(rows):
    """``stream=None``: the tuner's choice per launch (timed on the first, eager call) replays in a graph with the
    same bits."""
    args = problem(rows, 40 + rows)
    eager = step(*args, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        got = step(*args, None)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, eager):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES + QNAMES)
@pytest.mark.parametrize("rows", [1, 4])
def test_shared_expert_gate_up_gemv_at_v41_size(name, rows):
    """The shared expert (D 5120, I 2304) with its W1 | W3 GEMV launch and the router's programs: the routing equal
    to ``route_topk``'s, each linear's slice sums bit for bit ``gemv_mx.gemv_fp8``'s, the finished expert equal to
    the same launches in a CUDA-graph replay."""
    from redknot.kernels.triton.step_moe_v41 import (
        route_and_gate_up,
        route_topk,
        shared_expert_finish,
    )

    g = torch.Generator().manual_seed(300 + rows)
    u = (torch.randn(rows, 5120, generator=g) * 2).to(torch.bfloat16).to(DEV)
    (w1, s1), (w3, s3), (w2, s2) = weight(2304, 5120, g), weight(2304, 5120, g), weight(5120, 2304, g)
    routed = torch.randn(rows, 5120, generator=g).to(torch.bfloat16).to(DEV)
    logits = (torch.randn(rows, 384, generator=g) * 3).to(DEV)
    bias = (torch.randn(384, generator=g) * 0.1).to(DEV)

    def run():
        ids, w, p1 = route_and_gate_up(logits, bias, 6, 1.0, True, 2.5, u, w1, s1, w3, s3, stream=name)
        return ids, w, p1, shared_expert_finish(p1, w2, s2, 10.0, routed)
    ids, w, p1, out = run()
    assert not [k for k in stream_guard.DECODE_ERRORS if k == ("step_proj", name)], stream_guard.DECODE_ERRORS
    want_ids, want_w = route_topk(logits, bias, 6, 1.0, True, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    plan = gemv_mx.PLANS[plan_name(name)]
    sums = [p1[0, :, :2304].clone(), p1[0, :, 2304:].clone()]
    for i in range(1, p1.shape[0]):
        sums[0] += p1[i, :, :2304]
        sums[1] += p1[i, :, 2304:]
    for got, (wt, st) in zip(sums, ((w1, s1), (w3, s3))):
        assert torch.equal(got, gemv_mx.gemv_fp8(u, wt, st, 32, torch.empty(rows, 2304, device=DEV), plan))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        again = run()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(again, (ids, w, p1, out)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES + ["p" + n for n in NAMES] + ["fp" + n for n in NAMES]
                         + ["f" + n for n in NAMES])
@pytest.mark.parametrize("rows", [1, 4])
def test_shared_expert_w2_gemv_at_v41_size(name, rows):
    """W2 (5120 x 2304) as a GEMV on the SwiGLU rows quantised once (``pgemv*``: formed in the W2 launch itself):
    no first-use failure, W2's slice sums bit for
    bit ``gemv_mx.gemv_fp8``'s on the ``fp8`` path's e4m3 + E8M0 rows dequantised, the output within bf16
    rounding of the ``fp8`` W2 stream's, plain and with the mHC post mix, and a graph replay equal to eager."""
    import redknot.kernels.triton.step_moe_v41 as sm

    g = torch.Generator().manual_seed(500 + rows)
    u = (torch.randn(rows, 5120, generator=g) * 2).to(torch.bfloat16).to(DEV)
    (w1, s1), (w3, s3), (w2, s2) = weight(2304, 5120, g), weight(2304, 5120, g), weight(5120, 2304, g)
    routed = torch.randn(rows, 5120, generator=g).to(torch.bfloat16).to(DEV)
    h = torch.randn(rows, 4, 5120, generator=g).to(torch.bfloat16).to(DEV)
    post, comb = (torch.rand(rows, 4, generator=g) * 2).to(DEV), torch.rand(rows, 4, 4, generator=g).to(DEV)
    p1 = sm.route_and_gate_up(torch.randn(rows, 384, generator=g).to(DEV), torch.zeros(384, device=DEV), 6, 1.0,
                              True, 2.5, u, w1, s1, w3, s3, stream="fp8")[2]

    def run():
        return (sm.shared_expert_finish(p1, w2, s2, 10.0, routed, stream=name),
                sm.shared_expert_finish(p1, w2, s2, 10.0, routed, mix=(h, post, comb), stream=name))
    out, mixed = run()
    assert ("step_w2", name) not in stream_guard.DECODE_ERRORS, stream_guard.DECODE_ERRORS
    aq = torch.empty(rows, 2304, dtype=torch.float8_e4m3fn, device=DEV)
    sa = torch.empty(rows, 72, dtype=torch.uint8, device=DEV)
    sm._swiglu_quant[(rows, 72 // 16 + 1)](p1, aq, sa, 2304, p1.shape[0], p1.stride(0), p1.stride(1), aq.stride(0),
                                           sa.stride(0), 10.0, BLOCK_G=16, LIBDEVICE=True)
    act = (aq.float().view(rows, 72, 32) * torch.exp2(sa.float() - 127)[..., None]).view(rows, 2304).bfloat16()
    p2 = sm._w2_gemv(p1, w2, s2.view(torch.uint8), 10.0, 32, plan_name(name))
    got = p2[0].clone()
    for i in range(1, p2.shape[0]):
        got += p2[i]
    want = gemv_mx.gemv_fp8(act, w2, s2, 32, torch.empty(rows, 5120, device=DEV), gemv_mx.PLANS[plan_name(name)])
    assert torch.equal(got, want)
    fp8 = sm.shared_expert_finish(p1, w2, s2, 10.0, routed, stream="fp8")
    # the W2 sums differ by order: one bf16 rounding of W2's output apart at most, then one of the sum with routed
    assert ((out.float() - fp8.float()).abs() <= 2 ** -6 * (fp8.float().abs() + routed.float().abs()) + 1e-3).all()
    assert torch.equal(mixed, mhc_post(out, h, post, comb))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        again = run()
    for _ in range(20 if name.startswith("f") else 1):   # fpgemv / fgemv: the block counters, every replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(again[0], out) and torch.equal(again[1], mixed)
    if name.startswith("f"):
        assert torch.equal(out, sm.shared_expert_finish(p1, w2, s2, 10.0, routed, stream=name[1:]))


@pytest.mark.parametrize("name", [n + "_wave" for n in NAMES + ["q" + n for n in NAMES] + ["p" + n for n in NAMES]])
def test_wave_forms_at_v41_sizes(name):
    """``*_wave`` (``_gemv2f``: the flat grid with ``wave_slices``' K slices) at the V4.1 step launches: the slice
    sums within the op tolerance of ``ref_v41.linear_mx``, each row the same bits alone and among four (the
    slices depend on the weight shapes only), the ``*_flat`` form the bits of the (block, slice) grid, the whole
    step's launches with no first-use failure and a graph replay equal to the eager call."""
    from redknot.kernels import ref_v41
    from redknot.kernels.triton.step_proj_v41 import gemv_partials
    u, cos, sin, first, second, z, wo, mix = problem(4, 77)
    qr = torch.randn(4, 1280, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
    for x, ws in ((u, [(s.weight, s.scale) for s in first]), (qr, [(s.weight, s.scale) for s in second]),
                  (z, [wo])):
        parts = gemv_partials(x, ws, 32, name)
        for p, (w, s) in zip(parts, ws):
            ref = ref_v41.linear_mx(x, w, s, 32).float()
            assert ((p.sum(0) - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2 * ref.abs().max()).all()
        for r in (0, 3):
            alone = gemv_partials(x[r:r + 1], ws, 32, name)
            assert all(torch.equal(a[:, 0], p[:, r]) for a, p in zip(alone, parts))
        base = name[:-len("_wave")]
        assert all(torch.equal(a, b) for a, b in zip(gemv_partials(x, ws, 32, base + "_flat"),
                                                     gemv_partials(x, ws, 32, base)))
    out = step(u, cos, sin, first, second, z, wo, mix, name)
    assert not [k for k in stream_guard.DECODE_ERRORS if k == ("step_proj", name)], stream_guard.DECODE_ERRORS
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        got = step(u, cos, sin, first, second, z, wo, mix, name)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, out))
