"""``linear_mx``'s prefill choice (``linear_prefill_mx``): the rowwise operands against their PyTorch math bit for
bit (fresh random inputs with a wide per-group range, so some shifted values round; zero rows; V4.1's 32 blocks
and V4's 128), the rowwise FP8 GEMM against the reference ``linear_mx`` within the GEMM tolerance, the first-use
gate refusing a wrong candidate, and the registry op taking the prefill path above the split-K rows. Triton's
CPU interpreter here (``torch._scaled_mm`` runs on the CPU too), the GPU with ``-m gpu``."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import linear_prefill_mx as lp


def _act_ref(x: torch.Tensor):
    q, sb = mx.quant_fp8_groups(x.float())
    e = sb.to(torch.int32) - 127                                        # [M, K/32]
    big = e.amax(-1)
    shift = (e - big[:, None]).clamp(min=lp.MIN_SHIFT).float()
    v = q.float().unflatten(-1, (-1, 32)) * torch.exp2(shift)[..., None]
    return mx.fp8_encode(v.flatten(-2)), torch.exp2(big.float())


def _weight_ref(w: torch.Tensor, ws: torch.Tensor, block: int):
    n, k = w.shape
    s = ws.view(torch.uint8).to(torch.int32)
    big = s.amax(1)                                                     # [N/b]
    shift = (s - big[:, None]).clamp(min=lp.MIN_SHIFT).repeat_interleave(block, 0).repeat_interleave(block, 1)
    v = w.float() * torch.exp2(shift[:n, :k].float())
    return mx.fp8_encode(v), mx.e8m0_decode(big.to(torch.uint8)).repeat_interleave(block)[:n]


def _wide_rows(m: int, k: int, g: torch.Generator, device) -> torch.Tensor:
    """bf16 rows whose 32-column groups span 2^-12 .. 2^4 (a shift of up to 16 steps), one row all zero."""
    groups = torch.exp2(torch.randint(-12, 5, (m, k // 32), generator=g).float()).repeat_interleave(32, 1)
    x = torch.randn(m, k, generator=g) * groups
    x[1] = 0
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("m,k", [(5, 64), (33, 320), (17, 512)])
def test_act_rowwise_is_its_pytorch_math(m, k, one_pass, kernel_device, monkeypatch):
    if not one_pass:                                   # rows longer than the one-pass limit: two passes over K
        monkeypatch.setattr(lp, "ONE_PASS_K", 32)
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = _wide_rows(m, k, g, kernel_device)
    q, s = lp.act_rowwise(x)
    rq, rs = _act_ref(x.cpu())
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)
    exact = mx.dequant_fp8_groups(*mx.quant_fp8_groups(x.cpu().float()))     # the reference's QDQ values
    got = q.cpu().float() * s.cpu()[:, None]
    assert not torch.equal(got, exact)                # some small values moved (the wide groups) ...
    top = exact.abs().amax(1, keepdim=True)
    # ... each by at most 2^-10 of the row scale, the row's largest being above 224 of it
    assert ((got - exact).abs() <= top * 2.0 ** -10 / 224).all()


@pytest.mark.parametrize("n,k,block", [(64, 96, 32), (40, 300, 32), (256, 384, 128)])
def test_weight_rowwise_is_its_pytorch_math(n, k, block, kernel_device):
    g = torch.Generator().manual_seed(n + k + block)
    tiles = torch.exp2(torch.randint(-14, -2, (-(-n // block), -(-k // block)), generator=g).float())
    scale = tiles.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g) * scale, block)
    q, s = lp.weight_rowwise(w.to(kernel_device), ws.to(kernel_device), block)
    rq, rs = _weight_ref(w, ws, block)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


@pytest.mark.parametrize("m,n,k,block", [(40, 96, 256, 32), (150, 64, 512, 32), (24, 128, 256, 128)])
def test_fp8_rowwise_gemm_within_the_gemm_tolerance(m, n, k, block, kernel_device):
    g = torch.Generator().manual_seed(m + n + k)
    w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g) * 0.02, block)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)).to(torch.bfloat16)
    want = ref_v41.linear_mx(x, w, ws, block)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=kernel_device)
    got = lp.linear_prefill(x.to(kernel_device), w.to(kernel_device), ws.to(kernel_device), block, out,
                            "fp8_rowwise").cpu()
    deq = lp.linear_prefill(x.to(kernel_device), w.to(kernel_device), ws.to(kernel_device), block,
                            torch.empty_like(out), "dequant").cpu()
    assert lp._rel(got, want) <= 4e-3, lp._rel(got, want)     # bf16 output roundings (2^-9) and fp32 order
    assert lp._rel(deq, want) <= 4e-3
    wrong = lp.linear_prefill(x.to(kernel_device), w.to(kernel_device), torch.full_like(ws, 127).to(kernel_device),
                              block, torch.empty_like(out), "fp8_rowwise").cpu()
    assert lp._rel(wrong, want) > 1e-1                 # the check can fail: unit scales instead of the tiles'


def test_first_use_gate_refuses_a_wrong_candidate(kernel_device, monkeypatch):
    g = torch.Generator().manual_seed(3)
    w, ws = mx.quant_fp8_blocks(torch.randn(64, 128, generator=g) * 0.02, 32)
    x = torch.randn(200, 128, generator=g).to(torch.bfloat16).to(kernel_device)
    w, ws = w.to(kernel_device), ws.to(kernel_device)
    out = torch.empty(200, 64, dtype=torch.bfloat16, device=kernel_device)
    picked = {}

    def pick(key, run, device):                # the tuner's first use: every candidate runs
        picked["key"] = key
        for c in lp.PREFILL_TUNER.candidates:
            try:
                run(c)
            except RuntimeError as exc:
                picked[c] = str(exc)
        return "dequant"
    monkeypatch.setattr(lp.PREFILL_TUNER, "pick", pick)
    monkeypatch.setattr(lp, "_GATED", {})
    lp.linear_prefill(x, w, ws, 32, out)
    assert "fp8_rowwise" not in picked and lp._GATED[picked["key"]] <= lp.GATE_TOL
    assert picked["key"] == ((64, 128), 32, 256)

    real = lp.linear_fp8_rowwise
    monkeypatch.setattr(lp, "_GATED", {})
    monkeypatch.setattr(lp, "linear_fp8_rowwise", lambda *a: real(*a).mul(1.1))   # 10 % off
    picked.clear()
    lp.linear_prefill(x, w, ws, 32, out)
    assert "relative error" in picked["fp8_rowwise"]
    picked.clear()                                     # later uses of the class: refused without a new check
    lp.linear_prefill(x, w, ws, 32, out)
    assert "relative error" in picked["fp8_rowwise"]


def test_registry_op_takes_the_prefill_path_above_the_splitk_rows(kernel_device, monkeypatch):
    from redknot.kernels.triton import gemm_mx, ops_mx

    calls = []
    real = lp.linear_prefill
    monkeypatch.setattr(lp, "linear_prefill", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    g = torch.Generator().manual_seed(5)
    w, ws = mx.quant_fp8_blocks(torch.randn(32, 64, generator=g) * 0.02, 32)
    w, ws = w.to(kernel_device), ws.to(kernel_device)
    rows = gemm_mx.SPLITK_MAX_ROWS + 1
    x = torch.randn(1, rows, 64, generator=g).to(torch.bfloat16).to(kernel_device)
    y = ops_mx.linear_mx(x, w, ws)
    assert calls == [(rows, 64)] and y.shape == (1, rows, 32)
    assert lp._rel(y.cpu(), ref_v41.linear_mx(x.cpu(), w.cpu(), ws.cpu())) <= 4e-3


def test_benchmark_smoke_runs(tmp_path):
    """``benchmarks/linear_prefill_v41.py --smoke``: every candidate and part runs on toy shapes (no timing)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "linear_prefill_v41.py"
    spec = importlib.util.spec_from_file_location("linear_prefill_v41_smoke", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--smoke", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "linear_prefill_v41.md").read_text()
    assert "failed" not in text and text.count("fp8_rowwise |") == len(mod.SMOKE)


@pytest.mark.parametrize("choice", ["einsum", "bmm_out", "mm_cols"])
def test_grouped_wo_a_layouts_are_the_grouped_gemm(choice, kernel_device):
    """Each ``GROUPED_TUNER`` layout against the fp32 per-group product (bf16 output rounding apart)."""
    g = torch.Generator().manual_seed(11)
    o = torch.randn(150, 4, 96, generator=g).to(torch.bfloat16)
    w = (torch.randn(4, 48, 96, generator=g) / 10).to(torch.bfloat16)
    want = torch.einsum("ngk,grk->ngr", o.float(), w.float()).reshape(150, -1)
    got = lp.grouped_wo_a(o.to(kernel_device), w.to(kernel_device), choice).cpu()
    assert got.shape == (150, 4 * 48) and got.is_contiguous()
    assert lp._rel(got, want) <= 4e-3
    assert lp._rel(got[:, 48:96], want[:, :48]) > 0.5          # the groups land in their own columns
    with pytest.raises(ValueError, match="not one of"):
        lp.grouped_wo_a(o, w, "nope")


@pytest.mark.gpu
def test_gpu_prefill_candidates_real_sizes():
    """V4.1 cut shapes on the GPU: the rowwise operands' bits, both candidates against the reference, the registry
    op through the tuner (its first use times both and gates fp8_rowwise), the grouped wo_a layouts."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, rows = "cuda", 2048
    g = torch.Generator(device=dev).manual_seed(0)
    from redknot.kernels.triton import ops_mx

    for n, k in ((5120, 8192), (32768, 1280), (512, 5120)):
        w, ws = mx.quant_fp8_blocks(torch.randn(n, k, generator=g, device=dev) * k ** -0.5, 32)
        x = torch.randn(rows, k, generator=g, device=dev).to(torch.bfloat16)
        want = ref_v41.linear_mx(x, w, ws, 32)
        for c in lp.PREFILL_TUNER.candidates:
            got = lp.linear_prefill(x, w, ws, 32, torch.empty(rows, n, dtype=torch.bfloat16, device=dev), c)
            assert lp._rel(got, want) <= 4e-3, (n, k, c, lp._rel(got, want))
        q, s = lp.act_rowwise(x[:256])
        rq, rs = _act_ref(x[:256].cpu())
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
        q, s = lp.weight_rowwise(w, ws, 32)
        rq, rs = _weight_ref(w.cpu(), ws.cpu(), 32)
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.cpu(), rs)
        assert lp._rel(ops_mx.linear_mx(x, w, ws), want) <= 1e-2
        assert lp.PREFILL_TUNER.choices.get(((n, k), 32, rows), "dequant") in lp.PREFILL_TUNER.candidates
    o = torch.randn(rows, 8, 4096, generator=g, device=dev).to(torch.bfloat16)
    wo = (torch.randn(8, 1024, 4096, generator=g, device=dev) / 64).to(torch.bfloat16)
    want = torch.einsum("ngk,grk->ngr", o.float(), wo.float()).reshape(rows, -1)
    for c in lp.GROUPED_TUNER.candidates:
        assert lp._rel(lp.grouped_wo_a(o, wo, c), want) <= 4e-3, c
    assert lp._rel(lp.grouped_wo_a(o, wo), want) <= 4e-3
