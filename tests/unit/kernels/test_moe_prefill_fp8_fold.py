"""The folded-scale FP8 MoE prefill plan (``moe_prefill_fold``, ``MoePlan(decode="fp8f")``) with fresh random inputs:
against ``ref_v41.moe_mx``, against the ``fp8ht`` plan (the same products and K order of the scaled group sums),
the fold against its own per-group fallback, weight scales whose spread per column exceeds the fold's exact range
(the fallback must run for those column blocks and stay right) and a negative control (the fold forced where it
is not exact fails). Runs on the GPU when there is one, else under Triton's interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import moe_mx, moe_prefill_fp8
from redknot.kernels.triton import moe_prefill_fold as fold
from redknot.kernels.triton.checks_mx import V41Dims, moe_inputs
from redknot.kernels.triton.splitk_mx import tile_map

# SMALL: W2's K (96) is not a multiple of 128 (the prologue's byte loop); WIDE: every K is (its scale words)
SMALL = V41Dims(hidden=128, experts=6, topk_experts=2, moe_inter=96, tokens=23)
WIDE = V41Dims(hidden=256, experts=6, topk_experts=3, moe_inter=128, tokens=23)
PLAN = moe_mx.MoePlan("fp8", 16, 32, 32, 4, True, "fp8f", 2)
PLAN_WIDE = moe_mx.MoePlan("fp8", 32, 64, 128, 4, True, "fp8f", 3)  # W2: 4 groups per step, scale words


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _routing(tokens: int, experts: int, k: int, device, seed: int):
    """Top-k ids with uneven counts per expert and the last expert never chosen."""
    g = torch.Generator(device=device).manual_seed(seed)
    live = experts - 1
    score = torch.rand(tokens, live, generator=g, device=device) * torch.arange(1, live + 1, device=device) ** 2
    return score.topk(k, -1).indices


def _ht(plan):
    return moe_mx.MoePlan("fp8", plan.block_m, plan.block_n, plan.block_k, plan.num_warps, True, "fp8ht",
                          plan.num_stages)


@pytest.mark.parametrize("plan,dims", [(PLAN, SMALL), pytest.param(PLAN_WIDE, WIDE, marks=pytest.mark.slow)],
                         ids=["small", "wide"])
def test_fold_matches_reference_and_fp8ht(plan, dims, kernel_device):
    tokens = 12  # uneven rows per expert, row tiles across experts, an empty expert
    x, _, wt, w = moe_inputs(dims, kernel_device, seed=40 + dims.hidden, tokens=tokens)
    idx = _routing(tokens, dims.experts, dims.topk_experts, kernel_device, seed=dims.hidden)
    out = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2
    # the same products and K order of the scaled group sums as fp8ht (the group's 32 products in another order)
    assert _rel(out, moe_prefill_fp8.moe_prefill_fp8(x, idx, wt, *w, 10.0, _ht(plan))) <= 5e-3


def _spread_scales(w, e: int, device, seed: int):
    """``w`` with, in expert ``e``, W1 columns 0-7 given one scale byte 12 below their others (past the fold's exact
    range), one W3 column all zero scale bytes (base 0: outside it too) and W2 columns 8-15 a group at 30 below:
    the column blocks holding them take the per-group fallback, the others fold."""
    w1, s1, w3, s3, w2, s2 = [t.clone() for t in w]
    g = torch.Generator(device=device).manual_seed(seed)
    s1[e, :8, 1] = s1[e, :8].min() - 12
    s3[e, 5] = 0
    j = int(torch.randint(0, s2.shape[2], (1,), generator=g, device=device))
    s2[e, 8:16, j] = s2[e, 8:16].min() - 30
    return w1, s1, w3, s3, w2, s2


def _gemms(x, idx, wt, w, plan, fold_mode, w2: bool = True):
    """(W2 input bytes + scales, W2 output (or None without ``w2``), the W1 | W3 flags, the W2 flags, the tile map) of
    the fp8f plan, its launches by hand."""
    E = w[0].shape[0]
    rows, _inv, offs, wsort, xq, xs = moe_prefill_fp8.prefill_inputs(x, idx, wt, E, plan)
    M = idx.numel()
    tiles = tile_map(offs, plan.block_m, M)
    n13 = tiles[3] * -(-w[0].shape[1] // plan.block_n)
    n2 = tiles[3] * -(-w[4].shape[1] // plan.block_n)
    f13 = torch.full((n13,), -1, dtype=torch.int32, device=x.device)
    f2 = torch.full((n2,), -1, dtype=torch.int32, device=x.device)
    aq, sa = fold.prefill_gemm_fold(xq, xs, w[0], w[1], M, plan, offs=offs, rowid=rows, w3=w[2], ws3=w[3], wt=wsort,
                                    limit=10.0, tiles=tiles, fold=fold_mode, flags=f13)
    y = fold.prefill_gemm_fold(aq, sa, w[4], w[5], M, plan, offs=offs, tiles=tiles, fold=fold_mode, flags=f2) \
        if w2 else None
    return aq, sa, y, f13, f2, tiles


def test_fold_equals_its_fallback_and_takes_it_out_of_range(kernel_device, monkeypatch):
    """Weight scales past the fold's exact range in some column blocks (``_spread_scales``): the flags send those
    blocks to the per-group fallback, the others fold; the whole result equals the per-group scaling everywhere
    bit for bit (in range the fold is that scaling times powers of two) and the reference within tolerance."""
    monkeypatch.setattr(moe_mx, "ROUTE_KERNEL_MAX_PAIRS", 0)  # the sort and act_quant_mx (every real prefill)
    tokens = 12
    x, _, wt, w = moe_inputs(WIDE, kernel_device, seed=77, tokens=tokens)
    idx = _routing(tokens, WIDE.experts, WIDE.topk_experts, kernel_device, seed=9)
    e = int(torch.bincount(idx.flatten(), minlength=WIDE.experts).argmax())  # an expert with rows
    nb13 = -(-w[0].shape[1] // PLAN_WIDE.block_n)
    nb2 = -(-w[4].shape[1] // PLAN_WIDE.block_n)
    spread = _spread_scales(w, e, kernel_device, seed=3)
    aq, sa, y, f13, f2, tiles = _gemms(x, idx, wt, spread, PLAN_WIDE, True)
    bq, sb, z, _, _, _ = _gemms(x, idx, wt, spread, PLAN_WIDE, False)
    assert torch.equal(aq.view(torch.uint8), bq.view(torch.uint8)) and torch.equal(sa, sb)
    assert torch.equal(y, z)
    tg = tiles[0]
    assert bool((f13[tg.repeat_interleave(nb13) < 0] == -1).all())  # programs past the last tile write no flag
    # expert e's W1 | W3 column block 0 (columns 0-7 and 5) and its W2 block holding columns 8-15 fell back
    mine = (tg == e).nonzero().flatten().tolist()
    assert mine
    for t in mine:
        assert int(f13[t * nb13]) == 0 and int(f2[t * nb2 + 8 // PLAN_WIDE.block_n]) == 0
        assert int(f13[t * nb13 + 1]) == 1  # the expert's other column blocks still fold
    others = ((tg >= 0) & (tg != e)).nonzero().flatten().tolist()
    assert others and all(int(f13[t * nb13 + j]) == 1 for t in others for j in range(nb13))
    assert all(int(f2[t * nb2 + j]) == 1 for t in others for j in range(nb2))
    rows = moe_prefill_fp8.prefill_inputs(x, idx, wt, WIDE.experts, PLAN_WIDE)[1]  # sorted position per pair
    from redknot.kernels.triton.splitk_mx import reduce_combine
    got = reduce_combine(y[None], rows, WIDE.topk_experts, torch.empty_like(x))
    assert _rel(got, ref_v41.moe_mx(x, idx, wt, *spread, 10.0)) <= 3e-2


def test_fold_forced_out_of_range_fails(kernel_device, monkeypatch):
    """Negative control: the fold forced onto column blocks whose scale bytes span past its exact range (groups
    30 binades below the column's base: their table bytes wrap) differs from the reference far beyond the
    tolerance, while the default launch (the flags' fallback) stays within it."""
    monkeypatch.setattr(moe_mx, "ROUTE_KERNEL_MAX_PAIRS", 0)
    tokens = 12
    x, _, wt, w = moe_inputs(WIDE, kernel_device, seed=5, tokens=tokens)
    idx = _routing(tokens, WIDE.experts, WIDE.topk_experts, kernel_device, seed=4)
    w1, s1, w3, s3, w2, s2 = [t.clone() for t in w]
    s1[:, :, ::2] -= 30  # every other group of every W1 column: 2^-30 of its neighbours
    bad = (w1, s1, w3, s3, w2, s2)
    aq, sa, _, _, _, tiles = _gemms(x, idx, wt, bad, PLAN_WIDE, "force", w2=False)
    bq, sb, _, g13, _, _ = _gemms(x, idx, wt, bad, PLAN_WIDE, True, w2=False)
    live = tiles[0].repeat_interleave(-(-w1.shape[1] // PLAN_WIDE.block_n)) >= 0
    assert bool((g13[live] == 0).all())  # the default launch: every block out of range, the fallback ran
    M = aq.shape[0]
    got = (aq.float().view(M, -1, 32) * sa[:, :M].t()[:, :, None]).flatten(1)
    ok = (bq.float().view(M, -1, 32) * sb[:, :M].t()[:, :, None]).flatten(1)
    err = _rel(got, ok)
    assert not err <= 0.3, err  # (wrapped table bytes may decode to NaN: NaN passes as "differs")
    # the fallback's W2 input is the per-group scaling's (fold off), bit for bit
    cq, sc, _, _, _, _ = _gemms(x, idx, wt, bad, PLAN_WIDE, False, w2=False)
    assert torch.equal(bq.view(torch.uint8), cq.view(torch.uint8)) and torch.equal(sb, sc)


def test_fold_detects_a_wrong_weight(kernel_device):
    """The tolerance separates right from wrong: W1 with swapped nibbles (element order) fails it."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(SMALL, kernel_device, seed=12, tokens=9)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    swapped = ((w1 >> 4) | (w1 << 4)).to(torch.uint8)
    assert _rel(moe_mx.moe_prefill(x, idx, wt, swapped, s1, w3, s3, w2, s2, 10.0, plan=PLAN), want) > 0.1


def test_quads_order_matches_the_decode():
    """``quads_order`` (the rows' order) and the kernel's ``quads`` (the W2 input's) are one permutation: position
    4i + j of a group holds K element 8i + j, position 16 + 4i + j element 8i + 4 + j."""
    q = torch.arange(64, dtype=torch.float32).view(1, 64).to(torch.float8_e4m3fn)
    got = fold.quads_order(q).float().flatten().tolist()
    want = [float(torch.tensor(float(32 * g + 8 * i + 4 * h + j)).to(torch.float8_e4m3fn))
            for g in range(2) for h in range(2) for i in range(4) for j in range(4)]
    assert got == want


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 40])
def test_fold_token_counts(tokens, kernel_device):
    """One token (most experts empty) and 40 (row tiles across experts) at both tile shapes."""
    for plan, dims in ((PLAN, SMALL), (PLAN_WIDE, WIDE)):
        x, _, wt, w = moe_inputs(dims, kernel_device, seed=tokens, tokens=tokens)
        idx = _routing(tokens, dims.experts, dims.topk_experts, kernel_device, seed=tokens + 1)
        out = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
        assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2
