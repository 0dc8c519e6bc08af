"""Verify steps above 128 rows on a CUDA device (``-m gpu``): the kernel paths a verify tier above 128
rows takes and the tier's graph against eager execution.

Above 128 rows ``linear_mx`` leaves the split-K weight stream for the ``dequant`` path (bf16 weight
chunks + a library GEMM) and the MoE split-K stream quantises its activations in a separate pass
(``qdq_bf16(x, split=True)`` + ``tile_map``) instead of inside the GEMM. Here: both paths against
``ref_v41`` with fresh random inputs at real V4.1 shapes, both captured in a CUDA graph at a verify tier
(replay equals the eager call bit for bit), the MoE stream's rows independent of the padding rows that
share its call, and a V4.1 cut with the Triton ops (toy width, the same row thresholds) whose tier-192
graph replays a step of 160 rows (32 padding) and one of 192 rows as eager execution computes them.
"""
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import gemm_mx  # noqa: E402
from redknot.kernels.triton.checks_mx import REAL_V41, capture_graph, moe_batch, moe_inputs  # noqa: E402
from redknot.kernels.triton.splitk_mx import RAW_MAX_ROWS  # noqa: E402

BENCH = Path(__file__).resolve().parents[3] / "benchmarks"


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def moe_weights():
    return moe_inputs(REAL_V41, "cuda", seed=11, tokens=1)[3]


def _moe_batch(t, seed):
    return moe_batch(REAL_V41, t, seed, "cuda")


def _graphed(fn):
    """(eager result, replayed result) of ``fn`` captured in a CUDA graph; the output buffer is zeroed
    before the checked replay, so a replay that writes nothing fails."""
    eager = fn().clone()
    graph, out = capture_graph(fn)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


@pytest.mark.parametrize("tokens", [129, 192, 512, 1024])
def test_moe_splitk_above_the_raw_rows_matches_reference(tokens, moe_weights):
    assert tokens > RAW_MAX_ROWS
    x, idx, wt = _moe_batch(tokens, 1000 + tokens)
    out = gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path="splitk")
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *moe_weights, 10.0)) <= 3e-2


@pytest.mark.parametrize("n,k", [(5120, 8192), (32768, 1024), (512, 5120)], ids=["wo_b", "wq_b", "wkv"])
@pytest.mark.parametrize("rows", [129, 192])
@pytest.mark.parametrize("path", ["auto", "dequant"])
def test_linear_above_128_rows_matches_reference(n, k, rows, path):
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + n)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    assert _rel(gemm_mx.linear_mx(x, w, ws, 32, path=path), ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2


def test_paths_above_128_rows_replay_in_a_graph_as_eager(moe_weights):
    """At a 192-row tier both paths replay from a CUDA graph exactly as the eager call computes."""
    g = torch.Generator(device="cuda").manual_seed(5)
    w, ws = mx.quant_fp8_blocks(torch.randn(5120, 8192, generator=g, device="cuda") * 0.02, 32)
    x = torch.randn(192, 8192, generator=g, device="cuda").to(torch.bfloat16)
    eager, replay = _graphed(lambda: gemm_mx.linear_mx(x, w, ws, 32))          # the path 192 rows take
    assert torch.equal(replay, eager)
    eager, replay = _graphed(lambda: gemm_mx.linear_mx(x, w, ws, 32, path="dequant"))
    assert torch.equal(replay, eager)
    xm, idx, wt = _moe_batch(192, 6)
    eager, replay = _graphed(lambda: gemm_mx.moe_mx(xm, idx, wt, *moe_weights, 10.0, path="splitk"))
    assert torch.equal(replay, eager)


@pytest.mark.parametrize("real,padded", [(160, 192), (129, 192), (100, 128)])
def test_moe_splitk_rows_do_not_depend_on_padding_rows(real, padded, moe_weights):
    """The MoE stream's slice count depends on the weight shape only (up to ``SPLIT_MAX_ROWS`` pairs)
    and a row tile holds one expert's rows, so the real rows of a padded call equal an unpadded call's."""
    x, idx, wt = _moe_batch(padded, 40 + real)
    full = gemm_mx.moe_mx(x, idx, wt, *moe_weights, 10.0, path="splitk")
    alone = gemm_mx.moe_mx(x[:real], idx[:real], wt[:real], *moe_weights, 10.0, path="splitk")
    assert torch.equal(alone, full[:real])


# ---------------------------------------------------------------------- a V4.1 cut with the Triton ops
@pytest.fixture(scope="module")
def bench41():
    from redknot.config.schema import FeaturesConfig

    features = FeaturesConfig()
    features.dspark.method, features.dspark.draft_sampling = "dspark", "greedy"
    sys.path.insert(0, str(BENCH))   # the cut's builder and its random stored tensors (e2e_v41)
    try:
        import dspark as bench_mod
        bench = bench_mod.Bench41(True, torch.device("cuda"), "triton", 32, 40, features)
    finally:
        sys.path.remove(str(BENCH))
    assert bench.model.ops is not None and bench.model.ops.choice["linear_mx"] == "triton"
    return bench


def test_tier_192_replays_padded_and_full_steps_as_eager(bench41):
    """32 requests: 5 rows each (160 rows, 32 of the tier's rows padding) and 6 each (the tier filled).
    The padded step's replay equals the same padded step run eagerly; the full step's replay also
    equals the engine's eager (span) step; the padding difference is reported in ``check_errors``."""
    from redknot.engine.cuda_graphs import CudaGraphCapture
    from redknot.speculative.varlen import VerifyGraphs

    b = bench41
    g = b.cfg.dspark_block_size
    assert 32 * (g + 1) == 192
    graphs = VerifyGraphs(b.runner(), max_num_seqs=32, block=g, capture=CudaGraphCapture(),
                          tap_layers=b.draft.dcfg.target_layer_ids, max_len=b.max_len)
    graphs.capture([192])
    assert graphs.status.startswith("on:"), graphs.status
    graphs.run(b.inputs(32, 5))
    padded = graphs.check_errors[192]
    assert graphs.checks[192].startswith("ok"), (graphs.checks, padded)
    assert padded["rows"] == 160 and max(padded["capture"].values()) <= 1e-3, padded
    graphs.checks.pop(192)
    graphs.run(b.inputs(32, 6))
    full = graphs.check_errors[192]
    assert graphs.checks[192].startswith("ok"), (graphs.checks, full, padded)
    assert full["rows"] == 192 and max(full["capture"].values()) <= 1e-3, full
    print({"padded": padded, "full": full})
