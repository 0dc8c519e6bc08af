"""The library-GEMM MoE prefill plan (``moe_prefill_scaled``, ``MoePlan("scaled", ...)``) with fresh random inputs:
the e4m3 expansion against its PyTorch reference bit for bit (scale spreads beyond the exact range, bases below
``MIN_BASE``, experts without rows skipped), the expansion's exactness where the spread allows it, the row
quantisations against theirs, the rowwise-scaled grouped GEMM (the PyTorch reference off CUDA, the library call on
CUDA), the whole plan against ``ref_v41.moe_mx`` and the ``grouped`` plan, and negative controls (a GEMM that drops
the column scales fails the first-use check; a fold off by one exponent fails the exactness test). Runs on the GPU
when there is one, else under Triton's interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import moe_mx
from redknot.kernels.triton import moe_prefill_scaled as sc
from redknot.kernels.triton.checks_mx import V41Dims, moe_inputs

SMALL = V41Dims(hidden=128, experts=6, topk_experts=2, moe_inter=96, tokens=23)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _weights(E, N, K, device, seed):
    """Random MXFP4 bytes with per-column scale spreads: columns 0-3 within the exact range, 4-7 with one group 15-40
    below the column's largest, 8-9 with bases below ``MIN_BASE``, the rest scale bytes 100..130 at random (spreads
    up to 30: many inexact columns)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(0, 256, (E, N, K // 2), generator=g, device=device, dtype=torch.uint8)
    s = torch.randint(100, 131, (E, N, K // 32), generator=g, device=device, dtype=torch.uint8)
    s[:, :4] = torch.randint(110, 125, (E, 4, K // 32), generator=g, device=device, dtype=torch.uint8)
    s[:, :4, 0] = 124
    s[:, :4, 1] = 110  # spread exactly 14
    s[:, 4:8] = 120
    s[:, 4:8, 2] = torch.randint(80, 106, (E, 4), generator=g, device=device, dtype=torch.uint8)
    s[:, 8:10] = torch.randint(0, 5, (E, 2, K // 32), generator=g, device=device, dtype=torch.uint8)
    return w, s


@pytest.mark.parametrize("N,K,launch", [(48, 192, {}), (40, 256, {}),
                                         (40, 256, {"block_n": 64, "block_k": 256, "num_warps": 8}),
                                         (48, 1024, {"block_n": 16, "block_k": 512, "num_warps": 4})])
def test_expand_matches_reference_bit_for_bit(N, K, launch, kernel_device):
    E = 3
    w, s = _weights(E, N, K, kernel_device, seed=N + K)
    q = torch.full((E, N + 8, K), 0.0, dtype=torch.float8_e4m3fn, device=kernel_device)
    cs = torch.zeros(E, N + 8, dtype=torch.float32, device=kernel_device)
    bad = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sc.expand_e4m3(w, s, 0, E, q, cs, col0=8, bad=bad, **launch)  # at a column offset (the W3 half of W1 | W3)
    want_q, want_cs, want_bad = sc.expand_e4m3_ref(w, s)
    assert torch.equal(q[:, 8:].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(cs[:, 8:], want_cs)
    assert int(bad) == want_bad and want_bad >= 4 * E  # columns 4-7 at least
    assert bool((q[:, :8].view(torch.uint8) == 0).all()) and bool((cs[:, :8] == 0).all())  # nothing outside


def test_expand_exact_within_span_and_skips_empty_experts(kernel_device):
    E, N, K = 4, 40, 192
    w, s = _weights(E, N, K, kernel_device, seed=7)
    sentinel = torch.tensor(0x11, dtype=torch.uint8)
    q = torch.full((E - 1, N, K), 0, dtype=torch.uint8, device=kernel_device).fill_(sentinel).view(torch.float8_e4m3fn)
    cs = torch.full((E - 1, N), -1.0, device=kernel_device)
    ends = torch.tensor([3, 3, 3, 8], dtype=torch.int32, device=kernel_device)  # expert 1 and 2 without rows
    bad = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    sc.expand_e4m3(w, s, 1, E, q, cs, ends=ends, bad=bad)  # experts 1..3 into slots 0..2
    assert bool((q[:2].view(torch.uint8) == 0x11).all()) and bool((cs[:2] == -1).all())
    want_q, _want_cs, _ = sc.expand_e4m3_ref(w[3:], s[3:])
    assert torch.equal(q[2].view(torch.uint8), want_q[0].view(torch.uint8))
    # within the exact span the expansion times the column scale is the stored weight exactly; beyond it, not
    dq = q[2].float() * cs[2][:, None]
    stored = mx.dequant_mxfp4(w[3], s[3])
    span = s[3].int().amax(-1).clamp_min(sc.MIN_BASE) - s[3].int().amin(-1)
    exact = span <= sc.EXACT_SPAN
    assert bool(exact[:4].all()) and not bool(exact[4:8].any())
    assert torch.equal(dq[exact], stored[exact])
    assert int(bad) == int((~exact).sum())


def test_exact_span_negative_control(kernel_device):
    """The exactness check above can fail: a fold one exponent too low (d = s - base + 5) loses the smallest values
    of a column whose spread is exactly 14."""
    E, N, K = 1, 16, 128
    w, s = _weights(E, N, K, kernel_device, seed=3)
    base = s.int().amax(-1).clamp_min(sc.MIN_BASE)
    d = (s.int() - base[..., None] + 5).clamp_min(-20)
    codes = torch.stack([w & 0xF, w >> 4], -1).reshape(E, N, K)
    v = (mx.e2m1_decode(codes).float().view(E, N, -1, 32) * torch.exp2(d.float())[..., None]).reshape(E, N, K)
    dq = v.to(torch.float8_e4m3fn).float() * torch.exp2((base - 132).float())[..., None]
    assert not torch.equal(dq[0, :4], mx.dequant_mxfp4(w[0], s[0])[:4])


def test_row_quantisations_match_reference(kernel_device):
    g = torch.Generator(device=kernel_device).manual_seed(11)
    T, D, inter, M = 9, 160, 96, 14
    x = (torch.randn(T, D, generator=g, device=kernel_device) * torch.exp2(
        torch.randint(-20, 8, (T, 1), generator=g, device=kernel_device).float())).to(torch.bfloat16)
    x[2, 5] = 3e4  # a row whose other elements fall among the e4m3 subnormals of its scale
    x[4] = 0  # the amax floor
    rowid = torch.randint(0, T, (M,), generator=g, device=kernel_device, dtype=torch.int32)
    rowid[3], rowid[4] = 2, 4
    bounds = torch.tensor([0, 3, 3, 10, M], dtype=torch.int32, device=kernel_device)
    q = torch.zeros(M, D, dtype=torch.float8_e4m3fn, device=kernel_device)
    s = torch.zeros(M, device=kernel_device)
    sc.rows_e4m3(x, rowid, bounds, 1, 3, q, s)  # experts 1..2: sorted pairs 3..9 -> chunk rows 0..6
    wq, ws = sc.row_quant_ref(x[rowid[3:10].long()])
    assert torch.equal(q[:7].view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s[:7], ws)
    assert bool((q[7:].view(torch.uint8) == 0).all())
    # elements that are normal e4m3 numbers after the row scale keep the reference's per-32 QDQ value exactly
    ref = mx.act_quant_ref(x[rowid[3:10].long()].float(), "fp8")
    v = q[:7].float() * s[:7, None]
    normal = q[:7].float().abs() >= 2.0 ** -6
    assert torch.equal(v[normal], ref[normal]) and bool((~normal).any())
    # the W2 input: SwiGLU of a [g | u] row, routing weight, bf16, one scale per row
    h = torch.randn(M, 2 * inter, generator=g, device=kernel_device).mul(4).to(torch.bfloat16)
    wt = torch.rand(M, generator=g, device=kernel_device) + 0.1
    aq = torch.zeros(M, inter, dtype=torch.float8_e4m3fn, device=kernel_device)
    asc = torch.zeros(M, device=kernel_device)
    sc.swiglu_e4m3(h, wt, bounds, 0, 4, 10.0, aq, asc)
    gg, uu = h[:, :inter].float().clamp(max=10.0), h[:, inter:].float().clamp(-10.0, 10.0)
    act = (torch.nn.functional.silu(gg) * uu * wt[:, None]).to(torch.bfloat16)
    wq, ws = sc.row_quant_ref(act)
    same = (aq.view(torch.uint8) == wq.view(torch.uint8)).float().mean()
    assert torch.equal(asc, ws) or float((asc != ws).float().mean()) < 0.1  # exp may differ by an ulp, rarely
    assert float(same) > 0.98  # exp in the interpreter / on the GPU vs PyTorch's: a bf16 ulp here and there
    assert _rel(aq.float() * asc[:, None], wq.float() * ws[:, None]) < 1e-2


def test_scaled_grouped_mm(kernel_device):
    """The rowwise-scaled grouped GEMM against fp32 math on dequantised operands (groups of zero rows, rows past the
    last end); on CUDA the library call against the PyTorch reference."""
    g = torch.Generator(device=kernel_device).manual_seed(5)
    G, N, K, M = 4, 48, 64, 40
    a = torch.randn(M, K, generator=g, device=kernel_device).mul(8).to(torch.float8_e4m3fn)
    b = torch.randn(G, N, K, generator=g, device=kernel_device).mul(8).to(torch.float8_e4m3fn)
    sa = torch.exp2(torch.randint(-8, 8, (M,), generator=g, device=kernel_device).float())
    sb = torch.exp2(torch.randint(-8, 8, (G, N), generator=g, device=kernel_device).float())
    offs = torch.tensor([7, 7, 30, 33], dtype=torch.int32, device=kernel_device)
    got = sc.scaled_grouped_mm(a, sa, b, sb, offs)
    ref = sc.scaled_grouped_mm_ref(a, sa, b, sb, offs)
    want = torch.zeros(M, N, device=kernel_device)
    for gi, (lo, hi) in enumerate([(0, 7), (7, 7), (7, 30), (30, 33)]):
        want[lo:hi] = (a[lo:hi].float() * sa[lo:hi, None]) @ (b[gi].float() * sb[gi][:, None]).t()
    assert _rel(ref[:33], want[:33]) < 4e-3 and bool((ref[33:] == 0).all())
    assert _rel(got[:33], ref[:33]) < 4e-3
    # negative control: the column scales of the wrong group are off by O(1)
    assert _rel(sc.scaled_grouped_mm_ref(a, sa, b, sb.flip(0), offs)[:33], want[:33]) > 0.5


@pytest.mark.parametrize("decode", ["e4m3_c2", "e4m3_all"])
def test_plan_matches_reference_and_grouped(decode, kernel_device):
    tokens = 12
    x, _, wt, w = moe_inputs(SMALL, kernel_device, seed=61, tokens=tokens)
    gsel = torch.Generator(device=kernel_device).manual_seed(8)
    live = SMALL.experts - 1  # uneven counts, the last expert never chosen (a chunk with an empty expert)
    score = torch.rand(tokens, live, generator=gsel, device=kernel_device) * torch.arange(1, live + 1,
                                                                                        device=kernel_device) ** 2
    idx = score.topk(SMALL.topk_experts, -1).indices
    plan = moe_mx.MoePlan("scaled", decode=decode)
    out = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2
    assert _rel(out, moe_mx.moe_grouped(x, idx, wt, *w, 10.0)) <= 3e-2
    assert sc.self_check(plan, torch.device(kernel_device)) is None


def test_chunks_do_not_change_the_bits_off_cuda(kernel_device):
    """Off CUDA (the PyTorch GEMM reference, per group) chunking changes nothing but where rows are stored."""
    if kernel_device == "cuda":
        pytest.skip("the library's tile shapes depend on rows per group")
    x, idx, wt, w = moe_inputs(SMALL, kernel_device, seed=62, tokens=10)
    a = sc.moe_prefill_scaled(x, idx, wt, *w, 10.0, moe_mx.MoePlan("scaled", decode="e4m3_c4"))
    b = sc.moe_prefill_scaled(x, idx, wt, *w, 10.0, moe_mx.MoePlan("scaled", decode="e4m3_all"))
    assert torch.equal(a, b)


def test_first_use_check_fails_a_wrong_gemm(monkeypatch, kernel_device):
    """Negative control: a grouped GEMM that drops the column scales is refused by ``self_check``."""
    real = sc.scaled_grouped_mm
    monkeypatch.setattr(sc, "scaled_grouped_mm",
                        lambda a, sa, b, sb, offs, fast=False: real(a, sa, b, torch.ones_like(sb), offs, fast))
    msg = sc.self_check(moe_mx.MoePlan("scaled", decode="e4m3_c64"), torch.device(kernel_device))
    assert msg is not None and "differs from the grouped plan" in msg


def test_plan_names():
    assert sc.chunk_experts(moe_mx.MoePlan("scaled", decode="e4m3_c64"), 384) == 64
    assert sc.chunk_experts(moe_mx.MoePlan("scaled", decode="e4m3_c64"), 6) == 6
    assert sc.chunk_experts(moe_mx.MoePlan("scaled", decode="e4m3_all"), 384) == 384
    assert sc.fast_accum(moe_mx.MoePlan("scaled", decode="e4m3f_c64"))
    with pytest.raises(ValueError):
        sc.chunk_experts(moe_mx.MoePlan("scaled", decode="e4m3_x"), 8)
    scaled = [p for p in moe_mx.PREFILL_TUNER.candidates if p.path == "scaled"]
    assert [p.decode for p in scaled] == ["e4m3_c64", "e4m3_c128"]


@pytest.mark.slow
def test_kernel_bench_scaled_rows_smoke(tmp_path, kernels_v41_main):
    """``kernels_v41.py --only prefill --prefill-decodes scaled`` (CPU interpreter, toy sizes): every library-GEMM plan
    at both token counts checked against the reference, the parts, the grouped pair; no FP8 plan row."""
    assert kernels_v41_main(["--smoke", "--only", "prefill", "--prefill-decodes", "scaled", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "kernels_v41.md").read_text()
    for t in (16, 32):
        rows = [line for line in text.splitlines() if line.startswith(f"| moe_mx prefill | T={t} scaled ")]
        assert len(rows) == 4 and all("err vs ref" in r for r in rows)
        for part in ("scaled rows e4m3", "W1+W3 scaled e4m3_all", "scaled swiglu + rows e4m3", "W2 scaled e4m3_all"):
            assert f"| moe_mx prefill part | T={t} {part} |" in text
    assert "| moe_mx prefill part | scaled expand" in text
    assert "| moe_mx prefill | T=16 |" in text  # the grouped plan (before)
    assert " plan fp8" not in text and "FAIL" not in text
