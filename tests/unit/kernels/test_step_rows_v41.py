"""The step's per-row facts and Engram hashes in one launch each (``step_rows_v41``) against the PyTorch math
of ``tensor_step._Rows`` / ``_hashes`` with fresh random steps: variable-length requests, padding rows, DEAD
ids, positions below the look-back, rings shorter than a request. Integer math: equal bit for bit, the
Engram ring after the write included. Triton's CPU interpreter here, the GPU with ``-m gpu``."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.step_rows_v41 import FIELDS, step_hashes, step_rows  # noqa: E402
from redknot.models.deepseek_v41 import fused_rows, tensor_step as ts  # noqa: E402
from redknot.models.deepseek_v41.engram_hash import DEAD, EngramHasher, EngramLayout  # noqa: E402


def random_step(seed: int, device, requests: int, pad_rows: int, width: int, slots: int = 9, blocks: int = 40,
                max_rows: int = 5):
    """A padded varlen step: each request 1..max_rows rows at consecutive positions, then padding rows."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_rows + 1, (requests,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    t = int(qsl[-1]) + pad_rows
    start = torch.randint(0, 300, (requests,), generator=g)
    pos = torch.zeros(t, dtype=torch.long)
    for r in range(requests):
        pos[qsl[r]:qsl[r + 1]] = start[r] + torch.arange(int(lens[r]))
    pos[int(qsl[-1]):] = torch.randint(0, 50, (pad_rows,), generator=g)
    seq_slots = torch.randperm(slots - 1, generator=g)[:requests]
    tables = torch.randint(0, blocks - 1, (requests, width), generator=g)
    ids = torch.randint(0, 60, (t,), generator=g)
    step = ts.TensorStep(ids, pos, qsl.to(torch.int32), seq_slots, tables.to(torch.int32))
    return ts.TensorStep(*(x.to(device) for x in (step.input_ids, step.positions, step.query_start_loc,
                                                 step.seq_slots, step.block_tables)))


def fake_state(device, slots=9, blocks=40, windows=(8, 8, 16), comp_ring=4, engram_ring=6, ratios=(1, 2)):
    srcs = {i: SimpleNamespace(ratio=r, kv_rows=torch.zeros(slots, comp_ring, 2, device=device) if r == 2 else None)
            for i, r in enumerate(ratios)}
    return SimpleNamespace(num_slots=slots, num_blocks=blocks, sources=srcs,
                           windows=[torch.zeros(slots, w, 3, dtype=torch.uint8, device=device) for w in windows],
                           engram_ids=torch.zeros(slots, engram_ring, dtype=torch.long, device=device))


CASES = [(1, 0, 4), (3, 2, 7), (6, 5, 33), (2, 0, 1)]     # requests, padding rows, block-table width


@pytest.mark.parametrize("case", CASES)
def test_row_facts_equal_the_pytorch_rows(case, kernel_device):
    req, pad, width = case
    step = random_step(sum(case), kernel_device, req, pad, width)
    state = fake_state(kernel_device)
    want = ts._Rows(step, state, 16)
    got = ts._Rows(step, state, 16, fused=True)
    assert got.fused and not want.fused and not fused_rows._FAILED
    for name in FIELDS + ("pos", "blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for ring in (8, 16, 4, 6, 5):           # 5: no ring of that size, the PyTorch math on demand
        assert torch.equal(got.ring_dest(ring), want.ring_dest(ring)), ring
    for ratio in (1, 2, 4):
        assert torch.equal(got.visible(ratio), want.visible(ratio)), ratio


def test_step_rows_refuses_too_many_ring_sizes():
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="rings"):
        step_rows(z, z, z[:1], z[:1, None], 1, 1, [1, 2, 3, 4, 5], [])


def hasher(max_ngram=3, heads=2, layers=(1, 4)):
    cfg = SimpleNamespace(engram_layer_ids=list(layers), engram_max_ngram_size=max_ngram, engram_n_heads=heads,
                          engram_vocab_size=50, engram_compressed_vocab_size=40)
    return EngramHasher(EngramLayout.create(cfg, pad_c=3))


@pytest.mark.parametrize("case", [(1, 0, 3, 2), (4, 3, 3, 2), (5, 2, 4, 3), (3, 1, 2, 1)])
def test_hashes_and_ring_write_equal_the_pytorch_math(case, kernel_device):
    req, pad, max_ngram, heads = case
    g = torch.Generator().manual_seed(100 + sum(case))
    step = random_step(sum(case), kernel_device, req, pad, 3, max_rows=4)
    state = fake_state(kernel_device, engram_ring=max_ngram + req % 2)   # writes land where rows read
    hs = hasher(max_ngram, heads)
    hs.primes, hs.offsets, hs.multipliers = (x.to(kernel_device) for x in (hs.primes, hs.offsets, hs.multipliers))
    token_map = torch.randint(0, 40, (60,), generator=g)
    token_map[torch.randint(0, 60, (8,), generator=g)] = DEAD
    ring = torch.randint(0, 40, state.engram_ids.shape, generator=g)
    ring[torch.rand(ring.shape, generator=g) < 0.1] = DEAD
    model = SimpleNamespace(hasher=hs, token_map=token_map.to(kernel_device))
    results = []
    for fused in (False, True):
        state.engram_ids = ring.clone().to(kernel_device)
        rows = ts._Rows(step, state, 16, fused=fused)
        results.append((ts._hashes(model, step, rows, state), state.engram_ids.clone()))
    (want, want_ring), (got, got_ring) = results
    assert got.shape == want.shape == (step.input_ids.shape[0], 2, (max_ngram - 1) * heads)
    assert not fused_rows._FAILED
    assert torch.equal(got, want)
    assert torch.equal(got_ring, want_ring)
    assert not torch.equal(want_ring.cpu(), ring)     # the step wrote the ring


def test_step_hashes_refuses_mismatched_columns():
    z = torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="primes"):
        step_hashes(z, z, torch.zeros(1, 4, dtype=torch.long), z, z, z, z, torch.ones(1, 3, dtype=torch.long),
                    torch.ones(1, 5, dtype=torch.long), torch.zeros(1, 5, dtype=torch.long), 0)
