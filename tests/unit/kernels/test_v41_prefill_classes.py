"""A long V4.1 prefill meets no kernel shape class its warm-up did not compile and tune.

The 1M-token prefill of ``benchmarks/e2e_v41.py`` (5-layer cut, 8192-token chunks) warms one chunk per
shape class (``warm_classes``) and then times every chunk. Any launch whose tuning class (a
``ConfigTuner`` key) or compiled specialisation (the kernel's constexprs, and for each integer argument
what Triton specialises on: equal to 1, divisible by 16, 32- or 64-bit) differs from every warmed one
costs a compile, or a tuning pass, inside a timed chunk. This walks the model's own indexer dispatch
(``kernel_ops.index_spans`` over the cut's three index sources at real V4.1 widths) on ``meta`` tensors,
so it costs no memory and no kernel runs: the tuners and the two Triton launches are replaced by
recorders that keep the key and the specialisation of each call, on an H200's 132 multiprocessors (the
candidate source's block selection, ``radix_select``, included).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from redknot.kernels.triton import _common, indexer_mx, ops_mx, radix_select
from redknot.models.deepseek_v41 import kernel_ops
from redknot.models.deepseek_v41.attention import Slots, Span

ROOT = Path(__file__).resolve().parents[3]
CHUNK = 8192
H200_SMS = 132
PAGE = 256   # positions per page of the block table (any multiple of the ratios: indices stay shapes here)


def _spec(v):
    """What Triton's launcher specialises a runtime argument on."""
    if isinstance(v, bool):
        return ("bool", v)
    if isinstance(v, int):
        return ("i32" if -2**31 <= v < 2**31 else "i64", v == 1, v % 16 == 0)
    if isinstance(v, torch.Tensor):
        return ("ptr", v.dtype)
    return (type(v).__name__,)


class _Launch:
    """Stands for a ``@triton.jit`` kernel: ``kernel[grid](*args, **constexprs)`` records the call's
    compiled specialisation instead of launching."""

    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append(("launch", self.name, tuple(_spec(a) for a in args), tuple(sorted(kw.items()))))
        return launch


@pytest.fixture
def recorder(monkeypatch):
    seen: list = []

    def pick(tuner, key, run, device):
        seen.append(("tune", tuner.name, key))
        return tuner.candidates[0]

    monkeypatch.setattr(_common.ConfigTuner, "pick", pick)
    monkeypatch.setattr(indexer_mx, "sm_count", lambda t: H200_SMS)
    monkeypatch.setattr(indexer_mx, "_index_stream", _Launch("_index_stream", seen))
    monkeypatch.setattr(indexer_mx, "_indexer_merge", _Launch("_indexer_merge", seen))
    monkeypatch.setattr(indexer_mx, "_index_scores", _Launch("_index_scores", seen))
    monkeypatch.setattr(radix_select, "_radix_select", _Launch("_radix_select", seen))
    return seen


def _cut():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e_v41
    finally:
        sys.path.pop(0)
    return e2e_v41, e2e_v41.cut_config(False, 1027)


def _chunk_classes(cfg, start: int, seen: list) -> set:
    """The (tuning key | specialisation) set of one prefill chunk's indexer calls at ``start``."""
    dev = torch.device("meta")
    ops = SimpleNamespace(indexer_topk_mx=ops_mx.indexer_topk_mx, indexer_source_mx=ops_mx.indexer_source_mx)
    end = start + CHUNK
    sp = Span(start=0, n=CHUNK, ctx=start, slot=0, blocks=torch.empty(end // PAGE + 1, dtype=torch.long, device=dev))
    sources = {}
    for layer_id in cfg.kv_source_layers:
        r = cfg.compress_ratios[layer_id]
        sources[layer_id] = SimpleNamespace(ratio=r, keys=torch.empty(end // PAGE + 1, PAGE // r, 68,
                                                                      dtype=torch.uint8, device=dev))
    state = SimpleNamespace(sources=sources, layout=SimpleNamespace(block_size=PAGE))
    slots = Slots()
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    q = torch.empty(CHUNK, hi, di, dtype=torch.bfloat16, device=dev)
    wts = torch.empty(CHUNK, hi, dtype=torch.float32, device=dev)
    pos = torch.empty(CHUNK, dtype=torch.long, device=dev)
    del seen[:]
    for layer_id in cfg.index_source_layers:
        layer = SimpleNamespace(cfg=cfg, w=SimpleNamespace(ops=ops), layer=layer_id, ratio=cfg.compress_ratios[layer_id],
                                kv_source=cfg.kv_source_of(layer_id), index_keys="stored",
                                num=SimpleNamespace(act_quant=True))
        topk = torch.empty(CHUNK, cfg.index_topk, dtype=torch.long, device=dev)
        kernel_ops.index_spans(layer, q, wts, pos, [sp], state, slots, topk)
    assert any(s[0] == "launch" for s in seen)
    return set(seen)


def _warm_starts(e2e_v41, contexts, monkeypatch) -> list:
    """The chunk starts ``warm_classes`` runs for these prefills, in order (its own rule, its model stubbed)."""
    starts: list = []

    class Batch:
        def __init__(self, model, b, cap):
            self.lens = [0]

        def step(self, ids):
            starts.append(self.lens[0])

    monkeypatch.setattr(e2e_v41, "Batch", Batch)
    monkeypatch.setattr(e2e_v41, "print", lambda *a, **k: None)
    warmed: set = set()
    model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=1000))
    for ctx in contexts:
        e2e_v41.warm_classes(model, ctx, CHUNK, torch.device("cpu"), warmed)
    return starts


def test_a_1m_prefill_meets_only_warmed_classes(recorder, monkeypatch):
    """Every chunk of the 128K and 1M prefills (as the benchmark runs them) calls the indexers with tuning
    keys and specialisations its warm-up already met; in particular the chunks at 262144, 270336, 524288
    and 778240, where the candidate source's block scores first split a chunk in two, three and four token
    pieces (the H200 run spent 18-57 s there)."""
    e2e_v41, cfg = _cut()
    warm_starts = _warm_starts(e2e_v41, (131072, 1 << 20), monkeypatch)
    assert warm_starts and max(warm_starts) <= 131072
    warm: set = set()
    for s in warm_starts:
        warm |= _chunk_classes(cfg, s, recorder)
    new = {}
    for s in range(0, 1 << 20, CHUNK):
        extra = _chunk_classes(cfg, s, recorder) - warm
        if extra:
            new[s] = sorted(map(str, extra))
    assert not new, f"chunks meeting classes the warm-up did not: {dict(list(new.items())[:4])}"


def test_the_block_score_pieces_keep_the_chunk_class(recorder):
    """At 1M entries the candidate source's [tokens, blocks] scores cut an 8192-token chunk into pieces of
    equal multiples of 16, all above 512 tokens (one tuning class), within the scratch budget."""
    e2e_v41, cfg = _cut()
    nb = (1 << 20) // cfg.candidate_block_size
    pieces = indexer_mx._chunks(CHUNK, 4 * nb, indexer_mx.MAX_SCRATCH_BYTES)
    sizes = [b - a for a, b in pieces]
    assert len(sizes) > 1 and sum(sizes) == CHUNK
    assert all(x % 16 == 0 and x > 512 and 4 * nb * x <= indexer_mx.MAX_SCRATCH_BYTES for x in sizes)
    assert max(sizes) - min(sizes) <= 16


@pytest.mark.parametrize("t,per,limit", [(8192, 4 * 33792, 1 << 30), (8200, 1, 1000), (8207, 3, 1000), (33, 1, 16),
                                         (7, 120, 480), (5000, 7, 1 << 20), (1000, 1, 999)])
def test_chunks_cover_the_tokens_within_the_budget(t, per, limit):
    """Token chunks tile [0, t) in order, each within the budget (one token at least), all multiples of 16
    but the last when the budget allows 16 tokens."""
    pieces = indexer_mx._chunks(t, per, limit)
    step = max(1, min(t, limit // per))
    assert pieces[0][0] == 0 and pieces[-1][1] == t
    assert all(a < b and b - a <= step for a, b in pieces)
    assert all(pieces[i][1] == pieces[i + 1][0] for i in range(len(pieces) - 1))
    if step >= 16:
        assert all((b - a) % 16 == 0 for a, b in pieces[:-1])
