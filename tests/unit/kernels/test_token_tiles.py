"""The indexer's token tiles in one launch (``indexer._token_tiles``) against the PyTorch ops they replace
(``token_tiles_torch``): equal arrays for decode steps, verify steps, prefill chunks and empty sequences."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import indexer

# (tokens per sequence, block_t): decode at batch 1 / 5 / 130 (more sequences than one block of lanes), verify
# steps of 3, a prefill chunk with a long and a short sequence, sequences without tokens among others
CASES = [([1], 1), ([1] * 5, 2), ([1] * 130, 1), ([3, 3, 3], 2), ([700, 5], 2), ([0, 4, 0, 9, 1], 4),
         ([33], 8)]


@pytest.mark.parametrize("lengths,block_t", CASES, ids=[f"{len(n)}seq-bt{b}" for n, b in CASES])
def test_token_tiles_launch_equals_the_torch_ops(lengths, block_t, kernel_device):
    qsl = torch.tensor([0] + lengths, device=kernel_device).cumsum(0).to(torch.int32)
    T = sum(lengths)
    got = indexer.token_tiles_launch(qsl, T, block_t)
    want = indexer.token_tiles_torch(qsl, T, block_t)
    for g, w in zip(indexer.token_tiles(qsl, T, block_t)[:3], got[:3]):   # the dispatch takes the launch here
        assert torch.equal(g, w)
    assert got[3] == want[3]
    for g, w in zip(got[:3], want[:3]):
        assert g.dtype == torch.int32 and torch.equal(g, w)
    tok, length, seq = (t.cpu() for t in got[:3])   # every token in exactly one tile of its own sequence
    covered = torch.zeros(T, dtype=torch.int64)
    for t0, n, b in zip(tok.tolist(), length.tolist(), seq.tolist()):
        if n:
            assert qsl[b] <= t0 and t0 + n <= qsl[b + 1] and n <= block_t
            covered[t0:t0 + n] += 1
    assert torch.equal(covered, torch.ones(T, dtype=torch.int64))
