"""``wo_a_v41``: V4.1's grouped ``wo_a`` at decode batches as a stream of the stored FP8 bytes (``splitk_mx`` with
``group_n``), against the model's bf16 einsum and exact fp64 sums on fresh random inputs; the tuner's einsum default,
the first-use check, batch invariance. GPU when there is one, else the Triton interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton import splitk_mx, wo_a_v41

STREAMS = wo_a_v41.WO_A_TUNER.candidates[1:]


def _case(device, groups, r, k, rows, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    w, s = mx.quant_fp8_blocks(torch.randn(groups * r, k, generator=g, device=device) * 0.05, 32)
    wb = mx.dequant_fp8_blocks(w, s, 32).to(torch.bfloat16).view(groups, r, k)
    o2 = torch.randn(rows, groups * k, generator=g, device=device).to(torch.bfloat16)
    return o2, w, s, wb


def _exact(o2, wb):
    t, (g, _, k) = o2.shape[0], wb.shape
    return torch.einsum("ngk,grk->ngr", o2.double().view(t, g, k), wb.double()).reshape(t, -1)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", STREAMS)
@pytest.mark.parametrize("groups,r,k,rows", [(3, 64, 256, 20), (2, 128, 4096, 9), (4, 64, 512, 70)])
def test_stream_is_the_grouped_product(name, groups, r, k, rows, kernel_device):
    """Each output column against its own group's K columns: within a bf16 rounding of the exact sums, and of the
    model's einsum."""
    o2, w, s, wb = _case(kernel_device, groups, r, k, rows, seed=groups + k + rows)
    got = wo_a_v41.grouped_stream(o2, w, s, groups, name)
    assert got.shape == (rows, groups * r) and got.dtype == torch.bfloat16
    exact = _exact(o2, wb)
    assert ((got.double() - exact).abs() <= 2 ** -7 * exact.abs() + 1e-6).all()   # one bf16 rounding (2^-8) and sums
    assert _rel(got, wo_a_v41.einsum(o2, wb)) <= 4e-3


def test_stream_sum_in_launch_is_the_partials_bits(kernel_device):
    """The grouped stream with the slice sum in its launch equals the same launch's partials summed by reduce_rows
    (several K slices: 4096 columns a group)."""
    o2, w, s, _ = _case(kernel_device, 2, 128, 4096, 9, seed=3)
    got = wo_a_v41.grouped_stream(o2, w, s, 2, "registers_wide_f")
    p = splitk_mx.splitk_mm(o2, w, s.view(torch.uint8), 9, w_fp4=False, decode="registers",
                            block_m=splitk_mx.dense_row_tile(9), swap=True, group_n=128)
    assert p.shape[0] > 1
    assert torch.equal(got, splitk_mx.reduce_rows(p, torch.empty_like(got)))


@pytest.mark.parametrize("name", ["registers_wide_f", "registers_w64_f16"])
def test_a_row_alone_equals_the_row_among_many(name, kernel_device):
    o2, w, s, _ = _case(kernel_device, 3, 64, 512, 70, seed=5)
    many = wo_a_v41.grouped_stream(o2, w, s, 3, name)
    few = wo_a_v41.grouped_stream(o2[:5].contiguous(), w, s, 3, name)
    assert torch.equal(many[:5], few)


def test_a_shape_the_stream_cannot_run_is_refused(kernel_device):
    o2, w, s, _ = _case(kernel_device, 2, 64, 256, 6, seed=1)
    with pytest.raises(ValueError, match="group_n"):
        splitk_mx.splitk_mm(o2[:, :300], w, s, 6, w_fp4=False, decode="registers", group_n=64)
    with pytest.raises(ValueError, match="stream shape"):
        wo_a_v41.grouped_stream(o2, w, s, 2, "einsum")


def test_self_check_passes_and_catches_a_wrong_group(kernel_device, monkeypatch):
    device = torch.device(kernel_device)
    assert wo_a_v41.self_check("registers_w64_f", device) is None
    real = splitk_mx.splitk_mm

    def first_group_only(a, w, ws, rows, **kw):   # every column tile reads group 0's columns
        kw["group_n"] = w.shape[0]
        return real(a, w, ws, rows, **kw) if a.shape[1] == w.shape[1] else real(
            a[:, :w.shape[1]].contiguous(), w, ws, rows, **kw)
    monkeypatch.setattr(splitk_mx, "splitk_mm", first_group_only)
    assert "differs from the bf16 einsum" in wo_a_v41.self_check("registers_w64_f", device)


def test_wo_a_runs_the_tuners_choice(kernel_device, monkeypatch):
    """Untimed (CPU, capture, tuning off) the einsum, the model's own bits; a stream where the tuner chose one."""
    o2, w, s, wb = _case(kernel_device, 2, 64, 256, 12, seed=8)
    monkeypatch.setattr(wo_a_v41.WO_A_TUNER, "choices", {})
    built = []

    def weight():
        built.append(1)
        return wb
    if kernel_device == "cpu":
        assert torch.equal(wo_a_v41.wo_a(o2, w, s, 2, weight), wo_a_v41.einsum(o2, wb)) and built
    key = (tuple(w.shape), 2, 16)
    monkeypatch.setitem(wo_a_v41.WO_A_TUNER.choices, key, "registers_w64_f")
    monkeypatch.setattr(wo_a_v41, "_CHECKED", {"registers_w64_f"})
    built.clear()
    got = wo_a_v41.wo_a(o2, w, s, 2, weight)
    assert torch.equal(got, wo_a_v41.grouped_stream(o2, w, s, 2, "registers_w64_f")) and not built


def test_grouped_output_asks_for_decode_batches_only(monkeypatch):
    """attention._wo_a_stream: 5-128 bf16 rows with the FP8 weight kept; None elsewhere (the einsum runs)."""
    from redknot.models.deepseek_v41 import attention
    from redknot.models.deepseek_v41 import moe as moe_mod
    w8, s8 = mx.quant_fp8_blocks(torch.randn(128, 256) * 0.05, 32)
    wb = mx.dequant_fp8_blocks(w8, s8, 32).to(torch.bfloat16).view(2, 64, 256)
    monkeypatch.setattr(moe_mod, "_fp8_linear_weights", lambda ops, w, name, num: (w8, s8))
    calls = []
    monkeypatch.setattr(wo_a_v41, "wo_a", lambda o2, w, s, g, fn: calls.append(o2.shape[0]) or "stream")
    for t, want in ((4, None), (5, "stream"), (128, "stream"), (129, None)):
        o = torch.randn(t, 4, 128).to(torch.bfloat16)
        assert attention._wo_a_stream(o, None, "x", None, object(), 2, wb) == want
    assert attention._wo_a_stream(torch.randn(8, 4, 128), None, "x", None, object(), 2, wb) is None   # fp32 rows
    assert calls == [5, 128]
