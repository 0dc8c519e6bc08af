"""The compressor's step kernels (``step_compress_v41``) on the GPU at real V4.1 widths (latent 512, index key
128, 64 rotated dims) against the PyTorch math of the step, bit for bit: pooled latents and ring updates
for decode (batch 1, 32, 128) and verify rows, index-key and entry bytes (rounding ties included), and a
CUDA-graph replay of both kernels with fresh step contents."""
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "kernels"))

from redknot.kernels.triton.step_compress_v41 import insert_entries, pool_rows  # noqa: E402
from redknot.kernels.capture import cuda_graph
from test_step_compress_v41 import _insert_case, _insert_reference, _layout, _pool_reference  # noqa: E402
from test_step_mx_kernels import _boundary_rows  # noqa: E402

D, DK, HALF, RING = 512, 128, 32, 5


def _pool_inputs(counts, seed):
    g = torch.Generator().manual_seed(seed)
    first, last, back, seq = _layout(counts, (2,), "cuda")
    t = first.shape[0]
    n_slots = len(counts) + 1
    slot = torch.where(seq >= 0, seq, torch.full_like(seq, n_slots - 1))
    start = torch.randint(0, 5000, (len(counts),), generator=g).tolist()
    pos = [p for b, n in enumerate(counts) for p in range(start[b], start[b] + n)]
    pos = torch.tensor(pos + [3, 4], device="cuda")
    pos[0] = 0
    kv = (torch.randn(t, D, generator=g) * 2).cuda()
    gate = (torch.randn(t, D, generator=g) * 3).cuda()
    kv_ring = (torch.randn(n_slots, RING, D, generator=g) * 2).cuda()
    gate_ring = (torch.randn(n_slots, RING, D, generator=g) * 3).cuda()
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16).float().cuda()
    return kv, gate, kv_ring, gate_ring, slot, pos, back, last, w


@pytest.mark.parametrize("counts", [[1], [1] * 32, [1] * 128, [4, 1, 3, 2], [7, 4]],
                         ids=["decode1", "decode32", "decode128", "verify", "past_ring"])
def test_gpu_pool_rows_bit_exact(counts):
    kv, gate, kv_ring, gate_ring, slot, pos, back, last, w = _pool_inputs(counts, len(counts))
    want_kv, want_gate = kv_ring.clone(), gate_ring.clone()
    want = _pool_reference(kv, gate, want_kv, want_gate, slot, pos, back, last, w, 1e-6, 2, torch.bfloat16)
    got = pool_rows(kv, gate, kv_ring, gate_ring, slot, pos, back, last, w, 1e-6, 2, torch.bfloat16)
    real = slot < kv_ring.shape[0] - 1       # padding requests share the spare slot's ring (their rows: scratch)
    assert int((got[real] != want[real]).sum()) == 0, int((got[real] != want[real]).sum())
    assert torch.equal(kv_ring[:-1], want_kv[:-1]) and torch.equal(gate_ring[:-1], want_gate[:-1])


@pytest.mark.parametrize("t", [1, 32, 128])
@pytest.mark.parametrize("ratio", [1, 2])
def test_gpu_insert_entries_bit_exact(t, ratio):
    keys, latent, kw, inv, pos, blocks, kc, ec, bs = _insert_case(t, DK, D, HALF, ratio, "cuda", t + ratio)
    want_k, want_e = kc.clone(), ec.clone()
    _insert_reference(keys, latent, kw, inv, pos, blocks, want_k, want_e, ratio, bs, 1e-6)
    insert_entries(keys, latent, kw, inv, pos, blocks, kc, ec, ratio, bs, 1e-6)
    assert int((kc != want_k).sum()) == 0 and int((ec != want_e).sum()) == 0


def test_gpu_insert_entries_bit_exact_at_rounding_ties():
    latent = _boundary_rows("compressed", 48, D, seed=5)
    keys, latent, kw, inv, pos, blocks, kc, ec, bs = _insert_case(48, DK, D, HALF, 1, "cuda", 9, latent)
    want_k, want_e = kc.clone(), ec.clone()
    _insert_reference(keys, latent, kw, inv, pos, blocks, want_k, want_e, 1, bs, 1e-6)
    insert_entries(keys, latent, kw, inv, pos, blocks, kc, ec, 1, bs, 1e-6)
    assert int((kc != want_k).sum()) == 0 and int((ec != want_e).sum()) == 0


def test_gpu_compressor_kernels_replay_in_a_graph():
    """Both kernels captured once and replayed with fresh rows and positions: the replay's latents, rings
    and cache bytes equal an uncaptured run on twin buffers."""
    counts = [2, 1, 3]
    kv, gate, kv_ring, gate_ring, slot, pos, back, last, w = _pool_inputs(counts, 3)
    t = kv.shape[0]
    keys, _, kw, inv, _, blocks, kc, ec, bs = _insert_case(t, DK, D, HALF, 2, "cuda", 4)
    static = [kv, gate, pos, keys]

    def run(kv_ring, gate_ring, kc, ec):
        lat = pool_rows(static[0], static[1], kv_ring, gate_ring, slot, static[2], back, last, w, 1e-6, 2,
                        torch.bfloat16)
        insert_entries(static[3], lat, kw, inv, static[2], blocks, kc, ec, 2, bs, 1e-6)
        return lat

    run(kv_ring.clone(), gate_ring.clone(), kc.clone(), ec.clone())          # warm-up (compile)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        out = run(kv_ring, gate_ring, kc, ec)
    g = torch.Generator().manual_seed(8)
    for step in range(3):
        twins = [x.clone() for x in (kv_ring, gate_ring, kc, ec)]
        static[0].copy_(torch.randn(t, D, generator=g).cuda())
        static[1].copy_(torch.randn(t, D, generator=g).cuda())
        static[2].add_(len(counts) + step)
        static[3].copy_(torch.randn(t, DK, generator=g).to(torch.bfloat16).cuda())
        want = run(*twins)
        graph.replay()
        torch.cuda.synchronize()
        real = slot < kv_ring.shape[0] - 1
        assert torch.equal(out[real], want[real]), step
        # (the padding rows' ring stores race on the spare slot, its last one; rows own their blocks)
        assert torch.equal(kv_ring[:-1], twins[0][:-1]) and torch.equal(gate_ring[:-1], twins[1][:-1]), step
        assert torch.equal(kc, twins[2]) and torch.equal(ec, twins[3]), step
