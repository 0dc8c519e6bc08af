"""The dense split-K streams with their slice sum in the stream launch (``slice_sum``, ``gemm_mx.FUSED_DECODES``):
the bits of the stream + ``reduce_rows`` launches, within tolerance of ``ref_v41.linear_mx`` on fresh random
inputs, batch-invariant, and the first-use check that catches a wrong sum. GPU when there is one, else the
Triton interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import gemm_mx, splitk_mx, stream_guard
from slow_grid import rotated_grid


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _inputs(device, n, k, rows, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=device) * 0.02, 32)
    x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
    return x, w, ws


def _slices(decode, n, k):
    """The K slices the stream cuts for an [n, k] weight with the fused name ``decode``."""
    base, fused, steps = gemm_mx.fused_name(decode)
    assert fused
    scaled = base not in ("registers", "registers_wide", "registers_w64")
    bn = 32 if base == "fp8_n32" else 64
    bk = splitk_mx.block_k_for(k, False, splitk_mx.SCALED_BLOCK_K if scaled else 0)
    return splitk_mx.split_count(n, k, bn, bk, steps or (splitk_mx.SCALED_MIN_STEPS if scaled else 4))


@pytest.mark.parametrize("decode,n,k,rows", rotated_grid([(d,) for d in gemm_mx.FUSED_DECODES],
                                                         [(96, 4096, 5), (160, 2048, 33), (64, 256, 20)]))
def test_fused_slice_sum_is_the_two_launches_bits(decode, n, k, rows, kernel_device):
    """Several K slices (last-program sum) and one slice (direct store): the same bits as the same launch shape's
    partials summed by ``reduce_rows`` (and, with the default slices, as the unfused name), and within the op's
    tolerance of the reference."""
    x, w, ws = _inputs(kernel_device, n, k, rows, seed=n + k + rows)
    got = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=decode)
    base, _, steps = gemm_mx.fused_name(decode)
    out = torch.empty(rows, n, dtype=x.dtype, device=kernel_device)
    want = gemm_mx._dense_stream(x, w, ws.view(torch.uint8), 32, out, decode, unfused=True)   # partials + reduce_rows
    assert torch.equal(got, want)
    if not steps and base in gemm_mx.LINEAR_DECODE_TUNER.candidates:   # default slices: the unfused name's bits
        assert torch.equal(got, gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=base))
    assert _rel(got, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2


def test_the_cases_cover_both_tails():
    """The shapes above run the last-program sum (S > 1) and the direct store (S == 1) for every decode."""
    for decode in gemm_mx.FUSED_DECODES:
        assert _slices(decode, 96, 4096) > 1
        assert _slices(decode, 64, 256) == 1
    assert _slices("registers_wide_f16", 96, 4096) == 2 < _slices("registers_wide_f", 96, 4096)


def test_counters_are_left_zero_for_the_next_launch(kernel_device):
    """Every tile's counter is zero again after a launch, so a second call (a graph replay) sums again."""
    from redknot.kernels.triton import slice_sum
    x, w, ws = _inputs(kernel_device, 128, 2048, 7, seed=3)
    first = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode="registers_f")
    cnt = slice_sum.counters(torch.device(kernel_device), 1)
    assert int(cnt.abs().sum()) == 0
    again = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode="registers_f")
    assert torch.equal(first, again)


@pytest.mark.parametrize("decode", ["registers_wide_f", "fp8_f", "registers_w64_f"])
def test_fused_rows_are_batch_invariant(decode, kernel_device):
    """A row's output does not depend on the other rows of the call (row counts 3 and 70: one row tile or two,
    16 / 128 rows wide; the slice count is a function of the weight shape)."""
    x, w, ws = _inputs(kernel_device, 96, 2048, 70, seed=11)
    many = gemm_mx.linear_mx(x, w, ws, 32, path="splitk", decode=decode)
    few = gemm_mx.linear_mx(x[:3], w, ws, 32, path="splitk", decode=decode)
    assert torch.equal(many[:3], few)


def test_splitk_mm_refuses_out_where_it_does_not_apply(kernel_device):
    x, w, ws = _inputs(kernel_device, 64, 256, 4, seed=5)
    out = torch.empty(4, 64, dtype=torch.bfloat16, device=kernel_device)
    with pytest.raises(ValueError, match="out"):
        splitk_mx.splitk_mm(x, w, ws, 4, w_fp4=False, decode="scaled", out=out)
    with pytest.raises(ValueError, match="out"):
        splitk_mx.splitk_mm(x, w, ws, 4, w_fp4=False, decode="registers", out=out[:, :32])


def test_first_use_check_passes_and_catches_a_wrong_sum(kernel_device, monkeypatch):
    """``stream_guard.self_check`` of a fused name compares against its base decode's two launches: it passes for
    the real kernel and names the difference when the in-launch sum drops a slice."""
    device = torch.device(kernel_device)
    assert stream_guard.self_check("registers_f", device) is None
    real = splitk_mx.splitk_mm

    def drop_last_slice(a, w, ws, rows, **kw):
        if kw.get("out") is None:
            return real(a, w, ws, rows, **kw)
        kw = dict(kw, out=None)
        p = real(a, w, ws, rows, **kw)
        return splitk_mx.reduce_rows(p[:-1] if p.shape[0] > 1 else p * 0.5, torch.empty_like(
            torch.empty(rows, w.shape[0], dtype=torch.bfloat16, device=a.device)))
    monkeypatch.setattr(splitk_mx, "splitk_mm", drop_last_slice)
    assert "differs from its two launches" in stream_guard.self_check("registers_f", device)


def test_every_fused_name_reaches_its_fused_check(kernel_device, monkeypatch):
    """Each ``FUSED_DECODES`` name, the ``*_f16`` ones included, is checked against its own two launches (a name the
    guard did not route would fall through to ``splitk_mm``, which refuses it, and the tuner would never time it);
    one ``*_f16`` name runs the real check."""
    device = torch.device(kernel_device)
    assert stream_guard.self_check("fp8_f16", device) is None
    seen = []
    monkeypatch.setattr(gemm_mx, "fused_check", lambda name, dev, seed=1234: seen.append(name))
    for name in gemm_mx.FUSED_DECODES:
        assert stream_guard.self_check(name, device) is None
    assert seen == list(gemm_mx.FUSED_DECODES)


def test_the_tuner_holds_the_fused_names_after_the_earlier_ones():
    """The earlier candidates keep their order (the first is what runs untimed); the fused ones come after."""
    c = gemm_mx.LINEAR_DECODE_TUNER.candidates
    assert c[:5] == ["fp8", "scaled", "registers", "registers_wide", "fp8_n32"]
    assert c[5:] == list(gemm_mx.FUSED_DECODES)
    assert gemm_mx.fused_name("registers_wide_f16") == ("registers_wide", True, 16)
    assert gemm_mx.fused_name("fp8_n32_f") == ("fp8_n32", True, 0)
    assert gemm_mx.fused_name("fp8_n32") == ("fp8_n32", False, 0)


def test_device_counters_keep_every_set_a_graph_may_replay():
    """A request for more counters than the device's set holds gives a new zeroed set; the outgrown one stays alive
    (a CUDA graph captured with it may replay it), and a smaller request gets the current set back."""
    from redknot.kernels.triton._common import DeviceCounters

    counters = DeviceCounters(4)
    cpu = torch.device("cpu")
    first = counters(cpu, 2)
    assert first.numel() == 4 and first.dtype == torch.int32 and not first.any()
    assert counters(cpu, 4) is first
    bigger = counters(cpu, 9)
    assert bigger.numel() == 9 and not bigger.any()
    assert any(t is first for t in counters.outgrown)
    assert counters(cpu, 3) is bigger
