"""The decode merge of V4's paged indexer (``_indexer_merge`` with ``SORTED_SPLITS``: the best K over the entry
splits' descending lists by bitonic merges) against the thresholded-buffer merge and a PyTorch top-k of the
lists' union on fresh random keys, and the op with many splits against the float64 order (integer-valued
scores: exact ties, lower id first). Triton's CPU interpreter here, on the GPU where there is one."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import indexer  # noqa: E402
from redknot.kernels.triton.checks.common import paged_step  # noqa: E402
from redknot.kernels.triton.checks.indexer import _exact_order, exact_scores  # noqa: E402

EMPTY = -9223372036854775807


def _lists(tokens: int, nsplit: int, k: int, seed: int, device):
    """[tokens * nsplit, k] packed keys, each row descending and padded with the empty key (some rows short or
    empty; the last token's rows together fewer than k), the ids distinct per token as the splits' entry ranges
    are."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for t in range(tokens):
        ids = torch.randperm(nsplit * k * 2, generator=g)[:nsplit * k].view(nsplit, k)
        for s in range(nsplit):
            n = int(torch.randint(0, k + 1, (), generator=g)) if s % 3 == 1 else k
            n = k // (2 * nsplit) if t == tokens - 1 else n
            score = torch.randint(-20, 20, (k,), generator=g).float() if t % 2 else torch.randn(k, generator=g)
            bits = score.view(torch.int32).long()
            ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
            key = (ordered << 32) | (2147483647 - ids[s].long())
            key = torch.where(torch.arange(k) < n, key, torch.full_like(key, EMPTY))
            rows.append(key.sort(descending=True).values)
    return torch.stack(rows).to(device)


def _merge(cand, tokens, nsplit, k, sorted_splits):
    out = torch.full((tokens, k), -7, dtype=torch.int32, device=cand.device)
    cap = 2 * k
    buf = torch.empty(tokens * nsplit, cap, dtype=torch.int64, device=cand.device)
    indexer._indexer_merge[(tokens,)](cand, buf, out, out.stride(0), nsplit, K=k, CAP=cap, ONE_SPLIT=nsplit == 1,
                                      SORT=False, SORTED_SPLITS=sorted_splits, LOG_K=k.bit_length() - 1,
                                      num_warps=4)
    return out


@pytest.mark.parametrize("nsplit,k", [(2, 16), (5, 32), (32, 16)])
def test_bitonic_merge_equals_the_buffer_merge_and_the_union_topk(nsplit, k, kernel_device):
    tokens = 4
    cand = _lists(tokens, nsplit, k, 100 * nsplit + k, kernel_device)
    got = _merge(cand, tokens, nsplit, k, True)
    assert torch.equal(got, _merge(cand, tokens, nsplit, k, False))
    union = cand.view(tokens, nsplit * k)
    best = union.topk(k, dim=1).values  # distinct keys: one order
    want = torch.where(best == EMPTY, -1, 2147483647 - (best & 0xFFFFFFFF))
    assert torch.equal(got.long(), want)
    assert (got[-1] == -1).any() and not (got[0] == -1).any()  # the last token's keys padded


def test_a_merge_that_skips_the_order_fails(kernel_device):
    """Negative control: the maxima of two descending lists not reversed are not the best K."""
    cand = _lists(2, 2, 16, 7, kernel_device)
    a, b = cand.view(2, 2, 16).unbind(1)
    wrong = torch.maximum(a, b)
    right = torch.cat([a, b], 1).topk(16, dim=1).values
    assert not torch.equal(wrong.sort(1, descending=True).values, right)


@pytest.mark.parametrize("nsplit", [3, 8, 12])
def test_decode_with_many_splits_keeps_the_exact_order(nsplit, kernel_device):
    """Decode rows (one query per sequence) over many entries split ``nsplit`` ways, integer-valued scores:
    exactly the float64 order, ties by the lower id."""
    gen = torch.Generator().manual_seed(31 + nsplit)
    ratio, block, heads, dim, topk = 4, 16, 5, 32, 16
    step = paged_step([600, 130, 7], [1, 1, 1], block, kernel_device, gen)
    t = step.num_tokens
    q = torch.randint(-2, 3, (t, heads, dim), generator=gen).float().to(kernel_device)
    w = torch.randint(-2, 3, (t, heads), generator=gen).float().to(kernel_device)
    keys = torch.randint(-2, 3, (step.num_blocks, block // ratio, dim), generator=gen).float().to(kernel_device)
    meta = step.meta
    out = torch.full((t, topk), -7, dtype=torch.long, device=kernel_device)
    indexer.indexer_topk_paged(q, w, positions=meta.positions, query_start_loc=meta.query_start_loc, keys=keys,
                               block_table=meta.block_tables, ratio=ratio, block_size=block, topk=topk,
                               scale=dim ** -0.5, out=out,
                               config=indexer.IndexerConfig(block_t=1, block_n=16, num_splits=nsplit))
    want = _exact_order(exact_scores(q, w, keys, meta, ratio, dim ** -0.5), topk)
    assert torch.equal(out, want.to(out.device).long())


def test_bitonic_merge_at_v4_width(kernel_device):
    """Top-512 over 32 splits (a 128K-token decode row of V4's CSA layers)."""
    cand = _lists(2, 32, 512, 5, kernel_device)
    got = _merge(cand, 2, 32, 512, True)
    best = cand.view(2, 32 * 512).topk(512, dim=1).values
    assert torch.equal(got.long(), torch.where(best == EMPTY, -1, 2147483647 - (best & 0xFFFFFFFF)))


@pytest.mark.parametrize("tokens,nsplit,k", [(3, 8, 16), (2, 12, 32), (2, 32, 512), (2, 6, 16)])
def test_merge_tree_equals_the_union_topk(tokens, nsplit, k, kernel_device):
    """``merge_sorted_splits``: with many splits a first launch merges groups of lists and a second the groups'
    lists (8, 12, 32 splits); with few (6: not a multiple of the fan-in) one launch. Either way the ids of the
    best K keys of the union, in descending key order."""
    cand = _lists(tokens, nsplit, k, 7 * nsplit + k, kernel_device)
    out = torch.full((tokens, k), -7, dtype=torch.int32, device=kernel_device)
    buf = torch.empty(tokens * nsplit, 2 * k, dtype=torch.int64, device=kernel_device)
    got = indexer.merge_sorted_splits(cand, buf, out, nsplit, k, 2 * k)
    best = cand.view(tokens, nsplit * k).topk(k, dim=1).values
    assert torch.equal(got.long(), torch.where(best == EMPTY, -1, 2147483647 - (best & 0xFFFFFFFF)))
    assert torch.equal(got, _merge(cand, tokens, nsplit, k, True))
