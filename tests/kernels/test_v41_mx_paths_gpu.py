"""The size-chosen ``linear_mx`` / ``moe_mx`` paths on the GPU at real V4.1 shapes against ``ref_v41``
(fresh random inputs; tolerances as ``checks_mx``: linear 1e-2, MoE 3e-2), CUDA-graph capture of the
decode paths, and batch invariance of the split-K rows."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.capture import cuda_graph
from redknot.kernels.triton import gemm_mx  # noqa: E402
from redknot.kernels.triton.checks_mx import REAL_V41, moe_batch, moe_graph, moe_inputs  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def moe_weights():
    return moe_inputs(REAL_V41, "cuda", seed=5, tokens=1)[3]


def _moe_batch(t, seed):
    return moe_batch(REAL_V41, t, seed, "cuda")


@pytest.mark.parametrize("n,k", [(5120, 8192), (32768, 1280), (512, 5120)], ids=["wo_b", "wq_b", "wkv"])
@pytest.mark.parametrize("rows,path", [(1, "auto"), (128, "auto"), (600, "auto"), (600, "splitk")])
@pytest.mark.parametrize("block", [32, 128])
def test_linear_paths_at_v41_shapes(n, k, rows, path, block):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, block)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    assert _rel(gemm_mx.linear_mx(x, w, ws, block, path=path), ref_v41.linear_mx(x, w, ws, block)) <= 1e-2


def test_linear_splitk_batch_invariant_and_graph_safe():
    g = torch.Generator(device="cuda").manual_seed(3)
    w, ws = mx.quant_fp8_blocks(torch.randn(5120, 8192, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(100, 8192, generator=g, device="cuda").to(torch.bfloat16)
    full = gemm_mx.linear_mx(x, w, ws, 32, path="splitk")
    # a row's bits within each row class: 65-128 rows and 5-64 rows (LINEAR_DECODE_TUNER's stream, a choice per
    # class) and 1-4 rows (the small-row class, which may take a gemv_mx stream: the same products summed in
    # another order)
    assert gemm_mx.wide_rows(100) and not gemm_mx.wide_rows(64)
    assert torch.equal(gemm_mx.linear_mx(x[10:80], w, ws, 32, path="splitk"), full[10:80])
    mid = gemm_mx.linear_mx(x[:64], w, ws, 32, path="splitk")
    assert torch.equal(gemm_mx.linear_mx(x[35:40], w, ws, 32, path="splitk"), mid[35:40])
    few = gemm_mx.linear_mx(x[36:39], w, ws, 32, path="splitk")
    assert torch.equal(gemm_mx.linear_mx(x[37:38], w, ws, 32, path="splitk"), few[1:2])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm_mx.linear_mx(x, w, ws, 32, path="splitk")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        out = gemm_mx.linear_mx(x, w, ws, 32, path="splitk")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, full)


@pytest.mark.parametrize("tokens,path", [(1, "splitk"), (32, "splitk"), (300, "splitk"), (300, "grouped"),
                                         (2048, "auto")])
def test_moe_paths_at_v41_shapes(tokens, path, moe_weights):
    x, idx, wt = _moe_batch(tokens, tokens)
    out = gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path=path)
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *moe_weights, 10.0)) <= 3e-2


def test_moe_splitk_batch_invariant_and_graph_safe(moe_weights):
    x, idx, wt = _moe_batch(64, 7)
    full = gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path="splitk")
    # a token's bits within each token class: 5+ tokens (DECODE_TUNER's stream), 1-4 (the small-token class)
    assert torch.equal(gemm_mx.moe_mx(x[7:12], idx[7:12], wt[7:12], *moe_weights, 10.0, path="splitk"), full[7:12])
    few = gemm_mx.moe_mx(x[8:11], idx[8:11], wt[8:11], *moe_weights, 10.0, path="splitk")
    alone = gemm_mx.moe_mx(x[9:10], idx[9:10], wt[9:10], *moe_weights, 10.0, path="splitk")
    assert torch.equal(alone, few[1:2])
    for t in (1, 32):
        xs, ids, ws = _moe_batch(t, 100 + t)
        _, out, eager = moe_graph(xs, ids, ws, moe_weights, 10.0)  # registry op: split-K at decode sizes
        assert torch.equal(out, eager)


def test_moe_grouped_has_no_host_sync(moe_weights):
    """The grouped path captures in a CUDA graph (a host read of the routing counts would fail it)."""
    x, idx, wt = _moe_batch(256, 11)
    eager = gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path="grouped")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path="grouped")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        out = gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path="grouped")
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, eager) <= 1e-3


def test_in_kernel_quantisation_equals_the_separate_pass(moe_weights, monkeypatch):
    from redknot.kernels.triton import moe_mx, splitk_mx
    g = torch.Generator(device="cuda").manual_seed(8)
    w, ws = mx.quant_fp8_blocks(torch.randn(5120, 8192, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(7, 8192, generator=g, device="cuda").to(torch.bfloat16)
    xm, idx, wt = _moe_batch(7, 8)
    for decode, knobs in (("registers", ((splitk_mx, "RAW_MAX_ROWS", 0), (moe_mx, "RAW_MAX_ROWS", 0))),
                          ("scaled", ((splitk_mx, "SCALED_RAW_MAX_ROWS", 128),)),
                          ("fp8", ((splitk_mx, "FP8_INKERNEL_QUANT_MAX_ROWS", 128),))):
        fused = (gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=decode),
                 moe_mx.moe_splitk(xm, idx, wt, *moe_weights, 10.0, decode=decode))
        with monkeypatch.context() as m:
            for mod, name, value in knobs:
                m.setattr(mod, name, value)
            assert torch.equal(gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=decode), fused[0])
            assert torch.equal(moe_mx.moe_splitk(xm, idx, wt, *moe_weights, 10.0, decode=decode), fused[1])


@pytest.mark.parametrize("decode", ["scaled", "registers", "fp8"])
@pytest.mark.parametrize("rows", [1, 32, 128])
def test_weight_stream_decodes_at_v41_shapes(decode, rows, moe_weights):
    """Both split-K weight decodes against ``ref_v41`` at decode sizes (dense wo_b / wq_b, MoE); the
    ``scaled`` kernel builds on this device (no fallback recorded)."""
    from redknot.kernels.triton import moe_mx, stream_guard
    if decode != "registers":
        assert stream_guard.self_check(decode, torch.device("cuda")) is None
    for n, k in ((5120, 8192), (32768, 1280)):
        g = torch.Generator(device="cuda").manual_seed(rows + n + 2)
        w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, 32)
        x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
        out = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=decode)
        assert _rel(out, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
    x, idx, wt = _moe_batch(rows, 200 + rows)
    out = moe_mx.moe_splitk(x, idx, wt, *moe_weights, 10.0, decode=decode)
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *moe_weights, 10.0)) <= 3e-2
    assert not stream_guard.DECODE_ERRORS


def test_scaled_prefill_plans_at_v41_shapes(moe_weights):
    """Each ``tiled`` prefill plan (``scaled`` decode) against ``ref_v41`` at 2048 tokens."""
    from redknot.kernels.triton import moe_mx
    x, idx, wt = _moe_batch(2048, 17)
    want = ref_v41.moe_mx(x, idx, wt, *moe_weights, 10.0)
    for plan in moe_mx.PREFILL_TUNER.candidates:
        if plan.path == "tiled":
            assert _rel(moe_mx.moe_prefill(x, idx, wt, *moe_weights, 10.0, plan=plan), want) <= 3e-2, plan
