"""The tensor-only step's graph-safe V4.1 kernels (window/compressed attention over the stored rings and
pages, paged indexer scores and top-k) against their PyTorch references, with fresh random inputs:
Triton's CPU interpreter here, the GPU with ``-m gpu`` (real V4.1 widths)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels.triton.step_attention_mx import step_attention_mx, step_attention_reference  # noqa: E402
from redknot.kernels.triton.step_indexer_mx import (  # noqa: E402
    select_topk, step_index_scores, step_index_scores_reference)


def _requests(rows_per_req, ctx, gen):
    """pos, back, slot [T] of requests with ``rows_per_req`` rows each at context lengths ``ctx``."""
    pos, back, slot = [], [], []
    for b, (n, c) in enumerate(zip(rows_per_req, ctx)):
        pos += list(range(c, c + n))
        back += list(range(n))
        slot += [b] * n
    return torch.tensor(pos), torch.tensor(back), torch.tensor(slot)


def _attention_case(device, seed, heads, d, window, ring_size, rows_per_req, ctx, n_comp, k):
    g = torch.Generator().manual_seed(seed)
    s = len(rows_per_req) + 1
    pos, back, slot = _requests(rows_per_req, ctx, g)
    t = pos.shape[0]
    ring = mx.pack_window_rows(torch.randn(s * ring_size, d, generator=g))
    new = mx.pack_window_rows(torch.randn(t, d, generator=g))
    comp = mx.pack_compressed_entries(torch.randn(n_comp, d, generator=g))
    cidx = torch.randint(0, n_comp, (t, k), generator=g)
    cidx = torch.where(torch.rand(t, k, generator=g) < 0.3, torch.full_like(cidx, -1), cidx)
    cidx[0] = -1                                     # a row with no compressed entry
    q = (torch.randn(t, heads, d, generator=g) * 0.2).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=g)
    args = [x.to(device) for x in (q, ring)] + [ring_size, new.to(device)] + \
        [x.to(device) for x in (slot, pos, back)] + [window, sinks.to(device), d ** -0.5, comp.to(device),
                                                    cidx.to(device)]
    return args


ATTN_CASES = [
    # heads, d, window, ring, rows per request, context lengths, compressed entries, k
    (4, 64, 16, 16, [1, 1, 1], [40, 3, 0], 50, 8),           # decode: a full window, a filling one, position 0
    (3, 64, 16, 19, [4, 1, 3], [30, 2, 17], 33, 12),         # verify rows, a ring wider than the window
    (2, 128, 40, 40, [2], [100], 64, 40),                     # rows split over programs
]


@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
@pytest.mark.parametrize("seed", [1, 2])
def test_step_attention_matches_reference(case, seed, kernel_device):
    args = _attention_case(kernel_device, seed, *ATTN_CASES[case])
    want = step_attention_reference(*args).float()
    for splits in (1, 3):
        got = step_attention_mx(*args, splits=splits).float()
        err = (got - want).abs().max().item() / want.abs().max().item()
        assert err < 1.5e-2, (splits, err)    # bf16 probabilities for PV and a bf16 output
    # without compressed entries, and a window offset read from the ring differs from the step's row
    got = step_attention_mx(*args[:-2], splits=1).float()
    want = step_attention_reference(*args[:-2]).float()
    assert (got - want).abs().max().item() / want.abs().max().item() < 1.5e-2


def test_step_attention_reads_step_rows_for_its_own_request(kernel_device):
    """A verify row must see the step's earlier rows of its request, not the ring's stale row there."""
    args = _attention_case(kernel_device, 3, *ATTN_CASES[1])
    base = step_attention_mx(*args, splits=1).float()
    new = args[3].clone()
    new[1] = mx.pack_window_rows(torch.randn(1, 64, device=kernel_device) * 4)[0]  # row 1 of request 0
    args2 = list(args)
    args2[3] = new
    got = step_attention_mx(*args2, splits=1).float()
    changed = (got - base).abs().amax((1, 2)) > 0
    assert changed[1:4].all() and not changed[0] and not changed[4:].any()


@pytest.mark.parametrize("case", [0, 1])     # decode rows; verify rows with the ring's spare rows = rows - 1
@pytest.mark.parametrize("splits", [1, 3])
def test_step_attention_ring_write_in_the_launch(case, splits, kernel_device):
    """``ring_dest``: the launch also stores the step's rows in the ring: the output of the launch without it,
    bit for bit, and the ring of a separate ``index_copy_`` after it (every byte, scales included)."""
    heads, d, window, ring_size, rows_per_req = ATTN_CASES[case][:5]
    assert max(rows_per_req) <= ring_size - window + 1     # the precondition ring_dest states
    args = _attention_case(kernel_device, 5 + case, *ATTN_CASES[case])
    ring, new, slot, pos = args[1], args[3], args[4], args[5]
    dest = slot * ring_size + pos % ring_size
    want = step_attention_mx(*args, splits=splits)
    want_ring = ring.clone().index_copy_(0, dest, new)
    args[1] = ring.clone()
    got = step_attention_mx(*args, splits=splits, ring_dest=dest)
    assert torch.equal(got, want)
    assert torch.equal(args[1], want_ring) and not torch.equal(args[1], ring)


@pytest.mark.parametrize("case", [0, 2])
@pytest.mark.parametrize("splits", [1, 3])
def test_step_attention_inverse_rope_in_the_launch(case, splits, kernel_device):
    """``rope``: the output with its inverse RoPE, bit for bit ``rope_rows(..., inverse=True)`` of the output
    without it (in the split merge's launch, or after a one-split launch); a bad table is refused by name."""
    from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table
    from redknot.models.deepseek_v41.ref_math import rope_inv_freq

    args = _attention_case(kernel_device, 9 + case, *ATTN_CASES[case])
    d = args[0].shape[-1]
    cos, sin = rope_table(args[5], rope_inv_freq(16, 160000.0, (16.0, 65536, 32.0, 1.0)).to(kernel_device))
    plain = step_attention_mx(*args, splits=splits)
    got = step_attention_mx(*args, splits=splits, rope=(cos, sin))
    want = rope_rows(plain, cos, sin, inverse=True)
    assert torch.equal(got, want) and not torch.equal(got, plain)
    assert torch.equal(got[..., :d - 16], plain[..., :d - 16])        # only the last 16 dims rotate
    if splits > 1:
        with pytest.raises(ValueError, match="rope tables"):
            step_attention_mx(*args, splits=splits, rope=(cos[:1], sin[:1]))


def _index_case(device, seed, hi, di, ratio, bs, width, vis, n_pages_extra=3):
    g = torch.Generator().manual_seed(seed)
    t = len(vis)
    per = bs // ratio
    n_pages = t * width + n_pages_extra
    keys = mx.pack_index_keys(torch.randn(n_pages * per, di, generator=g))
    table = torch.randperm(n_pages, generator=g)[:t * width].view(t, width).to(torch.int32)
    q = mx.act_quant_ref(torch.randn(t, hi, di, generator=g), "fp4", mx.MX_GROUP, "ue8m0")   # the step's q grid
    w = torch.randn(t, hi, generator=g) * (di ** -0.5 * hi ** -0.5)
    return q.to(device), w.to(device), keys.to(device), table.to(device), torch.tensor(vis).to(device), ratio, bs


INDEX_CASES = [
    # heads, dim, ratio, block size, table width, visible entries per row
    (4, 64, 1, 16, 5, [80, 17, 0, 1]),
    (4, 64, 2, 16, 6, [48, 20, 3]),
    (3, 32, 2, 8, 9, [36, 35, 11, 7, 2]),
]


@pytest.mark.parametrize("case", range(len(INDEX_CASES)))
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_step_index_scores_match_reference(case, bf16, seed, kernel_device):
    args = _index_case(kernel_device, seed, *INDEX_CASES[case])
    got = step_index_scores(*args, bf16_scores=bf16)
    want = step_index_scores_reference(*args, bf16_scores=bf16)
    assert got.shape == want.shape
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert fin.sum() == sum(INDEX_CASES[case][-1])
    tol = 2 ** -7 if bf16 else 1e-5    # bf16: a dot may round to the neighbouring bf16 value
    scale = want[fin].abs().max()
    assert ((got[fin] - want[fin]).abs() <= tol * (want[fin].abs() + 1e-3 * scale)).all()


@pytest.mark.parametrize("seed", [1, 2])
def test_select_topk_is_the_best_visible_entries_ascending(seed, kernel_device):
    g = torch.Generator().manual_seed(seed)
    sc = torch.randn(5, 40, generator=g)
    vis = torch.tensor([40, 12, 3, 0, 25])
    sc = sc.masked_fill(torch.arange(40)[None, :] >= vis[:, None], float("-inf")).to(kernel_device)
    got = select_topk(sc, 8).cpu()
    for r in range(5):
        k = min(8, int(vis[r]))
        want = torch.sort(torch.topk(sc[r].cpu()[:max(int(vis[r]), 1)], k).indices).values if k else torch.empty(0)
        assert torch.equal(got[r, :k], want.long())
        assert (got[r, k:] == -1).all()


# ---------------------------------------------------------------------- GPU, real V4.1 widths
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [[1] * 32, [1], [4, 2, 3, 1]])
def test_gpu_step_attention_real_width(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _attention_case("cuda", 5, 64, 512, 128, 128, rows, [8000 + 7 * i for i in range(len(rows))], 4096, 512)
    want = step_attention_reference(*args).float()
    got = step_attention_mx(*args).float()
    assert (got - want).abs().max().item() / want.abs().max().item() < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [False, True])
def test_gpu_step_index_scores_real_width(bf16):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    args = _index_case("cuda", 6, 32, 128, 1, 256, 34, [8000 + 11 * i for i in range(32)])
    got = step_index_scores(*args, bf16_scores=bf16)
    want = step_index_scores_reference(*args, bf16_scores=bf16)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    tol = 2 ** -7 if bf16 else 1e-4
    assert ((got[fin] - want[fin]).abs() <= tol * (want[fin].abs() + 1e-3 * want[fin].abs().max())).all()
    sel = select_topk(got, 512)
    assert sel.shape == (32, 512) and (sel >= 0).all()


def test_select_topk_breaks_ties_to_the_lower_entry(kernel_device):
    """Exact ties (bf16 scores, relu zeros, signed zeros) go to the lower entry id, as the model's topk_ids."""
    from redknot.models.deepseek_v41.ref_math import topk_ids

    g = torch.Generator().manual_seed(4)
    sc = torch.randint(-3, 4, (6, 300), generator=g).float() * 0.25        # many exact ties
    sc[0, :] = 0.0
    sc[1, ::2] = -0.0
    sc[2, 100:] = float("-inf")
    sc = sc.to(kernel_device)
    got = select_topk(sc, 40).cpu()
    want = topk_ids(sc.cpu(), 40)
    want = torch.where(sc.cpu().gather(1, want) > float("-inf"), want, -1)
    assert torch.equal(got, want)


def test_every_launch_config_matches_reference(kernel_device):
    """The tuners may pick any candidate on a GPU: each one computes the same thing."""
    from redknot.kernels.triton.attention_mx import ATTN_MX_TUNER
    from redknot.kernels.triton.step_indexer_mx import STEP_INDEX_TUNER

    args = _attention_case(kernel_device, 7, *ATTN_CASES[1])
    want = step_attention_reference(*args).float()
    for cfg in ATTN_MX_TUNER.candidates:
        got = step_attention_mx(*args, config=cfg).float()
        assert (got - want).abs().max().item() / want.abs().max().item() < 1.5e-2, cfg
    iargs = _index_case(kernel_device, 7, *INDEX_CASES[1])
    want = step_index_scores_reference(*iargs)
    fin = torch.isfinite(want)
    for cfg in STEP_INDEX_TUNER.candidates:
        got = step_index_scores(*iargs, config=cfg)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), cfg
        assert ((got[fin] - want[fin]).abs() <= 1e-5 * (want[fin].abs() + 1e-3)).all(), cfg


@pytest.mark.parametrize("case", [0, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_step_index_scores_over_entry_lists(case, bf16, kernel_device):
    """Scoring only listed entries (candidate blocks): the full scores at those ids, -inf for -1, for
    ids past the row's visible count and for ids past the table."""
    args = _index_case(kernel_device, 9, *INDEX_CASES[case])
    t = args[0].shape[0]
    n_max = args[3].shape[1] * args[6] // args[5]
    g = torch.Generator().manual_seed(9)
    ent = torch.randint(-1, n_max + 4, (t, 24), generator=g).to(kernel_device)
    got = step_index_scores(*args, bf16_scores=bf16, entries=ent)
    want = step_index_scores_reference(*args, bf16_scores=bf16, entries=ent)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert fin.any() and (~fin).any()
    tol = 2 ** -7 if bf16 else 1e-5
    assert ((got[fin] - want[fin]).abs() <= tol * (want[fin].abs() + 1e-3)).all()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_candidate_entries_are_the_models_candidate_blocks(seed, kernel_device):
    from redknot.kernels.triton.step_indexer_mx import candidate_entries
    from redknot.models.deepseek_v41.attention import candidate_blocks

    g = torch.Generator().manual_seed(seed)
    n, bs, nb = 61, 4, 5
    vis = torch.tensor([61, 40, 9, 1, 0, 22])
    sc = (torch.randint(-4, 5, (6, n), generator=g).float() * 0.5)      # ties between blocks too
    sc = sc.masked_fill(torch.arange(n)[None, :] >= vis[:, None], float("-inf"))
    mask = candidate_blocks(sc, vis, nb, bs)                             # [T, n] bool, the PyTorch path
    got = candidate_entries(sc.to(kernel_device), vis.to(kernel_device), nb, bs).cpu()
    for r in range(6):
        listed = set(int(e) for e in got[r] if 0 <= e < n)
        assert listed == set(int(e) for e in torch.nonzero(mask[r]).flatten()), r
        valid = got[r][got[r] >= 0]
        assert torch.equal(valid, torch.sort(valid).values) and (got[r][len(valid):] == -1).all()


# ---------------------------------------------------------------------- quantise on insert at rounding boundaries
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)      # midpoints of the e2m1 grid


def _e4m3_values(lo: float, hi: float) -> list:
    """Positive normal e4m3 values in [lo, hi]."""
    return [(1 + m / 8) * 2.0 ** e for e in range(-6, 8) for m in range(8) if lo <= (1 + m / 8) * 2.0 ** e <= hi]


def _boundary_rows(fmt: str, rows: int, d: int, seed: int) -> torch.Tensor:
    """bf16 rows whose every group sits on a rounding boundary of its format, all values exact in bf16:

    * compressed (e4m3 scale per 16): the group's amax is 6·m with m the midpoint of two e4m3 values, so
      the scale amax/6 is an exact tie of the e4m3 rounding; the other values are e2m1 midpoints times
      the round-to-nearest-even scale;
    * index (E8M0 per 32) / window (E8M0 per 32, FP8 values): amax/fmax is exactly a power of two
      (one ulp more would double the scale); the other values are e2m1 / e4m3 midpoints times it.
    A quotient one ulp off (an approximate division) lands on the other side of these ties."""
    g = torch.Generator().manual_seed(seed)
    group = 16 if fmt == "compressed" else 32
    n = rows * d // group
    out = torch.empty(n, group, dtype=torch.float64)
    if fmt == "compressed":
        vals = _e4m3_values(2.0 ** -4, 4.0)
        pairs = [(a, b) for a, b in zip(vals, vals[1:]) if b < 2 * a]
        pick = torch.randint(len(pairs), (n,), generator=g)
        for i, j in enumerate(pick.tolist()):
            a, b = pairs[j]
            mid = (a + b) / 2
            even = float(torch.tensor(mid).to(torch.float8_e4m3fn).float())        # ties to even
            ties = torch.tensor(E2M1_TIES)[torch.randint(len(E2M1_TIES), (group,), generator=g)] * even
            out[i] = ties.clamp(max=6 * mid)
            out[i, torch.randint(group, (1,), generator=g)] = 6 * mid
    else:
        fmax = 448.0 if fmt == "window" else 6.0
        ties = [(1 + (2 * m + 1) / 16) * 2.0 ** e for e in range(-3, 8) for m in range(8)] if fmt == "window" \
            else list(E2M1_TIES)
        ties = torch.tensor([t for t in ties if t < fmax])
        k = torch.randint(-12, 4, (n,), generator=g).double()
        out = ties[torch.randint(len(ties), (n, group), generator=g)] * torch.exp2(k)[:, None]
        out[torch.arange(n), torch.randint(group, (n,), generator=g)] = fmax * torch.exp2(k)
    sign = torch.where(torch.rand(n, group, generator=g) < 0.5, -1.0, 1.0)
    x = (out * sign).view(rows, d)
    assert torch.equal(x.to(torch.bfloat16).double(), x)          # every value exact in bf16
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("fmt,d", [("compressed", 512), ("index", 128), ("window", 512)])
def test_cache_insert_is_bit_exact_at_rounding_boundaries(fmt, d, kernel_device):
    """The Triton insert writes the bytes of the PyTorch packing where the scale division is an exact tie
    (an approximate ``/`` flips these; the GPU's ``div.full.f32`` did for a few cache bytes per step)."""
    from redknot.kernels.triton.quant_mx import cache_insert_mx

    pack = {"compressed": mx.pack_compressed_entries, "index": mx.pack_index_keys, "window": mx.pack_window_rows}[fmt]
    x = _boundary_rows(fmt, 48, d, seed=11).to(kernel_device)
    want = pack(x)
    # The cases bite: the scale of every group changes when its division is one ulp high.
    group = 16 if fmt == "compressed" else 32
    amax = x.float().view(-1, group).abs().amax(-1)
    ratio = amax / (6.0 if fmt != "window" else 448.0)
    high = torch.nextafter(ratio, torch.full_like(ratio, float("inf")))
    if fmt == "compressed":
        flips = mx.fp8_encode(ratio).view(torch.uint8) != mx.fp8_encode(high).view(torch.uint8)
        assert flips.float().mean() > 0.3
    else:
        assert (mx.e8m0_encode(ratio) != mx.e8m0_encode(high)).all()
    cache = torch.zeros(50, want.shape[1], dtype=torch.uint8, device=kernel_device)
    slots = torch.arange(48, device=kernel_device) + 1
    cache_insert_mx(cache, slots, x, fmt)
    got = cache[1:49]
    assert int((got != want).sum()) == 0, int((got != want).sum())


@pytest.mark.parametrize("bf16", [False, True])
def test_step_index_scores_weights_scale_equals_the_scaled_fp32_weights(bf16, kernel_device):
    """16-bit weights with ``weights_scale`` (the cast and product inside the kernel) give the bits of the fp32
    weights ``w.float() * scale`` that the two PyTorch launches computed; a wrong scale shows."""
    q, w, *rest = _index_case(kernel_device, 5, *INDEX_CASES[0])
    hi, di = q.shape[1], q.shape[2]
    scale = di ** -0.5 * hi ** -0.5
    wb = (w / scale).to(torch.bfloat16)
    want = step_index_scores(q, wb.to(torch.float32) * scale, *rest, bf16_scores=bf16)
    got = step_index_scores(q, wb, *rest, bf16_scores=bf16, weights_scale=scale)
    assert torch.equal(got, want)
    assert not torch.equal(step_index_scores(q, wb, *rest, bf16_scores=bf16, weights_scale=scale * 1.01), want)
