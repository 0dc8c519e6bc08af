"""The q / kv projections with their row epilogues in two launches each (``step_proj_v41.proj_rows``) on the GPU
at real V4.1 sizes (5120-wide rows; ``wq_a`` 1280 and ``wkv`` 512 columns normalised, the kv latent rotated;
``wq_b`` 64 heads of 512 rotated; the indexer's ``wq_b`` 32 heads of 128 rotated onto the FP4 grid): bit for bit
the launches they replace (``linear_mx`` with the ``fp8`` decode, then ``rope_rows``; the kv rows' window bytes
against ``cache_insert_mx``), a CUDA-graph replay equal to the eager call, ``wo_b`` without an epilogue, and the
three-launch RoPE table against the six-launch form."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.capture import cuda_graph
from redknot.kernels.triton import gemm_mx
from redknot.kernels.triton.quant_mx import cache_insert_mx
from redknot.kernels.triton.step_proj_v41 import Proj, proj_rows
from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table
from redknot.models.deepseek_v41.ref_math import rope_inv_freq

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

DEV = "cuda"


@pytest.fixture(autouse=True)
def _small_rows_class_off():
    """These tests compare the step's launches with the ``fp8`` launches they replace, bit for bit: the 1-4-row
    GEMV class (``step_proj_v41.small_choice``) off, so the ``fp8`` stream runs at every row count (the GEMV
    forms: ``test_step_proj_gemv_v41*``)."""
    from redknot.kernels import tuning_cache
    before = tuning_cache.small_rows_class()
    tuning_cache.use_small_rows_class(False)
    yield
    tuning_cache.use_small_rows_class(before)


def weight(n, k, g):
    q, s = mx.quant_fp8_blocks(torch.randn(n, k, generator=g) * 0.02, 32)
    return q.to(DEV), s.to(DEV)


def reference(x, spec, cos, sin):
    y = gemm_mx.linear_mx(x, spec.weight, spec.scale, 32, decode="fp8", path="splitk")
    c, s = (cos, sin) if spec.rope else (cos[:, :0], sin[:, :0])
    return rope_rows(y.view(x.shape[0], spec.heads, spec.dim), c, s, norm_w=spec.norm_w, eps=spec.eps, qdq=spec.qdq)


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_proj_rows_equal_linear_mx_and_rope_rows_at_v41_sizes(rows):
    g = torch.Generator().manual_seed(rows)
    u = (torch.randn(rows, 5120, generator=g) * 2).to(torch.bfloat16).to(DEV)
    pos = torch.randint(0, 1 << 20, (rows,), generator=g).to(DEV)
    cos, sin = rope_table(pos, rope_inv_freq(64, 160000.0, (16.0, 65536, 32.0, 1.0)).to(DEV))
    (wa, sa), (wkv, skv) = weight(1280, 5120, g), weight(512, 5120, g)
    (wb, sb), (wi, si) = weight(64 * 512, 1280, g), weight(32 * 128, 1280, g)
    nq = (1 + 0.1 * torch.randn(1280, generator=g)).to(DEV)
    nkv = (1 + 0.1 * torch.randn(512, generator=g)).to(DEV)
    first = [Proj(wa, sa, 1280, norm_w=nq, eps=1e-6), Proj(wkv, skv, 512, norm_w=nkv, eps=1e-6, rope=True)]
    pack = torch.zeros(rows, 512 + 16, dtype=torch.uint8, device=DEV)
    qr, kv = proj_rows(u, first, cos, sin, pack=pack)
    assert torch.equal(qr, reference(u, first[0], cos, sin)) and torch.equal(kv, reference(u, first[1], cos, sin))
    want = torch.zeros_like(pack)
    cache_insert_mx(want, torch.arange(rows, device=DEV), kv.view(rows, 512), "window")
    assert torch.equal(pack, want)                # the kv rows' window-cache bytes
    qr = qr.view(rows, 1280)
    second = [Proj(wb, sb, 512, rope=True), Proj(wi, si, 128, rope=True, qdq=True)]
    q, qi = proj_rows(qr, second, cos, sin)
    assert torch.equal(q, reference(qr, second[0], cos, sin))
    assert torch.equal(qi, reference(qr, second[1], cos, sin))
    # a CUDA graph of both calls replays the eager results
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        a = proj_rows(u, first, cos, sin)
        b = proj_rows(qr, second, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(a + b, [proj_rows(u, first, cos, sin)[0], kv, q, qi]):
        assert torch.equal(x.view(y.shape), y)


@pytest.mark.parametrize("rows", [1, 16])
def test_plain_linear_rows_equal_linear_mx_at_wo_b_size(rows):
    """``wo_b`` (5120 x 8192) as ``fused_rows.linear_rows`` runs it: rows of 512 columns, no epilogue."""
    g = torch.Generator().manual_seed(100 + rows)
    z = torch.randn(rows, 8192, generator=g).to(torch.bfloat16).to(DEV)
    w, s = weight(5120, 8192, g)
    none = torch.empty(rows, 0, device=DEV)
    got = proj_rows(z, [Proj(w, s, 512)], none, none)[0].view(rows, 5120)
    assert torch.equal(got, gemm_mx.linear_mx(z, w, s, 32, decode="fp8", path="splitk"))


def test_rope_table_equals_the_six_launch_form_on_the_gpu():
    g = torch.Generator().manual_seed(9)
    pos = torch.randint(0, 1 << 24, (4096,), generator=g).to(DEV)
    for inv in (rope_inv_freq(64, 160000.0, (16.0, 65536, 32.0, 1.0)), rope_inv_freq(64, 10000.0, None)):
        ang = pos.to(torch.float64)[:, None] * inv.to(DEV)[None, :]
        cos, sin = rope_table(pos, inv)
        assert torch.equal(cos, ang.cos().float()) and torch.equal(sin, ang.sin().float())


@pytest.mark.parametrize("rows", [1, 16])
def test_linear_post_equals_linear_mx_then_mhc_post_at_v41_size(rows):
    """``wo_b`` (5120 x 8192) and the mHC post mix over 4 streams in two launches: bit for bit
    ``mhc_post(linear_mx(z, W))`` (the mix's own code per 512-column block)."""
    from redknot.kernels.triton.mhc import mhc_post
    from redknot.kernels.triton.step_proj_v41 import linear_post

    g = torch.Generator().manual_seed(200 + rows)
    z = torch.randn(rows, 8192, generator=g).to(torch.bfloat16).to(DEV)
    w, s = weight(5120, 8192, g)
    h = torch.randn(rows, 4, 5120, generator=g).to(torch.bfloat16).to(DEV)
    post = (torch.rand(rows, 4, generator=g) * 2).to(DEV)
    comb = torch.rand(rows, 4, 4, generator=g).to(DEV)
    want = mhc_post(gemm_mx.linear_mx(z, w, s, 32, decode="fp8", path="splitk"), h, post, comb)
    assert torch.equal(linear_post(z, w, s, h, post, comb), want)


@pytest.mark.parametrize("rows", [1, 4])
def test_moe_finish_with_the_post_mix_at_v41_size(rows):
    """The shared expert's last launch with the mHC post mix (D 5120, I 2304, 4 streams): bit for bit
    ``mhc_post`` of the unmixed output, both W2 forms."""
    from redknot.kernels.triton.mhc import mhc_post
    from redknot.kernels.triton.step_moe_v41 import (
        _gate_up_launch,
        shared_expert_finish,
    )

    g = torch.Generator().manual_seed(300 + rows)
    u = (torch.randn(rows, 5120, generator=g) * 2).to(torch.bfloat16).to(DEV)
    (w1, s1), (w3, s3), (w2, s2) = weight(2304, 5120, g), weight(2304, 5120, g), weight(5120, 2304, g)
    routed = torch.randn(rows, 5120, generator=g).to(torch.bfloat16).to(DEV)
    h = torch.randn(rows, 4, 5120, generator=g).to(torch.bfloat16).to(DEV)
    post = (torch.rand(rows, 4, generator=g) * 2).to(DEV)
    comb = torch.rand(rows, 4, 4, generator=g).to(DEV)
    for prologue in (True, False):
        p1 = _gate_up_launch(u, w1, s1, w3, s3, 32)
        out = shared_expert_finish(p1, w2, s2, 10.0, routed, prologue=prologue)
        got = shared_expert_finish(p1, w2, s2, 10.0, routed, prologue=prologue, mix=(h, post, comb))
        assert torch.equal(got, mhc_post(out, h, post, comb))
