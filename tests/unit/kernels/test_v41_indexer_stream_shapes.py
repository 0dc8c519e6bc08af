"""Every launch shape the indexer's stream tuner may pick (``indexer_mx.STREAM_TUNER.candidates``) selects
exactly what the PyTorch scores select with the model's tie rule, in each of the stream's three uses:
the plain top-k (tokens sharing key blocks, several buffer cuts), the candidate source's pass that also
writes block maxima, and the walk over each token's candidate list. The tuner keeps the fastest shape
on a GPU, so none may change a selection (Triton interpreter, small widths). The top-k / source-pass test
runs one shape of each kernel variant by default and every shape with ``-m slow``; the candidate walk
(cheap) runs every shape by default."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41
from redknot.kernels.triton import indexer_mx
from redknot.models.deepseek_v41.ref_math import index_qdq, topk_ids

CANDIDATES = indexer_mx.STREAM_TUNER.candidates


def _variant(config):
    """What makes a shape a different interpreted program: everything but the tokens per program (every shape
    meets a partial token tile with these 5 tokens) and ``num_warps`` / ``num_stages`` / ``max_regs`` (no effect
    on the interpreter's arithmetic; the GPU tests compile each shape)."""
    return dataclasses.replace(config, block_t=0, num_warps=0, num_stages=0, max_regs=0)


def _first_of_each_variant(configs):
    """Each candidate as a parameter: the first of each kernel variant (key decode, entries per step, prefetch,
    head sum, splits) runs by default, the others of the same variant with ``-m slow`` (~8 s each interpreted)."""
    seen, params = set(), []
    for config in configs:
        key = _variant(config)
        marks = [pytest.mark.slow] if key in seen else []
        seen.add(key)
        params.append(pytest.param(config, marks=marks, id=str(config)))
    return params


def _inputs(t, n, heads=4, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = index_qdq(torch.randn(t, heads, dim, generator=g).bfloat16()).float()
    keys = mx.pack_index_keys(torch.randn(n, dim, generator=g))
    w = torch.randn(t, heads, generator=g) * dim ** -0.5
    vis = torch.randint(1, n + 1, (t,), generator=g, dtype=torch.int32)
    vis[0] = n
    vis[1] = 0
    return q, w, keys, vis


def _scores(q, w, keys, vis, bf16, allowed=None):
    n = keys.shape[0]
    s = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys), bf16)
    ok = torch.arange(n)[None] < vis.long()[:, None]
    if allowed is not None:
        ok = ok & allowed
    return s.masked_fill(~ok, float("-inf"))


def _want(s, k):
    """The k best ids per row (-inf: never), ties to the lower id (the model's ``topk_ids``), ascending, -1."""
    kk = min(k, s.shape[1])
    ids = topk_ids(s, kk)
    big = torch.iinfo(torch.int32).max
    ids = torch.where(s.gather(1, ids) > float("-inf"), ids, big).sort(1).values
    ids = torch.where(ids == big, -1, ids)
    return torch.cat([ids, ids.new_full((s.shape[0], k - kk), -1)], 1)


@pytest.mark.parametrize("config", _first_of_each_variant(CANDIDATES))
def test_every_stream_shape_selects_the_reference(config):
    """Plain top-k over 520 entries (the 128-entry shapes cut their buffer several times) and the source
    pass with block maxima, bf16 score arithmetic (many ties at the cut)."""
    q, w, keys, vis = _inputs(5, 520, seed=4)
    s = _scores(q, w, keys, vis, True)
    got = indexer_mx.stream_topk(q, w, keys, vis, 16, True, config=config)
    assert torch.equal(got.long(), _want(s, 16))
    bs = 8
    nb = -(-520 // bs)
    bm = torch.full((5, nb), float("-inf"))
    got = indexer_mx.stream_topk(q, w, keys, vis, 16, True, config=config, block_scores=bm, block_size=bs)
    assert torch.equal(got.long(), _want(s, 16))
    want_bm = torch.nn.functional.pad(s, (0, nb * bs - 520), value=float("-inf")).view(5, nb, bs).amax(-1)
    assert torch.equal(bm, want_bm)


@pytest.mark.parametrize("config", CANDIDATES, ids=str)
def test_every_stream_shape_selects_inside_candidate_blocks(config):
    """The walk over each token's candidate list (one token per program; -1 pads, a row without any)."""
    q, w, keys, vis = _inputs(4, 500, seed=9)
    g = torch.Generator().manual_seed(3)
    cand = torch.stack([torch.randperm(63, generator=g)[:24] for _ in range(4)]).int()
    cand[2, 5:] = -1
    cand[3] = -1
    allowed = torch.zeros(4, 64, dtype=torch.bool)
    allowed.scatter_(1, torch.where(cand >= 0, cand.long(), 63), True)
    allowed[3] = False
    allowed = allowed[:, :63].repeat_interleave(8, 1)[:, :500]
    s = _scores(q, w, keys, vis, True, allowed)
    got = indexer_mx.stream_topk(q, w, keys, vis, 16, True, config=config, block_size=8, cand_blocks=cand)
    assert torch.equal(got.long(), _want(s, 16))
