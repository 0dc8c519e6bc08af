"""The pipelined prefill form of V4's ``indexer_topk_paged`` (``IndexerXConfig``: ``_gather_keys`` +
``_indexer_select_x``, the stream V4.1's expanded indexer shares) against the float64 oracle on fresh random
inputs, under the rule of ``checks.indexer`` ("the same top-k": a valid ordered top-k up to 1e-4 of the row's
largest |score| for random inputs, exactly the float64 order, lower id first among ties, for integer-valued
ones): ragged sequences over a shuffled paged pool (queries seeing no entry, rows
seeing fewer entries than the top-k), streams long enough that rows are cut between segments, integer-valued
ties, poisoned outputs, the op's prefill guard, the tuner's candidates and the first-use check (a wrong kernel
fails it), and a negative control (a wrong selection fails the rule). Interpreter-sized by default; one launch per
tuner shape at V4 width (64 heads x 128, top-512: what ``tools/sm90_compile.py`` compiles for sm_90a) runs under
``-m slow``; each tuner shape at real size through the op, and the first-use check at V4 width, under ``-m gpu``."""
import functools

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import indexer
from redknot.kernels.triton.checks import indexer as indexer_checks
from redknot.kernels.triton.checks.common import paged_step
from redknot.kernels.triton.checks.indexer import (
    RTOL_RANDOM,
    _exact_order,
    exact_scores,
    topk_violations,
)
from redknot.kernels.triton.indexer import IndexerConfig, IndexerXConfig

CANDIDATES = [c for c in indexer.INDEXER_TUNER.candidates if isinstance(c, IndexerXConfig)]
# interpreter-sized shapes: one and four tokens per tile, two stages; 16-entry steps so that short streams cut;
# the last cuts by counting
SHAPES = [IndexerXConfig(1, 16, 4, 2), IndexerXConfig(2, 16, 4, 3), IndexerXConfig(4, 32, 4, 2),
          IndexerXConfig(2, 16, 4, 3, cut="select"), IndexerXConfig(2, 16, 4, 2, cut="select", max_regs=168),
          IndexerXConfig(2, 16, 4, 3, cut="select", late_keys=True), IndexerXConfig(4, 32, 4, 2, late_keys=True)]
RATIO, BLOCK, HEADS, DIM = 4, 16, 5, 32   # 4 entries a page; 5 heads pad to 8 (or 16 / BLOCK_T)


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _inputs(device, ctx, new, seed, integer=False, dtype=torch.float32, heads=HEADS, dim=DIM, block=BLOCK):
    gen = torch.Generator().manual_seed(seed)
    step = paged_step(ctx, new, block, device, gen)
    t = step.num_tokens
    draw = (lambda *s: torch.randint(-2, 3, s, generator=gen).float()) if integer else \
        (lambda *s: torch.randn(*s, generator=gen))
    q = draw(t, heads, dim).to(device=device, dtype=dtype)
    w = draw(t, heads).to(device)
    keys = draw(step.num_blocks, block // RATIO, dim).to(device=device, dtype=dtype)
    return step.meta, q, w, keys


def _select(cfg, meta, q, w, keys, topk, scale=None):
    """The pipelined form's kernels on a poisoned output (-7: every slot must be written)."""
    out = torch.full((q.shape[0], topk), -7, dtype=torch.int32, device=q.device)
    return indexer._launch_x(cfg, q=q, weights=w, positions=meta.positions.to(torch.int32),
                             query_start_loc=meta.query_start_loc, keys=keys, block_table=meta.block_tables,
                             ratio=RATIO, block_size=RATIO * keys.shape[1], topk=topk,
                             scale=q.shape[-1] ** -0.5 if scale is None else scale, out=out)


def _assert_valid(got, meta, q, w, keys, topk):
    scores = exact_scores(q, w, keys, meta, RATIO, q.shape[-1] ** -0.5)
    bad = topk_violations(got, scores, meta.positions, RATIO, topk, rtol=RTOL_RANDOM)
    assert not bad, bad
    assert int((got == -7).sum()) == 0, "unwritten output slots"


def test_the_tuner_offers_the_pipelined_form_after_the_paged_shapes():
    cands = indexer.INDEXER_TUNER.candidates
    first_x = next(i for i, c in enumerate(cands) if isinstance(c, IndexerXConfig))
    assert CANDIDATES and all(isinstance(c, IndexerConfig) for c in cands[:first_x])
    assert all(isinstance(c, IndexerXConfig) for c in cands[first_x:])
    assert isinstance(cands[0], IndexerConfig)   # the untuned default (CPU, graph capture) stays the paged kernel
    assert indexer.INDEXER_TUNER.name != "indexer_topk"   # stored choices of the old list are timed again


def test_config_text_keeps_the_stored_names_and_names_the_register_cap():
    """Stored tuning choices name shapes by their text: the older fields' text is unchanged, ``max_regs`` appears
    only when set, and the capped shape is a candidate of the tuner."""
    assert repr(IndexerXConfig(2, 64, 4, 3)) == "IndexerXConfig(block_t=2, block_n=64, num_warps=4, num_stages=3)"
    assert repr(IndexerXConfig(2, 64, 4, 3, cut="select")).endswith("num_stages=3, cut='select')")
    capped = IndexerXConfig(2, 64, 4, 2, cut="select", max_regs=168)
    assert repr(capped).endswith("cut='select', max_regs=168)")
    assert capped in CANDIDATES
    late = IndexerXConfig(2, 64, 4, 2, cut="select", max_regs=168, late_keys=True)   # measured slower: not offered
    assert repr(late).endswith("cut='select', max_regs=168, late_keys=True)") and late not in CANDIDATES


def test_the_stream_length_class_rounds_up_to_a_power_of_two_and_merges_long_streams():
    assert indexer.prefill_entry_class(None) == 0
    assert [indexer.prefill_entry_class(n) for n in (0, 1, 3, 78, 2048, 2049)] == [1, 1, 4, 128, 2048, 4096]
    assert indexer.prefill_entry_class(indexer.TUNE_ENTRIES + 1) == indexer.TUNE_ENTRIES
    assert indexer.prefill_entry_class(1 << 20) == indexer.TUNE_ENTRIES


def test_the_op_tunes_prefill_chunks_per_stream_length_and_decode_steps_in_one_class(kernel_device, monkeypatch):
    """The op reads the longest stream from the step's host lists (no device sync): chunks deeper into a context
    are timed as their own class, so a shape that wins only on long streams can be picked there. Decode-sized
    steps keep one class. The tuner itself runs (a spy records its keys); the ids stay a valid top-k."""
    from redknot.kernels.triton import ops
    keys_seen = []
    real_pick = indexer.INDEXER_TUNER.pick

    def spy(key, run, device):
        keys_seen.append(key)
        return real_pick(key, run, device)
    monkeypatch.setattr(indexer.INDEXER_TUNER, "pick", spy)
    monkeypatch.setattr(indexer, "sm_count", lambda t: 8)   # the CPU's nominal count on any device: 16 rows prefill
    seed = _fresh_seed()
    for ctx, new in (([300, 40], [12, 4]), ([1000, 40], [12, 4]), ([40, 9], [1, 1])):
        meta, q, w, keys = _inputs(kernel_device, ctx, new, seed)
        got = ops.indexer_topk(q, w, keys, meta, RATIO, 8, DIM ** -0.5)
        _assert_valid(got, meta, q, w, keys, 8)
    base = (HEADS, DIM, 8, "torch.float32")
    # 16 tokens on 8 SMs: prefill; longest streams 312 // 4 = 78 and 1012 // 4 = 253 entries
    assert keys_seen == [("prefill", *base, 128), ("prefill", *base, 256), ("decode", *base)]


CASES = [  # (context lengths, new tokens per sequence): ragged, rows seeing no entry, short rows
    ([9, 0, 3], [5, 2, 1]),
    ([600, 21], [7, 3]),
]


@pytest.mark.parametrize("ctx,new", CASES, ids=["short", "cut"])
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_pipelined_form_selects_a_valid_topk(ctx, new, cfg, kernel_device):
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, ctx, new, seed)
    got = _select(cfg, meta, q, w, keys, 8)
    _assert_valid(got, meta, q, w, keys, 8)
    n_vis = (meta.positions.long() + 1) // RATIO
    assert bool(((got >= 0).sum(1) == n_vis.clamp(max=8)).all()), seed   # -1 exactly past the visible entries


@pytest.mark.parametrize("cfg", SHAPES[:2] + SHAPES[3:], ids=str)
def test_integer_valued_ties_follow_the_exact_order(cfg, kernel_device):
    """Every partial sum exact: real ties, decided by the lower entry id, exactly as the float64 order (also
    the order of the output: the counting cut leaves the keys unsorted, the merge sorts them)."""
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, [170, 9], [3, 4], seed, integer=True)
    got = _select(cfg, meta, q, w, keys, 8)
    want = _exact_order(exact_scores(q, w, keys, meta, RATIO, DIM ** -0.5), 8)
    assert torch.equal(got.long(), want.to(got.device).long()), seed


@pytest.mark.parametrize("cfg", [c for c in SHAPES if c.cut == "select" or c.late_keys], ids=str)
def test_ties_through_many_buffer_cuts_follow_the_exact_order(cfg, kernel_device):
    """Streams of ~600 entries whose keys are copies of four integer-valued rows: a row's scores take four values,
    the buffer is cut many times, and after the first cut every later block's best entries tie the bar's score
    with lower ids, so they beat it (``late_keys`` tests the bar's high word before packing keys: equal passes)."""
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, [2400, 40], [3, 2], seed, integer=True)
    gen = torch.Generator().manual_seed(seed)
    protos = torch.randint(-2, 3, (4, DIM), generator=gen).float()
    keys = protos[torch.randint(0, 4, keys.shape[:2], generator=gen)].to(keys.device)
    got = _select(cfg, meta, q, w, keys, 8)
    want = _exact_order(exact_scores(q, w, keys, meta, RATIO, DIM ** -0.5), 8)
    assert torch.equal(got.long(), want.to(got.device).long()), seed


def test_bf16_inputs_and_the_op_with_the_pipelined_config(kernel_device):
    """bf16 rows (what the GPU runs), through the op with an ``IndexerXConfig`` (prefill-sized: 16 tokens on the
    CPU's nominal 8 SMs), equal to the kernel-level launch, every slot written."""
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, [300, 40], [12, 4], seed, dtype=torch.bfloat16)
    cfg = SHAPES[1]
    got = _select(cfg, meta, q, w, keys, 8)
    _assert_valid(got, meta, q, w, keys, 8)
    op = indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc, keys=keys,
                                    block_table=meta.block_tables, ratio=RATIO, block_size=RATIO * keys.shape[1],
                                    topk=8, scale=DIM ** -0.5, config=cfg)
    assert torch.equal(op, got)


def test_the_pipelined_form_refuses_decode_sized_steps(kernel_device):
    meta, q, w, keys = _inputs(kernel_device, [40, 9], [1, 1], _fresh_seed())
    with pytest.raises(ValueError, match="prefill form"):
        indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc, keys=keys,
                                   block_table=meta.block_tables, ratio=RATIO, block_size=RATIO * keys.shape[1],
                                   topk=8, scale=DIM ** -0.5, config=SHAPES[0])


def test_negative_control_a_wrong_selection_fails(kernel_device):
    """The rule can fail: the same launch ranking by the negated score (the worst entries first), and a correct
    list with one chosen id swapped for an unchosen visible one, are both reported."""
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, [200, 30], [4, 2], seed)
    scores = exact_scores(q, w, keys, meta, RATIO, DIM ** -0.5)
    worst = _select(SHAPES[0], meta, q, w, keys, 8, scale=-DIM ** -0.5)
    assert topk_violations(worst, scores, meta.positions, RATIO, 8, rtol=RTOL_RANDOM), seed
    good = _select(SHAPES[0], meta, q, w, keys, 8)
    assert not topk_violations(good, scores, meta.positions, RATIO, 8, rtol=RTOL_RANDOM), seed
    swapped = good.clone()
    row = 0   # 50 visible entries: the row's lowest-scoring one is far below its 8th best
    swapped[row, 7] = int(torch.argmin(torch.where(torch.isfinite(scores[row]), scores[row], float("inf"))))
    assert topk_violations(swapped, scores, meta.positions, RATIO, 8, rtol=RTOL_RANDOM), seed


_toy_check_inputs = functools.partial(indexer_checks.check_inputs, heads=HEADS, dim=DIM, topk=8, block_size=BLOCK,
                                      ctx=300, new=4, short=3)   # the first-use inputs at interpreter size


def test_the_first_use_check_passes_a_right_kernel_and_fails_a_wrong_one(kernel_device, monkeypatch):
    monkeypatch.setattr(indexer_checks, "check_inputs", _toy_check_inputs)
    monkeypatch.setattr(indexer, "_FIRST_USE", {})
    assert indexer.first_use_ok(SHAPES[1], torch.device(kernel_device), torch.float32)
    wrong = IndexerXConfig(2, 16, 4, 2)
    real = indexer._launch_x
    monkeypatch.setattr(indexer, "_launch_x", lambda cfg, **a: real(cfg, **{**a, "scale": -a["scale"]}))
    assert not indexer.first_use_ok(wrong, torch.device(kernel_device), torch.float32)
    assert indexer._FIRST_USE[(wrong, str(torch.device(kernel_device)), str(torch.float32))] is False


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CANDIDATES, ids=str)
def test_every_tuner_shape_at_v4_width(cfg, kernel_device):
    """64 heads x 128, top-512, 256-token pages (64 entries each): the launches sm_90a compiles."""
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, [2200, 5], [4, 3], seed, dtype=torch.bfloat16, heads=64, dim=128,
                               block=256)
    got = _select(cfg, meta, q, w, keys, 512)
    scores = exact_scores(q, w, keys, meta, RATIO, 128 ** -0.5)
    assert not topk_violations(got, scores, meta.positions, RATIO, 512, rtol=RTOL_RANDOM), seed


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CANDIDATES, ids=str)
def test_the_first_use_check_at_v4_width(cfg, monkeypatch):
    """Its real inputs (64 heads x 128, top-512, ~3000 entries; minutes under the interpreter, so on the GPU only)."""
    monkeypatch.setattr(indexer, "_FIRST_USE", {})
    assert indexer.first_use_ok(cfg, torch.device("cuda"))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_long_streams_with_many_cuts(cfg, kernel_device):
    seed = _fresh_seed()
    meta, q, w, keys = _inputs(kernel_device, [2500, 700, 0], [9, 5, 6], seed)
    got = _select(cfg, meta, q, w, keys, 16)
    _assert_valid(got, meta, q, w, keys, 16)



@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CANDIDATES, ids=str)
def test_real_size_pipelined_shapes_on_the_gpu(cfg):
    """512 queries at the end of a 16K context (4096 entries), V4 width, bf16: each tuner shape (its first-use
    check included, through the op) a valid top-512 of the float64 scores, every slot written."""
    seed = _fresh_seed()
    meta, q, w, keys = _inputs("cuda", [16384 - 512], [512], seed, dtype=torch.bfloat16, heads=64, dim=128,
                               block=256)
    got = indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc, keys=keys,
                                     block_table=meta.block_tables, ratio=RATIO, block_size=RATIO * keys.shape[1],
                                     topk=512, scale=128 ** -0.5, config=cfg)
    scores = exact_scores(q, w, keys, meta, RATIO, 128 ** -0.5)
    assert not topk_violations(got, scores, meta.positions, RATIO, 512, rtol=RTOL_RANDOM), seed
