"""The prefill step's Engram hashes in two launches (``prefill_hash_v41.prefill_hashes``) against the PyTorch math
of ``DeepseekV41._hashes`` with fresh random steps: several spans of different lengths (longer than the ring, and
shorter than the look-back), contexts below the look-back, DEAD ids in the token map and the ring. Integer math:
equal bit for bit, the ring after the write included. Triton's CPU interpreter here, the GPU with ``-m gpu``."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.prefill_hash_v41 import prefill_hashes
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.attention import Span
from redknot.models.deepseek_v41.engram_hash import DEAD, EngramHasher, EngramLayout
from redknot.models.deepseek_v41.model import DeepseekV41


def _hasher(max_ngram: int, heads: int, device):
    cfg = SimpleNamespace(engram_layer_ids=[1, 4], engram_max_ngram_size=max_ngram, engram_n_heads=heads,
                          engram_vocab_size=50, engram_compressed_vocab_size=40)
    return EngramHasher(EngramLayout.create(cfg, pad_c=3), device=device)


def _fake_ops(triton: bool):
    choice = {op: "triton" if triton else "reference"
              for op in ("sparse_attention_mx", "indexer_topk_mx", "cache_insert_mx")}
    return SimpleNamespace(ops=SimpleNamespace(attention=True, choice=choice))


# spans' lengths, their contexts, the ring size, max n-gram, heads, the first span's step row
CASES = [((20,), (0,), 8, 4, 3, 0), ((5, 1, 140), (3, 0, 7), 6, 3, 2, 0), ((2, 9, 3, 4), (1, 40, 0, 2), 4, 4, 1, 3),
         ((1,), (500,), 5, 2, 2, 2)]


@pytest.mark.parametrize("case", CASES)
def test_prefill_hashes_equal_the_pytorch_math(case, kernel_device):
    lens, ctxs, ring_size, max_ngram, heads, first = case
    g = torch.Generator().manual_seed(7 + sum(lens) + ring_size)
    slots = torch.randperm(9, generator=g)[:len(lens)].tolist()
    spans, at = [], first
    for n, c, s in zip(lens, ctxs, slots):
        spans.append(Span(at, n, c, s, torch.zeros(4, dtype=torch.long, device=kernel_device)))
        at += n
    token_map = torch.randint(0, 40, (60,), generator=g)
    token_map[torch.randint(0, 60, (8,), generator=g)] = DEAD
    ids = torch.randint(0, 60, (at,), generator=g).to(kernel_device)
    ring = torch.randint(0, 40, (9, ring_size), generator=g)
    ring[torch.rand(ring.shape, generator=g) < 0.1] = DEAD
    results = []
    for triton in (False, True):
        model = SimpleNamespace(hasher=_hasher(max_ngram, heads, kernel_device), token_map=token_map.to(kernel_device),
                                w=_fake_ops(triton))
        state = SimpleNamespace(engram_ids=ring.clone().to(kernel_device))
        calls = []
        import redknot.kernels.triton.prefill_hash_v41 as ph

        real = ph.prefill_hashes

        def counted(*a, _calls=calls, _real=real, **k):
            _calls.append(1)
            return _real(*a, **k)
        ph.prefill_hashes = counted
        try:
            out = DeepseekV41._hashes(model, ids, spans, state)
        finally:
            ph.prefill_hashes = real
        assert len(calls) == int(triton)
        results.append((out, state.engram_ids.clone()))
    (want, want_ring), (got, got_ring) = results
    assert not fused_rows._FAILED
    assert got.shape == want.shape == (at - first, 2, (max_ngram - 1) * heads)
    assert torch.equal(got, want)
    assert torch.equal(got_ring, want_ring)
    assert not torch.equal(want_ring.cpu(), ring)     # the step wrote the ring


def test_prefill_hashes_off_runs_the_pytorch_math(kernel_device, monkeypatch):
    """``PREFILL_ROWS["hashes"]`` off: no launch (the on/off comparison of ``e2e_v41`` relies on it)."""
    import redknot.kernels.triton.prefill_hash_v41 as ph

    monkeypatch.setitem(fused_rows.PREFILL_ROWS, "hashes", False)
    monkeypatch.setattr(ph, "prefill_hashes", lambda *a, **k: pytest.fail("launched while off"))
    model = SimpleNamespace(hasher=_hasher(3, 2, kernel_device), token_map=torch.arange(60, device=kernel_device),
                            w=_fake_ops(True))
    state = SimpleNamespace(engram_ids=torch.zeros(2, 4, dtype=torch.long, device=kernel_device))
    spans = [Span(0, 3, 0, 1, torch.zeros(4, dtype=torch.long, device=kernel_device))]
    out = DeepseekV41._hashes(model, torch.arange(3, device=kernel_device), spans, state)
    assert out.shape == (3, 2, 4)


def test_prefill_hashes_refuses_bad_tables():
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="spans"):
        prefill_hashes(z, z, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                       torch.ones(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long),
                       torch.zeros(1, 4, dtype=torch.long), 0)


@pytest.mark.gpu
def test_gpu_prefill_hashes_real_sizes():
    """Two spans of 8000 and 192 rows (8192 in all) with the V4.1 Engram layout (n-grams up to 4, 8 heads)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = "cuda"
    g = torch.Generator().manual_seed(1)
    cfg = SimpleNamespace(engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8,
                          engram_vocab_size=100000, engram_compressed_vocab_size=99092)
    token_map = torch.randint(0, 99092, (129280,), generator=g)
    token_map[torch.randint(0, 129280, (500,), generator=g)] = DEAD
    spans = [Span(0, 8000, 0, 3, torch.zeros(4, dtype=torch.long, device=dev)),
             Span(8000, 192, 16384, 5, torch.zeros(4, dtype=torch.long, device=dev))]
    ids = torch.randint(0, 129280, (8192,), generator=g).to(dev)
    ring = torch.randint(0, 99092, (8, 4), generator=g)
    results = []
    for triton in (False, True):
        model = SimpleNamespace(hasher=EngramHasher(EngramLayout.create(cfg, pad_c=7), device=dev),
                                token_map=token_map.to(dev), w=_fake_ops(triton))
        state = SimpleNamespace(engram_ids=ring.clone().to(dev))
        results.append((DeepseekV41._hashes(model, ids, spans, state), state.engram_ids.clone()))
    (want, want_ring), (got, got_ring) = results
    assert not fused_rows._FAILED
    assert got.shape == (8192, 2, 24) and torch.equal(got, want) and torch.equal(got_ring, want_ring)
