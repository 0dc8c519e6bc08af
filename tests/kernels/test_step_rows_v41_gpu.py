"""The step's row facts, Engram hashes and Engram gate kernels on the GPU at real V4.1 sizes: 1 / 32 / 128 rows
(decode and varlen verify), block tables of a 1M-token context (4096 blocks of 256), the window / compressor /
Engram rings, the real Engram layout (2 layers, n-grams up to 4, 8 heads, primes above 16M) and a 5120-wide
hc stream of 4, 64 query heads of 512; each against the PyTorch math (the q / kv epilogue against the two
``rope_rows`` launches, bit for bit), and the row + hash launches captured in a CUDA graph (no host sync)
whose replay equals the eager call."""
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels.triton.step_engram_v41 import engram_gate_rows  # noqa: E402
from redknot.models.deepseek_v41 import fused_rows, tensor_step as ts  # noqa: E402
from redknot.models.deepseek_v41.engram_hash import DEAD, EngramHasher, EngramLayout  # noqa: E402
from redknot.kernels.capture import cuda_graph

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

DEV = "cuda"
V41 = SimpleNamespace(engram_layer_ids=[1, 14], engram_max_ngram_size=4, engram_n_heads=8,
                      engram_vocab_size=16_000_000, engram_compressed_vocab_size=99_092)


def real_step(rows: int, per_request: int, seed: int, slots: int = 160, width: int = 4096):
    g = torch.Generator().manual_seed(seed)
    req = max(1, rows // per_request)
    qsl = torch.arange(req + 1) * per_request
    pad = rows - int(qsl[-1])
    start = torch.randint(0, 1_000_000, (req,), generator=g)
    pos = torch.cat([start.repeat_interleave(per_request) + torch.arange(per_request).repeat(req),
                     torch.zeros(pad, dtype=torch.long)])
    tables = torch.randint(0, 20_000, (req, width), generator=g)
    ids = torch.randint(0, 129_280, (rows,), generator=g)
    return ts.TensorStep(ids.to(DEV), pos.to(DEV), qsl.to(DEV, torch.int32), torch.randperm(slots - 1)[:req].to(DEV),
                         tables.to(DEV, torch.int32))


def real_state(slots=160, blocks=20_001):
    srcs = {1: SimpleNamespace(ratio=1, kv_rows=None),
            2: SimpleNamespace(ratio=2, kv_rows=torch.zeros(slots, 8, 1, device=DEV))}
    return SimpleNamespace(num_slots=slots, num_blocks=blocks, sources=srcs,
                           windows=[torch.zeros(slots, 128, 1, dtype=torch.uint8, device=DEV)],
                           engram_ids=torch.randint(0, 99_092, (slots, 8), device=DEV))


@pytest.mark.parametrize("rows,per", [(1, 1), (32, 1), (128, 1), (32, 4), (30, 7)])
def test_rows_and_hashes_at_real_sizes(rows, per):
    step = real_step(rows, per, seed=rows + per)
    state = real_state()
    state.engram_ids.view(-1)[::13] = DEAD
    hs = EngramHasher(EngramLayout.create(V41, pad_c=5), device=DEV)
    g = torch.Generator().manual_seed(1)
    token_map = torch.randint(0, 99_092, (129_280,), generator=g).to(DEV)
    token_map[::97] = DEAD
    model = SimpleNamespace(hasher=hs, token_map=token_map)
    ring0 = state.engram_ids.clone()
    out = []
    for fused in (False, True):
        state.engram_ids.copy_(ring0)
        r = ts._Rows(step, state, 256, fused=fused)
        out.append((r, ts._hashes(model, step, r, state), state.engram_ids.clone()))
    (want, wh, wring), (got, gh, gring) = out
    assert got.fused and not fused_rows._FAILED
    for name in ("row", "seq", "first", "last", "back", "slot", "pos", "blocks"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for ring in (128, 8):
        assert torch.equal(got.ring_dest(ring), want.ring_dest(ring))
    for ratio in (1, 2):
        assert torch.equal(got.visible(ratio), want.visible(ratio))
    assert torch.equal(gh, wh) and torch.equal(gring, wring)


def test_rows_and_hashes_replay_in_a_cuda_graph():
    step = real_step(32, 4, seed=9)
    state = real_state()
    hs = EngramHasher(EngramLayout.create(V41, pad_c=5), device=DEV)
    model = SimpleNamespace(hasher=hs, token_map=torch.randint(0, 99_092, (129_280,), device=DEV))
    ring0 = state.engram_ids.clone()

    def run():
        r = ts._Rows(step, state, 256, fused=True)
        return r.blocks, r.ring_dest(128), ts._hashes(model, step, r, state)

    eager = run()
    eager_ring = state.engram_ids.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        static = run()
    state.engram_ids.copy_(ring0)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(static, eager))
    assert torch.equal(state.engram_ids, eager_ring)


@pytest.mark.parametrize("rows", [1, 32, 128])
def test_engram_gate_at_real_sizes(rows):
    g = torch.Generator().manual_seed(rows)
    hc, d = 4, 5120
    h = (torch.randn(rows, hc, d, generator=g) * 2).to(torch.bfloat16).to(DEV)
    kv = torch.randn(rows, (hc + 1) * d, generator=g).to(torch.bfloat16).to(DEV)
    qw, kw = (1 + 0.2 * torch.randn(2, hc, d, generator=g)).to(DEV)
    got = engram_gate_rows(h, kv, qw, kw, 1e-6).float()
    from redknot.models.deepseek_v41.engram import engram_gate
    kvf = kv.float()
    want = engram_gate(h, kvf[:, :hc * d].view(rows, hc, d), kvf[:, hc * d:], qw * kw, 1e-6).float()
    # one 16-bit ulp of the result, plus the gate's few fp32 ulps times the value (where h + g·v cancels)
    tol = 2.0 ** -7 * torch.maximum(got.abs(), want.abs()) + 1e-5 * kvf[:, None, hc * d:].abs()
    assert ((got - want).abs() <= tol).all()
    assert (got != want).float().mean().item() < 0.02


@pytest.mark.parametrize("rows", [1, 32, 128])
def test_rope_q_kv_equals_rope_rows_bit_for_bit_at_real_sizes(rows):
    """64 query heads of 512 and the 512-wide kv latent, 64 rotated dims: the one-launch epilogue equals the
    two ``rope_rows`` launches of the eager layers (compiled with the PTX ``mul.rn`` rotation)."""
    from redknot.kernels.triton.step_qkv_v41 import rope_q_kv
    from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table
    from redknot.models.deepseek_v41.ref_math import rope_inv_freq

    g = torch.Generator().manual_seed(rows)
    q = (torch.randn(rows, 64, 512, generator=g) * 3).to(torch.bfloat16).to(DEV)
    kv = (torch.randn(rows, 512, generator=g) * 2).to(torch.bfloat16).to(DEV)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16).float().to(DEV)
    pos = torch.randint(0, 1 << 20, (rows,), generator=g).to(DEV)
    cos, sin = rope_table(pos, rope_inv_freq(64, 160000.0, (16.0, 65536, 32.0, 1.0)).to(DEV))
    got_q, got_kv = rope_q_kv(q, kv, cos, sin, w, 1e-6)
    assert torch.equal(got_q, rope_rows(q, cos, sin))
    assert torch.equal(got_kv, rope_rows(kv, cos, sin, norm_w=w, eps=1e-6))
