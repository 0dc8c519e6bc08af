"""The grouped ``wo_a`` GEMV on the stored FP8 weight (``step_wo_a_v41``) against the exact products' sums and the
einsum on the dequantised weight, its row invariance, first-use check and tuner wiring; on the GPU or through the
Triton interpreter at small sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton import step_wo_a_v41 as wa
from slow_grid import rotated_grid


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _inputs(groups, r, k, rows, seed, device, block=32):
    """Fresh random o [rows, g, K] (bf16) and a block-scaled e4m3 weight [g·r, K] with a spread of tile scales."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(groups * r, k, generator=g, device=device) * 0.02
    w = w * torch.exp2(torch.randint(-3, 4, (groups * r // block, k // block), generator=g, device=device)
                       ).repeat_interleave(block, 0).repeat_interleave(block, 1)
    wq, ws = mx.quant_fp8_blocks(w, block)
    o = torch.randn(rows, groups, k, generator=g, device=device).to(torch.bfloat16)
    return o, wq, ws


GEMV_NAMES = [*wa.WO_A_PLANS, *(n for n in wa.WO_A_TUNER.candidates if n != "einsum")]


@pytest.mark.parametrize("name,rows", rotated_grid([(n,) for n in GEMV_NAMES], [(1,), (4,)]))
def test_wo_a_gemv_matches_the_exact_sums(name, rows, kernel_device):
    """bf16 roundings of the exact products' fp64 sums (one bf16 ulp: 2^-8 relative per value), and the einsum on
    the dequantised bf16 weight (what the step ran before) within the same tolerance."""
    o, w, ws = _inputs(4, 64, 512, rows, 7 + rows + len(name), kernel_device)
    got = wa.wo_a_gemv(o, w, ws, 32, name)
    want = wa.wo_a_reference(o, w, ws, 32)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 4 * 64)
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
    einsum = torch.einsum("ngk,grk->ngr", o, mx.dequant_fp8_blocks(w, ws, 32).to(torch.bfloat16).view(4, 64, -1))
    assert _rel(got, einsum.reshape(rows, -1)) <= 4e-3


@pytest.mark.parametrize("name", ["gemv_n16", "gemv_k128_1"])
def test_wo_a_gemv_row_alone_equals_row_among_four(name, kernel_device):
    o, w, ws = _inputs(2, 32, 256, 4, 21, kernel_device)
    full = wa.wo_a_gemv(o, w, ws, 32, name)
    for r in range(4):
        assert torch.equal(wa.wo_a_gemv(o[r:r + 1], w, ws, 32, name), full[r:r + 1])


def test_wo_a_gemv_reads_each_groups_own_columns(kernel_device):
    """Every group multiplies its own K columns of the row: zeroing group 1's activations changes only group 1's
    outputs (a kernel that read group 0's columns for every group would change none or all)."""
    o, w, ws = _inputs(3, 32, 256, 1, 5, kernel_device)
    base = wa.wo_a_gemv(o, w, ws, 32, "gemv")
    o2 = o.clone()
    o2[:, 1] = 0
    got = wa.wo_a_gemv(o2, w, ws, 32, "gemv")
    assert torch.equal(got[:, :32], base[:, :32]) and torch.equal(got[:, 64:], base[:, 64:])
    assert not got[:, 32:64].any()


def test_wo_a_gemv_refuses_shapes_it_does_not_cover(kernel_device):
    o, w, ws = _inputs(2, 32, 256, 1, 3, kernel_device)
    with pytest.raises(ValueError):
        wa.wo_a_gemv(o.float(), w, ws, 32, "gemv")             # fp32 rows
    with pytest.raises(ValueError):
        wa.wo_a_gemv(torch.cat([o] * 5), w, ws, 32, "gemv")   # more than MAX_ROWS rows
    o3, w3, ws3 = _inputs(2, 48, 256, 1, 3, kernel_device, block=16)
    with pytest.raises(ValueError):
        wa.wo_a_gemv(o3, w3, ws3, 16, "gemv")                # r 48 not a multiple of the 32-row block


def test_wo_a_self_check_passes_and_detects_a_wrong_stream(kernel_device, monkeypatch):
    dev = torch.device(kernel_device)
    assert wa.self_check("gemv_n16_1", dev) is None
    real = wa.wo_a_gemv

    def wrong(o, w, ws, block, name):
        out = real(o, w, ws, block, name)
        out[:, ::3] *= 1.05
        return out
    monkeypatch.setattr(wa, "wo_a_gemv", wrong)
    assert "differs from the exact sums" in wa.self_check("gemv_n16_1", dev)


def test_wo_a_rows_runs_the_choice_and_the_einsum_first(kernel_device):
    """``choice`` forces a candidate; without one, off the GPU (and first met under capture) the tuner's first
    candidate, the einsum, runs untimed: the bits of the einsum on the dequantised weight."""
    o, w, ws = _inputs(2, 32, 256, 2, 9, kernel_device)
    bf = mx.dequant_fp8_blocks(w, ws, 32).to(torch.bfloat16).view(2, 32, -1)
    einsum = torch.einsum("ngk,grk->ngr", o, bf).reshape(2, -1)
    assert wa.WO_A_TUNER.candidates[0] == "einsum"
    assert torch.equal(wa.wo_a_rows(o, w, ws, bf, 32, choice="einsum"), einsum)
    assert torch.equal(wa.wo_a_rows(o, w, ws, bf, 32, choice="gemv_k128"), wa.wo_a_gemv(o, w, ws, 32, "gemv_k128"))
    if kernel_device == "cpu":
        assert torch.equal(wa.wo_a_rows(o, w, ws, bf, 32), einsum)


@pytest.mark.parametrize("base", list(wa.WO_A_PLANS))
def test_wo_a_slice_sum_in_the_launch_keeps_the_bits(base, kernel_device):
    """``*_f``: the last program of each column block adds the slices in slice order: the bits of the same slices
    summed by ``reduce_rows`` (a second launch), twice (the counters are zero again after a launch); the forms' K
    slices are a function of the weight shape only, and the test shape has several."""
    o, w, ws = _inputs(2, 64, 2048, 3, 31, kernel_device)
    plan, _ = wa.plan_of(base)
    assert wa.cut(128, 2048, plan, "_f")[0] > 1
    two = wa.wo_a_gemv(o, w, ws, 32, base)
    for _ in range(2):
        assert torch.equal(wa.wo_a_gemv(o, w, ws, 32, base + "_f"), two)
    assert not wa._counters(torch.device(kernel_device), 1).any()
    assert wa.plan_of(base + "_wave_f") == (plan, "_wave_f") and wa.plan_of(base + "_1") == (plan, "_1")


def test_grouped_output_rows_ask_the_tuner_for_few_rows(kernel_device, monkeypatch):
    """``fused_rows.wo_a_rows`` (``attention.grouped_output``'s few-row call): with the Triton ops and the FP8 wo_a
    kept, 1-4 bf16 rows run ``WO_A_TUNER``'s choice on the stored weight (here forced to a GEMV: its bits), more rows
    give None (the caller's einsum)."""
    from redknot.kernels import KernelSet
    from redknot.kernels.triton import _common
    from redknot.models.deepseek_v41 import fused_rows
    from redknot.models.deepseek_v41.kernel_ops import V41Ops
    from redknot.models.deepseek_v41.ref_math import Numerics, Weights

    o, wq, ws = _inputs(2, 32, 256, 2, 41, kernel_device)
    w = Weights({"a.wo_a.weight": wq, "a.wo_a.scale": ws}, torch.bfloat16, keep=True)
    w.ops = V41Ops(KernelSet(default="triton"))
    num = Numerics("reference", torch.bfloat16)
    bf = w.ops.bf16_weight(w, "a.wo_a.weight", torch.bfloat16).view(2, 32, -1)
    assert fused_rows.fused(w, o)

    class Pick(_common.ConfigTuner):
        def pick(self, key, run, device):
            return "gemv_k128_1"
    monkeypatch.setattr(wa, "WO_A_TUNER", Pick("wo_a", wa.WO_A_TUNER.candidates))
    got = fused_rows.wo_a_rows(o, bf, w, "a.wo_a.weight", num)
    assert torch.equal(got, wa.wo_a_gemv(o, wq, ws, 32, "gemv_k128_1"))
    assert fused_rows.wo_a_rows(torch.cat([o] * 3), bf, w, "a.wo_a.weight", num) is None
