"""The V4.1 indexer's streamed top-k (``indexer_mx.stream_topk``, Triton interpreter) against the PyTorch
scores with the model's tie rule (equal scores: the lower entry first), so the comparison is exact:
prefill tiles, a decode token whose entries are split over programs, rows with nothing or fewer than
top-k entries visible, fp32 and the reference's bf16 score arithmetic (few distinct values: many ties).
"""
from __future__ import annotations

import pytest
import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import indexer_mx
from redknot.models.deepseek_v41.ref_math import index_qdq, topk_ids


def _inputs(t, n, heads=4, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = index_qdq(torch.randn(t, heads, dim, generator=g).bfloat16()).float()
    keys = mx.pack_index_keys(torch.randn(n, dim, generator=g))
    w = torch.randn(t, heads, generator=g) * dim ** -0.5
    vis = torch.randint(1, n + 1, (t,), generator=g, dtype=torch.int32)
    vis[0] = n
    if t > 2:
        vis[1], vis[2] = 0, 3
    return q, w, keys, vis


def _lower_first(q, w, keys, vis, k, bf16):
    n = keys.shape[0]
    s = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    s = s.masked_fill(torch.arange(n)[None] >= vis.long()[:, None], float("-inf"))
    return _select_written(s, k)


def _select_written(s, k):
    """The k best ids per row of scores (-inf: not selectable) by the model's ``topk_ids`` (ties to the
    lower id), ascending, then -1."""
    n = s.shape[1]
    kk = min(k, n)
    ids = topk_ids(s, kk)
    ids = torch.where(s.gather(1, ids) > float("-inf"), ids, -1)
    big = torch.iinfo(torch.int32).max
    ids = torch.where(ids < 0, big, ids).sort(1).values
    ids = torch.where(ids == big, -1, ids)
    return torch.cat([ids, ids.new_full((ids.shape[0], k - kk), -1)], 1)


def _assert_selects(got, q, w, keys, vis, k, bf16, decode):
    """Exactly the lower-first selection of the PyTorch scores; the expanded stream with fp32 scores sums
    a token's heads in another order than PyTorch (fp32 terms, last-bit differences), so there its choice
    is compared tie-aware on the reference scores within the op's tolerance (``checks_mx``)."""
    want = _lower_first(q, w, keys, vis, k, bf16)
    if decode != "expanded" or bf16:
        assert torch.equal(got.long(), want)
        return
    from redknot.kernels.triton.checks_mx import _compare_selection

    n = keys.shape[0]
    s = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    s = s.masked_fill(torch.arange(n)[None] >= vis.long()[:, None], float("-inf"))
    assert _compare_selection("top-k", s, got.long(), want, tol=1e-6).ok


def _assert_block_maxima(bm, want, bf16, decode):
    if decode != "expanded" or bf16:
        assert torch.equal(bm, want)
    else:
        assert torch.equal(torch.isinf(bm), torch.isinf(want))
        fin = torch.isfinite(want)
        assert torch.allclose(bm[fin], want[fin], rtol=1e-6, atol=1e-6)   # O(1) scores: a few fp32 ulps


DECODES = [(False, "registers"), (True, "registers"), (True, "scaled"), (False, "expanded"),
           (True, "expanded")]   # (bf16 scores, key decode)


# (5, 300) with -m slow (~3 s a decode interpreted): the block-maxima test below streams the same prefill tiles
# with every decode and checks the same top-k; (1, 700) keeps the split decode token and its buffer cuts,
# (3, 10) a partial token tile with fewer entries than k
@pytest.mark.parametrize("bf16,decode", DECODES)
@pytest.mark.parametrize("t,n,k", [pytest.param(5, 300, 16, marks=pytest.mark.slow), (1, 700, 16), (3, 10, 16)])
def test_streamed_topk_equals_the_lower_first_selection(t, n, k, bf16, decode):
    """Every key decode (registers; MXFP4 through tl.dot_scaled; keys expanded to bf16 once, then a
    pipelined stream) selects exactly what the scores select."""
    q, w, keys, vis = _inputs(t, n, seed=t + n)
    got = indexer_mx.stream_topk(q, w, keys, vis, k, bf16, config=indexer_mx.StreamConfig(decode=decode))
    _assert_selects(got, q, w, keys, vis, k, bf16, decode)


def test_the_registry_paths_stream_without_a_score_matrix(monkeypatch):
    """``indexer_topk_mx`` (no candidates) and ``indexer_source_mx``'s top-k never write entry scores;
    the source's candidate blocks come from the block-max pass and equal the reference's."""
    q, w, keys, vis = _inputs(4, 200, seed=5)
    bs, nb = 4, 6
    want_blocks = ref_v41.indexer_candidates_mx(q, w, keys, vis, nb, bs, True)
    scores = indexer_mx._scores

    def blockmax_only(*a, blockmax=False, **kw):
        assert blockmax, "an entry score matrix was written"
        return scores(*a, blockmax=blockmax, **kw)
    monkeypatch.setattr(indexer_mx, "_scores", blockmax_only)
    want = _lower_first(q, w, keys, vis, 16, True)
    assert torch.equal(indexer_mx.indexer_topk_mx(q, w, keys, vis, 16, bf16_scores=True).long(), want)
    idx, blocks = indexer_mx.indexer_source_mx(q, w, keys, vis, 16, nb, bs, True)
    assert torch.equal(idx.long(), want)
    assert torch.equal(blocks, want_blocks)


def test_the_chunk_selection_breaks_ties_to_the_lower_id():
    """The selection of a written score chunk (candidate lists, block scores) is the model's: heavy ties
    (two-decimal scores), -0.0 against 0.0, -inf entries never chosen, rows with fewer than k finite."""
    g = torch.Generator().manual_seed(1)
    s = (torch.randn(6, 300, generator=g) * 4).round() / 4
    s[s == 0] = -0.0
    s[0, ::2] = 0.0
    s[1, 5:] = float("-inf")
    s[2, 0] = float("inf")
    got = indexer_mx._select(s, 32)
    k = 32
    ids = topk_ids(s, k)
    ids = torch.where(s.gather(1, ids) > float("-inf"), ids, torch.iinfo(torch.int32).max).sort(1).values
    want = torch.where(ids == torch.iinfo(torch.int32).max, -1, ids)
    assert torch.equal(got.long(), want)
    assert int((got[1] >= 0).sum()) == 5


def _lower_first_in(q, w, keys, vis, k, cand, bs, bf16):
    """The model's selection inside candidate blocks, written out: scores outside them -inf, equal scores
    to the lower id."""
    n = keys.shape[0]
    s = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    nb = -(-n // bs)
    allowed = torch.zeros(q.shape[0], nb + 1, dtype=torch.bool)
    allowed.scatter_(1, torch.where(cand >= 0, cand.long(), nb), True)
    ok = allowed[:, :nb].repeat_interleave(bs, 1)[:, :n] & (torch.arange(n)[None] < vis.long()[:, None])
    s = s.masked_fill(~ok, float("-inf"))
    return _select_written(s, k).int()


def _block_maxima(q, w, keys, vis, bs, bf16):
    n = keys.shape[0]
    s = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    s = s.masked_fill(torch.arange(n)[None] >= vis.long()[:, None], float("-inf"))
    nb = -(-n // bs)
    return torch.nn.functional.pad(s, (0, nb * bs - n), value=float("-inf")).view(-1, nb, bs).amax(-1)


def _prefill_tiles_with_fp32_scores():
    """(t, n, bs, bf16, decode) of the block-maxima test: (5, 300, 8) with bf16 scores runs with -m slow (~2.5 s a
    decode interpreted), since test_v41_indexer_stream_shapes streams 5 tokens' prefill tiles with block maxima
    of 8 and bf16 scores through every decode by default; its fp32 forms and the other sizes run by default."""
    return [pytest.param(t, n, bs, bf16, decode, marks=[pytest.mark.slow] if (t, bf16) == (5, True) else [])
            for t, n, bs in [(5, 300, 8), (1, 700, 4), (3, 61, 8)] for bf16, decode in DECODES]


@pytest.mark.parametrize("t,n,bs,bf16,decode", _prefill_tiles_with_fp32_scores())
def test_the_stream_writes_the_block_maxima_of_its_pass(t, n, bs, bf16, decode):
    """One pass, two outputs: the top-k is unchanged by the block-max output and the block maxima equal
    the PyTorch scores' (partly visible blocks, blocks past a row's visibility -inf, a decode token
    whose entries are split over programs, an entry count that is not a multiple of the block)."""
    q, w, keys, vis = _inputs(t, n, seed=3 * t + n)
    nb = -(-n // bs)
    bm = torch.full((t, nb), float("-inf"))
    got = indexer_mx.stream_topk(q, w, keys, vis, 16, bf16, config=indexer_mx.StreamConfig(4, 64, 4, decode=decode),
                                 block_scores=bm, block_size=bs)
    _assert_selects(got, q, w, keys, vis, 16, bf16, decode)
    _assert_block_maxima(bm, _block_maxima(q, w, keys, vis, bs, bf16), bf16, decode)


def test_the_source_selection_in_token_chunks_and_below_the_block_budget():
    """indexer_source_mx: token chunks of its block scores (a tiny scratch budget) give the reference's
    selections; with no more blocks than it keeps, the candidates are every held block (nothing scored)."""
    q, w, keys, vis = _inputs(7, 240, seed=11)
    want_idx = _lower_first(q, w, keys, vis, 16, True)
    want_blocks = ref_v41.indexer_candidates_mx(q, w, keys, vis, 5, 8, True)
    idx, blocks = indexer_mx.indexer_source_mx(q, w, keys, vis, 16, 5, 8, True, max_scratch_bytes=4 * 4 * 30)
    assert torch.equal(idx.long(), want_idx) and torch.equal(blocks, want_blocks)
    idx, blocks = indexer_mx.indexer_source_mx(q, w, keys, vis, 16, 32, 8, True)
    assert torch.equal(idx.long(), want_idx)
    assert torch.equal(blocks, ref_v41.indexer_candidates_mx(q, w, keys, vis, 32, 8, True))


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("path", ["stream", "scores"])
@pytest.mark.parametrize("t,n", [(6, 400), (1, 900)])
def test_the_selection_inside_candidate_blocks(t, n, path, bf16):
    """indexer_topk_mx with candidate blocks, streamed over each token's candidate list or scored into a
    chunk: the reference's selection (distinct blocks in any order, -1 pads, blocks past a row's
    visibility, a row with no candidate, a decode token whose list is split over programs)."""
    q, w, keys, vis = _inputs(t, n, seed=7 * t + n)
    bs, nbk = 8, 20
    g = torch.Generator().manual_seed(t)
    cand = torch.stack([torch.randperm(-(-n // bs), generator=g)[:nbk] for _ in range(t)]).int()
    cand[0, ::3] = -1
    if t > 1:
        cand[1] = -1
    want = _lower_first_in(q, w, keys, vis, 16, cand, bs, bf16)
    got = indexer_mx.indexer_topk_mx(q, w, keys, vis, 16, cand, bs, bf16, cand_path=path)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bf16", [False, True])
def test_real_size_source_and_candidate_selections_on_the_gpu(bf16):
    """V4.1 indexer widths (32 heads x 128, top-512, 2048 candidate blocks of 8) on fresh random inputs
    past the candidate budget (40,000 entries: 5,000 blocks): the candidate source's fused pass (top-k and
    block maxima) and both candidate-list paths of a re-indexing layer choose what the reference chooses,
    compared tie-aware on the reference's scores (the tuner picks the launch shapes). With fp32 scores the
    kernels sum a token's 32 head terms in their own order, not the reference's ``sum(1)``: a score may
    differ in its last bits, so two entries at the top-k boundary may trade places; their reference scores
    then differ by that rounding (tolerance 1e-5 relative, about 100 fp32 units). bf16 scores are rounded
    where the reference rounds them (each dot, each weighted term, the sum); the test holds their selections
    to the same scores exactly."""
    from redknot.kernels.triton.checks_mx import _compare_selection

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    t, n, heads, dim, k, nb, bs = 512, 40000, 32, 128, 512, 2048, 8
    q = mx.act_quant_ref(torch.randn(t, heads, dim, generator=g, device=dev).bfloat16(), "fp4")
    w = torch.randn(t, heads, generator=g, device=dev) * heads ** -0.5
    keys = mx.pack_index_keys(torch.randn(n, dim, generator=g, device=dev))
    vis = torch.randint(n // 2, n + 1, (t,), generator=g, device=dev, dtype=torch.int32)
    vis[0] = 3
    tol = 0 if bf16 else 1e-5
    scores = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    scores = scores.masked_fill(torch.arange(n, device=dev)[None] >= vis.long()[:, None], float("-inf"))
    idx, blocks = indexer_mx.indexer_source_mx(q, w, keys, vis, k, nb, bs, bf16)
    want_idx = ref_v41.indexer_topk_mx(q, w, keys, vis, k, bf16_scores=bf16)
    want_blocks = ref_v41.indexer_candidates_mx(q, w, keys, vis, nb, bs, bf16)
    chk = _compare_selection("top-k", scores, idx, want_idx, tol=tol)
    assert chk.ok, chk.line()
    bscore = torch.nn.functional.pad(scores, (0, -(-n // bs) * bs - n), value=float("-inf")).view(t, -1, bs).amax(-1)
    newest = ((vis.long() - 1) // bs).clamp(min=0)
    bscore.scatter_(1, newest[:, None], float("inf"))
    chk = _compare_selection("blocks", bscore.nan_to_num(posinf=1e30), blocks, want_blocks, tol=tol)
    assert chk.ok, chk.line()
    cand = want_blocks
    want = ref_v41.indexer_topk_mx(q, w, keys, vis, k, cand, bs, bf16)
    allowed = torch.zeros(t, -(-n // bs) + 1, dtype=torch.bool, device=dev)
    allowed.scatter_(1, torch.where(cand >= 0, cand.long(), -(-n // bs)), True)
    masked = scores.masked_fill(~allowed[:, :-1].repeat_interleave(bs, 1)[:, :n], float("-inf"))
    for path in ("stream", "scores"):
        got = indexer_mx.indexer_topk_mx(q, w, keys, vis, k, cand, bs, bf16, cand_path=path)
        chk = _compare_selection(path, masked, got, want, tol=tol)
        assert chk.ok, chk.line()


@pytest.mark.parametrize("decode", ["registers", "scaled", "expanded"])
def test_the_candidate_stream_with_either_decode(decode):
    """The candidate-list stream (one token per program) with every key decode: the reference's selection."""
    q, w, keys, vis = _inputs(5, 500, seed=21)
    g = torch.Generator().manual_seed(2)
    cand = torch.stack([torch.randperm(63, generator=g)[:24] for _ in range(5)]).int()
    cand[2, 5:] = -1
    want = _lower_first_in(q, w, keys, vis, 16, cand, 8, True)
    got = indexer_mx.stream_topk(q, w, keys, vis, 16, True, config=indexer_mx.StreamConfig(decode=decode),
                                 block_size=8, cand_blocks=cand)
    assert torch.equal(got, want)


def test_a_decode_token_splits_its_candidate_list():
    """One token (decode) with a long candidate list: the list is split over programs and merged (these
    inputs tie at the cut score: the lower entry must win)."""
    q, w, keys, vis = _inputs(1, 2000, seed=8)
    g = torch.Generator().manual_seed(9)
    cand = torch.randperm(250, generator=g)[:200].int()[None]
    want = _lower_first_in(q, w, keys, vis, 16, cand, 8, True)
    got = indexer_mx.indexer_topk_mx(q, w, keys, vis, 16, cand, 8, True, cand_path="stream")
    assert torch.equal(got, want)


def test_a_scaled_decode_that_disagrees_falls_back_to_the_register_decode(monkeypatch):
    """The first use of a tuned ``scaled`` shape compares its selections with the register decode's: equal
    (the real kernels) keeps it; a disagreement (injected into the scaled runs) makes the class fall back."""
    q, w, keys, vis = _inputs(5, 300, seed=1)
    scaled = indexer_mx.StreamConfig(4, 64, 8, decode="scaled")
    bm = torch.full((5, 38), float("-inf"))
    assert indexer_mx._check_scaled("same", scaled, q, w, keys, vis, 16, True, bm, 8, None) == scaled
    real = indexer_mx.stream_topk

    def broken(*a, **kw):
        out = real(*a, **kw)
        cfg = a[6] if len(a) > 6 else kw.get("config")
        return out.flip(1) if cfg is not None and cfg.decode == "scaled" else out
    monkeypatch.setattr(indexer_mx, "stream_topk", broken)
    monkeypatch.setattr(indexer_mx.STREAM_TUNER, "choices", {})
    got = indexer_mx._check_scaled("broken", scaled, q, w, keys, vis, 16, True, bm, 8, None)
    assert got.decode == "registers" and indexer_mx.STREAM_TUNER.choices["broken"] == got
    assert indexer_mx.SCALED_CHECKED["broken"] is False


def test_the_key_expansion_is_exact():
    """``expand_keys``: every index-key row's bf16 values equal the format's decode (fresh random keys, a row
    count that is not a multiple of the expansion block, keys far from 1 so that the E8M0 scales vary)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    x = torch.randn(150, 64, generator=g) * torch.exp2(torch.randint(-20, 20, (150, 1), generator=g).float())
    keys = mx.pack_index_keys(x)
    got = indexer_mx.expand_keys(keys, 64)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), mx.unpack_index_keys(keys).float())


# fp32 scores run by default; the bf16 forms (~15 s each interpreted) with -m slow and on the GPU test
@pytest.mark.parametrize("bf16,head_sum,late", [(False, "", False), (False, "", True),
                                                pytest.param(True, "", False, marks=pytest.mark.slow),
                                                pytest.param(True, "mma", False, marks=pytest.mark.slow),
                                                pytest.param(True, "mma", True, marks=pytest.mark.slow)])
def test_the_expanded_stream_cuts_each_row_between_segments(bf16, head_sum, late):
    """The expanded stream cuts a row's buffer only between pipelined segments, one row at a time: many
    entries (several cuts of every row), rows that see few entries or none, a partial tile, ties of the
    bf16 arithmetic at the cut; with and without the block maxima of the same pass; the heads' bf16 terms
    added by a second MMA (``head_sum="mma"``) or by adds; ``late_keys`` (counting cuts; its test before the keys
    are packed is off in the block-maxima pass)."""
    q, w, keys, vis = _inputs(7, 2100, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    cfg = indexer_mx.StreamConfig(4, 64, 4, decode="expanded", num_stages=3, head_sum=head_sum,
                                  cut="select" if late else "", late_keys=late)
    _assert_selects(indexer_mx.stream_topk(q, w, keys, vis, 16, bf16, config=cfg), q, w, keys, vis, 16, bf16,
                    "expanded")
    bs = 8
    bm = torch.full((7, -(-2100 // bs)), float("-inf"))
    got = indexer_mx.stream_topk(q, w, keys, vis, 16, bf16, config=cfg, block_scores=bm, block_size=bs)
    _assert_selects(got, q, w, keys, vis, 16, bf16, "expanded")
    _assert_block_maxima(bm, _block_maxima(q, w, keys, vis, bs, bf16), bf16, "expanded")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bf16", [False, True])
def test_real_size_expanded_shapes_on_the_gpu(bf16):
    """Every expanded launch shape of the tuner at V4.1 widths (32 heads x 128, top-512; 1024 queries at the end
    of 20,000 entries, fresh random inputs): the top-k and the block maxima of the compiled kernels equal the
    register stream's with bf16 scores (bit for bit), and with fp32 scores hold the reference's selection
    tie-aware within the op's tolerance."""
    from redknot.kernels.triton.checks_mx import _compare_selection

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    t, n, heads, dim, k, bs = 1024, 20000, 32, 128, 512, 8
    q = mx.act_quant_ref(torch.randn(t, heads, dim, generator=g, device=dev).bfloat16(), "fp4")
    w = torch.randn(t, heads, generator=g, device=dev) * heads ** -0.5
    keys = mx.pack_index_keys(torch.randn(n, dim, generator=g, device=dev))
    vis = (n - t + 1 + torch.arange(t, device=dev)).to(torch.int32)
    vis[:7] = torch.tensor([0, 1, 5, 63, 64, 65, 600], device=dev, dtype=torch.int32)
    nb = -(-n // bs)
    scores = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    scores = scores.masked_fill(torch.arange(n, device=dev)[None] >= vis.long()[:, None], float("-inf"))
    want_bm = torch.nn.functional.pad(scores, (0, nb * bs - n), value=float("-inf")).view(t, nb, bs).amax(-1)
    base_bm = torch.full((t, nb), float("-inf"), device=dev)
    base = indexer_mx.stream_topk(q, w, keys, vis, k, bf16, config=indexer_mx.StreamConfig(2, 64, 4),
                                  block_scores=base_bm, block_size=bs)
    shapes = [c for c in indexer_mx.STREAM_TUNER.candidates if c.decode == "expanded"]
    assert shapes
    for cfg in shapes:
        bm = torch.full((t, nb), float("-inf"), device=dev)
        got = indexer_mx.stream_topk(q, w, keys, vis, k, bf16, config=cfg, block_scores=bm, block_size=bs)
        if bf16:
            assert torch.equal(got, base) and torch.equal(bm, base_bm), cfg
        else:
            assert _compare_selection(str(cfg), scores, got.long(), base.long(), tol=1e-6).ok, cfg
            fin = torch.isfinite(want_bm)
            assert torch.equal(torch.isfinite(bm), fin), cfg
            assert torch.allclose(bm[fin], want_bm[fin], rtol=1e-5, atol=1e-5), cfg
