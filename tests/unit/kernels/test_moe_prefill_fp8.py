"""The FP8 tensor-core MoE prefill plan (``moe_prefill_fp8``, ``MoePlan("fp8", ...)``) against ``ref_v41.moe_mx``
and the FP8 decode stream at small sizes with fresh random inputs: few experts, uneven rows per expert, empty
experts, row tiles that straddle experts. Runs on the GPU when there is one, else under Triton's interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import moe_mx, moe_prefill_fp8
from redknot.kernels.triton.checks_mx import V41Dims, moe_inputs
from redknot.kernels.triton.moe_stream import StreamPlan, moe_stream
from redknot.kernels.triton.quant_mx import act_quant_mx
from slow_grid import rotated_grid

SMALL = V41Dims(hidden=128, experts=6, topk_experts=2, moe_inter=96, tokens=23)
WIDE = V41Dims(hidden=256, experts=6, topk_experts=3, moe_inter=128, tokens=23)  # K % 128 == 0: scale words
# block_m, block_n, block_k (32 x groups per loop step), warps, stages
PLANS = [moe_mx.MoePlan("fp8", 16, 32, 32, 4, True, "fp8", 2), moe_mx.MoePlan("fp8", 32, 64, 64, 4, True, "fp8", 3),
         moe_mx.MoePlan("fp8", 16, 64, 32, 4, True, "fp8_prefetch", 2),
         moe_mx.MoePlan("fp8", 16, 64, 128, 4, True, "fp8", 2),
         moe_mx.MoePlan("fp8", 16, 64, 32, 4, True, "fp8h", 2),
         moe_mx.MoePlan("fp8", 32, 32, 64, 4, True, "fp8h_prefetch", 3),
         moe_mx.MoePlan("fp8", 16, 64, 32, 4, True, "fp8ht", 2),
         moe_mx.MoePlan("fp8", 32, 32, 32, 4, True, "fp8ht_prefetch", 3),
         moe_mx.MoePlan("fp8", 16, 64, 64, 4, True, "bf16", 2)]
# in this order ``rotated_grid`` gives the even rows 23 tokens by default: each decode once (fp8's at WIDE, block_k 128:
# the scale words), the odd rows one token (2-3 rows, most experts empty)
CASES = [(PLANS[3], WIDE), (PLANS[0], SMALL), (PLANS[2], SMALL), (PLANS[1], SMALL), (PLANS[4], SMALL),
         (PLANS[2], WIDE), (PLANS[5], SMALL), (PLANS[4], WIDE), (PLANS[6], SMALL), (PLANS[6], WIDE),
         (PLANS[7], SMALL), (PLANS[8], WIDE), (PLANS[8], SMALL)]
CASE_IDS = ["words", "16x32", "prefetch", "32x64-2groups", "halves", "prefetch-wide", "halves-2groups", "halves-wide",
            "transposed", "transposed-wide", "transposed-prefetch", "bf16-wide", "bf16"]


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _skewed_routing(tokens: int, experts: int, k: int, device, seed: int):
    """Top-k ids with uneven counts per expert and the last two experts never chosen."""
    g = torch.Generator(device=device).manual_seed(seed)
    live = experts - 2
    score = torch.rand(tokens, live, generator=g, device=device) * torch.arange(1, live + 1, device=device) ** 2
    return score.topk(k, -1).indices


@pytest.mark.parametrize("plan,dims,tokens", rotated_grid(CASES, [(23,), (1,)], CASE_IDS, ["23tok", "1tok"]))
def test_fp8_prefill_matches_reference(plan, dims, tokens, kernel_device):
    """Each case at 23 tokens (uneven rows per expert, row tiles across experts, empty experts) and at one token;
    by default each case once (``CASES``' order), the other token count with ``-m slow`` (~1-12 s a case
    interpreted)."""
    x, _, wt, w = moe_inputs(dims, kernel_device, seed=100 + tokens + plan.block_m, tokens=tokens)
    idx = _skewed_routing(tokens, dims.experts, dims.topk_experts, kernel_device, seed=tokens)
    counts = torch.bincount(idx.reshape(-1), minlength=dims.experts)
    assert counts[-2:].sum() == 0  # empty experts
    out = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2
    # the decode stream on FP8 tensor cores computes the same products in the same K order
    stream = moe_stream(x, idx, wt, *w, 10.0, StreamPlan("fp8", 32, 64))
    assert _rel(out, stream) <= 5e-3


def test_fp8_prefill_first_gemm_is_the_decode_streams(kernel_device):
    """The W1 | W3 launch alone: its e4m3 + E8M0 W2 input agrees with the decode stream's EPI 1 (row tiles
    of 32 across experts of 0..40 rows)."""
    from redknot.kernels.triton.moe_stream_fp8 import stream_gemm_fp8
    from redknot.kernels.triton.splitk_mx import tile_map
    x, idx, wt, w = moe_inputs(SMALL, kernel_device, seed=7, tokens=31)
    idx = _skewed_routing(31, SMALL.experts, SMALL.topk_experts, kernel_device, seed=3)
    rows, _inv, offs, wsort = moe_mx._sorted_pairs(idx, wt, SMALL.experts)
    xq, xs = act_quant_mx(x)
    M = idx.numel()
    aq, sa = moe_prefill_fp8.prefill_gemm_fp8(xq, xs, w[0], w[1], M, PLANS[1], offs=offs, rowid=rows, w3=w[2],
                                              ws3=w[3], wt=wsort, limit=10.0)
    sp = StreamPlan("fp8", 32, 64)
    from redknot.kernels.triton.moe_stream import ROW_TILE
    bq, bs = stream_gemm_fp8(xq, xs, w[0], w[1], M, sp, offs=offs, tiles=tile_map(offs, ROW_TILE, M), rowid=rows,
                             w3=w[2], ws3=w[3], wt=wsort, limit=10.0, epi=1)
    got = aq.float().view(M, -1, 32) * torch.exp2(sa.float() - 127)[:, :, None]
    want = bq.float().view(M, -1, 32) * torch.exp2(bs.float() - 127)[:, :, None]
    assert _rel(got, want) <= 5e-3
    assert (sa.int() - bs.int()).abs().max() <= 1


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[4], PLANS[6], PLANS[8]],
                         ids=["natural", "halves", "transposed", "bf16"])
def test_fp8_prefill_detects_a_wrong_weight(plan, kernel_device):
    """The tolerance separates right from wrong: W2 with swapped nibbles (element order) fails it."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(SMALL, kernel_device, seed=2, tokens=9)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    swapped = ((w2 >> 4) | (w2 << 4)).to(torch.uint8)
    out = moe_mx.moe_prefill(x, idx, wt, w1, s1, w3, s3, swapped, s2, 10.0, plan=plan)
    assert _rel(out, want) > 0.1


def test_fp8_prefill_self_check_and_tuner_entry(kernel_device):
    assert moe_prefill_fp8.self_check(PLANS[0], torch.device(kernel_device)) is None
    assert any(p.path == "fp8" for p in moe_mx.PREFILL_TUNER.candidates)
    assert moe_mx.PREFILL_TUNER.candidates[0].path == "grouped"  # untimed (off the GPU) choice unchanged


@pytest.mark.slow
def test_kernel_bench_prefill_rows_smoke(tmp_path, kernels_v41_main):
    """``kernels_v41.py --only prefill`` (CPU interpreter, toy sizes): the grouped pair and one row per FP8
    plan run, each checked against the reference."""
    assert kernels_v41_main(["--smoke", "--only", "prefill", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "kernels_v41.md").read_text()
    fp8 = [p for p in moe_mx.PREFILL_TUNER.candidates if p.path == "fp8"]
    # every ``path == "fp8"`` plan, named by its decode (``fp8`` / ``fp8h`` / ``fp8ht*`` / ``bf16``)
    rows = [line for line in text.splitlines() if line.startswith("| moe_mx prefill | T=16 plan ")]
    assert len(rows) == len(fp8) == len({r.split("|")[2] for r in rows})  # one row per plan, named apart
    assert sorted(r.split("|")[2].split()[2] for r in rows) == sorted(p.decode for p in fp8)
    assert all("err vs ref" in r for r in rows)
    assert "| moe prefill T=16 |" in text  # the grouped / measured-choice pair


def test_fp8_prefill_with_the_sorted_routing(kernel_device, monkeypatch):
    """Above ``ROUTE_KERNEL_MAX_PAIRS`` pairs (every real prefill) the routing is a stable sort and the rows are
    quantised by ``act_quant_mx``: the same result as the routing kernel's."""
    x, _, wt, w = moe_inputs(SMALL, kernel_device, seed=31, tokens=23)
    idx = _skewed_routing(23, SMALL.experts, SMALL.topk_experts, kernel_device, seed=5)
    by_kernel = moe_prefill_fp8.moe_prefill_fp8(x, idx, wt, *w, 10.0, PLANS[2])
    monkeypatch.setattr(moe_mx, "ROUTE_KERNEL_MAX_PAIRS", 0)
    by_sort = moe_prefill_fp8.moe_prefill_fp8(x, idx, wt, *w, 10.0, PLANS[2])
    assert torch.equal(by_sort, by_kernel)
    assert _rel(by_sort, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2
