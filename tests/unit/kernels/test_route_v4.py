"""V4's MoE routing in one launch (``triton.route``, the Triton backend's ``route`` op) against the reference op:
top-k of affinities + bias and hash-table routing, the renormalised weights; through the interpreter on the CPU."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import reference
from redknot.kernels.triton import ops as triton_ops
from redknot.kernels.triton import route


def _scores(T, E, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, E, generator=g, device=device) * 2
    bias = torch.randn(E, generator=g, device=device) * 0.1
    return scores, bias, g


@pytest.mark.parametrize("T,E,k", [(1, 256, 6), (5, 256, 6), (3, 7, 3), (2, 384, 6)])
def test_top_k_routing_matches_the_reference(T, E, k, kernel_device):
    scores, bias, _ = _scores(T, E, T + E, kernel_device)
    ids = torch.zeros(T, dtype=torch.long, device=kernel_device)
    got = triton_ops.route_op(scores, bias, None, ids, k, 2.5)
    want = reference.route(scores, bias, None, ids, k, 2.5)
    assert got[0].dtype == torch.int64 and torch.equal(got[0], want[0])   # distinct values: the same order
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1].sum(-1), torch.full((T,), 2.5, device=kernel_device))


def test_hash_routing_matches_the_reference(kernel_device):
    scores, _, g = _scores(4, 64, 3, kernel_device)
    tid2eid = torch.randint(0, 64, (50, 6), generator=g, device=kernel_device, dtype=torch.int32)
    ids = torch.tensor([7, 0, 49, 7], device=kernel_device)
    got = route.route(scores, None, tid2eid, ids, 6, 1.5)
    want = reference.route(scores, None, tid2eid, ids, 6, 1.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[0], tid2eid[ids].long())
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert(kernel_device):
    """Equal affinities + bias: the chosen set is a valid top-k, best first, the lower id first among ties."""
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.5]], device=kernel_device)
    bias = torch.zeros(6, device=kernel_device)
    ids, w = route.route(scores, bias, None, torch.zeros(1, dtype=torch.long, device=kernel_device), 4, 1.0)
    assert ids.tolist() == [[1, 3, 2, 4]]
    torch.testing.assert_close(w, torch.tensor([[0.3, 0.3, 0.2, 0.2]], device=kernel_device))
