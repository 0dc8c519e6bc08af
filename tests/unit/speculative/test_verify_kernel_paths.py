"""The kernel paths a verify tier above 128 rows takes, at toy sizes with the row thresholds lowered
(GPU when there is one, else Triton's interpreter): ``linear_mx`` past ``SPLITK_MAX_ROWS`` (the
``dequant`` path) and the MoE split-K stream past the in-kernel quantisation limit (``qdq_bf16(x,
split=True)`` + ``tile_map``) against ``ref_v41`` with fresh random inputs, and the MoE stream's real
rows unchanged by padding rows sharing the call (what a padded graph tier relies on)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import gemm_mx, moe_mx, splitk_mx  # noqa: E402
from redknot.kernels.triton.checks_mx import V41Dims, moe_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIMS = V41Dims(hidden=96, experts=7, topk_experts=3, moe_inter=96, tokens=9)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.fixture
def low_thresholds(monkeypatch):
    """Rows past 4 leave the in-kernel quantisation and the dense split-K stream."""
    monkeypatch.setattr(moe_mx, "RAW_MAX_ROWS", 4)
    monkeypatch.setattr(splitk_mx, "RAW_MAX_ROWS", 4)
    if hasattr(splitk_mx, "SCALED_RAW_MAX_ROWS"):
        monkeypatch.setattr(splitk_mx, "SCALED_RAW_MAX_ROWS", min(4, splitk_mx.SCALED_RAW_MAX_ROWS))
    monkeypatch.setattr(gemm_mx, "SPLITK_MAX_ROWS", 4)


def test_moe_stream_past_the_raw_rows_matches_reference_and_ignores_padding(low_thresholds):
    x, idx, wt, w = moe_inputs(DIMS, DEVICE, seed=21, tokens=12)
    out = gemm_mx.moe_mx(x, idx, wt, *w, 10.0, path="splitk")             # 12 tokens > 4: separate QDQ pass
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2
    real = gemm_mx.moe_mx(x[:9], idx[:9], wt[:9], *w, 10.0, path="splitk")  # 9 real rows, 3 padding
    assert torch.equal(real, out[:9])
    swapped = ((w[4] >> 4) | (w[4] << 4)).to(torch.uint8)                    # a wrong W2 must fail the check
    bad = gemm_mx.moe_mx(x, idx, wt, w[0], w[1], w[2], w[3], swapped, w[5], 10.0, path="splitk")
    assert _rel(bad, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) > 0.1


def test_linear_past_the_split_k_rows_matches_reference(low_thresholds):
    assert gemm_mx.linear_path(9) == "dequant"
    g = torch.Generator(device=DEVICE).manual_seed(3)
    w, ws = mx.quant_fp8_blocks(torch.randn(80, 128, generator=g, device=DEVICE) * 0.05, 32)
    x = torch.randn(12, 128, generator=g, device=DEVICE).to(torch.bfloat16)
    out = gemm_mx.linear_mx(x, w, ws, 32)
    assert _rel(out, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2
