"""The compressor's step kernels (``step_compress_v41``) against the PyTorch math of the V4.1 step with fresh
random inputs: the pooled latents and ring updates of ratio-2 sources (decode and verify rows, padding
requests, look-backs reaching into the ring and rows past the ring's size) and the index keys and
compressed entries quantised on insert, including rows on the FP4 / E4M3 rounding ties. Triton's CPU
interpreter here, the GPU with ``-m gpu``.

Bits: the insert kernel writes the bytes of the PyTorch packing exactly. The pooled latent equals the
PyTorch math exactly on a GPU (libdevice ``exp``, IEEE division); under the interpreter numpy's ``exp``
stands in for PyTorch's CPU softmax, whose weights may differ by an fp32 ulp, so a latent may sit one
bf16 ulp away there (a small fraction of values)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels.triton.step_compress_v41 import insert_entries, pool_rows, supported  # noqa: E402
from redknot.kernels.triton.step_rope_v41 import rope_rows  # noqa: E402
from redknot.models.deepseek_v41.ref_math import apply_rope, rope_inv_freq  # noqa: E402

YARN = (16.0, 65536, 32.0, 1.0)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's RMS norm on the Triton path (``fused_rows.norm``: ``rope_rows`` without rotation)."""
    none = torch.empty(x.shape[0], 0, dtype=torch.float32, device=x.device)
    return rope_rows(x, none, none, norm_w=w, eps=eps)


def _layout(counts, pads, device):
    """Per-row facts of requests with ``counts`` rows and padding requests of ``pads`` rows (each padding row
    its own request, as the step makes them): (first, last, back, seq) [T]."""
    first, last, seq = [], [], []
    row = 0
    for b, n in enumerate(counts):
        first += [row] * n
        last += [row + n - 1] * n
        seq += [b] * n
        row += n
    for n in pads:
        for _ in range(n):
            first.append(row)
            last.append(row)
            seq.append(-1)
            row += 1
    t = torch.tensor
    first, last = t(first), t(last)
    back = torch.arange(row) - first
    return first.to(device), last.to(device), back.to(device), t(seq).to(device)


def _pool_reference(kv, gate, kv_ring, gate_ring, slot, pos, back, last, w, eps, ratio, dtype):
    """The step's PyTorch compressor (``tensor_step._compress_latent``): look-back, softmax, sum, norm, ring."""
    t = kv.shape[0]
    ring = kv_ring.shape[1]
    row = torch.arange(t, device=kv.device)
    s = torch.arange(ratio, device=kv.device)
    lpos = pos[:, None] - s
    inner = s[None, :] <= back[:, None]

    def look(ring_t, vals):
        old = ring_t.reshape(-1, ring_t.shape[-1])[slot[:, None] * ring + lpos.remainder(ring)]
        new = vals[(row[:, None] - s).clamp(min=0)]
        return torch.where(inner[..., None], new, old).flip(1)

    ka, ga = look(kv_ring, kv), look(gate_ring, gate)
    pooled = (ka * torch.softmax(ga, dim=1)).sum(1)
    latent = _norm(pooled.to(dtype), w, eps)
    keep = (last - row) < ring
    for i in range(t):                       # the rings after the step (rows kept: each request's last ``ring``)
        if keep[i]:
            dst = int(pos[i]) % ring
            kv_ring[slot[i], dst] = kv[i]
            gate_ring[slot[i], dst] = gate[i]
    return latent


POOL_CASES = [([1], (), 64), ([1, 1, 1], (2,), 64), ([4, 1, 3], (1,), 128), ([7], (), 64), ([2, 5], (), 512)]


@pytest.mark.parametrize("case", POOL_CASES)
def test_pool_rows_match_the_pytorch_compressor(case, kernel_device):
    counts, pads, d = case
    dev = kernel_device
    g = torch.Generator().manual_seed(sum(counts) * 7 + d)
    first, last, back, seq = _layout(counts, pads, dev)
    t = first.shape[0]
    n_slots, ring = len(counts) + 1, 5                     # ring 2 + backtrack 3; the spare slot last
    slot = torch.where(seq >= 0, seq, torch.full_like(seq, n_slots - 1))
    start = torch.randint(0, 40, (len(counts),), generator=g).tolist()
    pos = []
    for b, n in enumerate(counts):
        pos += list(range(start[b], start[b] + n))
    pos += torch.randint(0, 40, (t - len(pos),), generator=g).tolist()
    pos = torch.tensor(pos, device=dev)
    pos[0] = 0 if counts[0] == 1 and len(counts) > 1 else pos[0]   # a look-back before position 0
    kv = (torch.randn(t, d, generator=g) * 2).to(dev)
    gate = (torch.randn(t, d, generator=g) * 3).to(dev)
    kv_ring = (torch.randn(n_slots, ring, d, generator=g) * 2).to(dev)
    gate_ring = (torch.randn(n_slots, ring, d, generator=g) * 3).to(dev)
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16).float().to(dev)
    want_kv, want_gate = kv_ring.clone(), gate_ring.clone()
    want = _pool_reference(kv, gate, want_kv, want_gate, slot, pos, back, last, w, 1e-6, 2, torch.bfloat16)
    got = pool_rows(kv, gate, kv_ring, gate_ring, slot, pos, back, last, w, 1e-6, 2, torch.bfloat16)
    # Padding requests share the spare slot (the last): its ring and their rows are scratch.
    assert torch.equal(kv_ring[:-1], want_kv[:-1]) and torch.equal(gate_ring[:-1], want_gate[:-1])
    real = slot < n_slots - 1
    got, want = got[real].float(), want[real].float()
    if dev == "cuda":
        assert torch.equal(got, want)
        return
    differ = got != want
    assert ((got - want).abs() <= want.abs() * 2 ** -7).all()        # one bf16 ulp at most
    assert differ.float().mean().item() < 0.01, differ.float().mean().item()


def _insert_reference(keys, latent, kw, inv, pos, blocks, key_cache, ent_cache, ratio, block_size, eps):
    """The step's PyTorch inserts (``tensor_step._compress_insert``) of the rows that close a group."""
    per = block_size // ratio
    closes = (pos + 1) % ratio == 0
    ent = ((pos + 1) // ratio - 1).clamp(min=0)
    epos = ent * ratio
    col = (epos // block_size).clamp(max=blocks.shape[1] - 1)
    dest = blocks.gather(1, col[:, None])[:, 0] * per + (epos % block_size) // ratio
    k = apply_rope(_norm(keys, kw, eps), epos, inv)
    e = apply_rope(latent, epos, inv)
    idx = torch.nonzero(closes).flatten()
    key_cache[dest[idx]] = mx.pack_index_keys(k[idx])
    ent_cache[dest[idx]] = mx.pack_compressed_entries(e[idx])


def _insert_case(t, dk, dl, half, ratio, dev, seed, latent=None):
    g = torch.Generator().manual_seed(seed)
    block_size, width = 8, 4
    n_blocks = t * width + 1               # every row its own blocks: no two rows store the same page row
    keys = (torch.randn(t, dk, generator=g) * 2).to(torch.bfloat16).to(dev)
    if latent is None:
        latent = (torch.randn(t, dl, generator=g) * 2).to(torch.bfloat16)
    latent = latent.to(dev)
    kw = (1 + 0.1 * torch.randn(dk, generator=g)).to(torch.bfloat16).float().to(dev)
    inv = rope_inv_freq(2 * half, 160000.0, YARN).to(dev)
    pos = torch.randint(0, width * block_size + 6, (t,), generator=g).to(dev)  # past the table: its last block
    blocks = torch.randperm(n_blocks, generator=g)[:t * width].view(t, width).to(dev)
    per = block_size // ratio
    key_cache = torch.randint(0, 256, (n_blocks * per, dk // 2 + dk // 32), generator=g, dtype=torch.uint8).to(dev)
    ent_cache = torch.randint(0, 256, (n_blocks * per, dl // 2 + dl // 16), generator=g, dtype=torch.uint8).to(dev)
    return keys, latent, kw, inv, pos, blocks, key_cache, ent_cache, block_size


INSERT_CASES = [(3, 64, 64, 8, 2), (6, 64, 64, 8, 1), (5, 128, 512, 32, 2), (4, 32, 128, 16, 1)]


@pytest.mark.parametrize("case", INSERT_CASES)
def test_insert_entries_write_the_pytorch_bytes(case, kernel_device):
    t, dk, dl, half, ratio = case
    keys, latent, kw, inv, pos, blocks, kc, ec, bs = _insert_case(t, dk, dl, half, ratio, kernel_device, sum(case))
    want_k, want_e = kc.clone(), ec.clone()
    _insert_reference(keys, latent, kw, inv, pos, blocks, want_k, want_e, ratio, bs, 1e-6)
    insert_entries(keys, latent, kw, inv, pos, blocks, kc, ec, ratio, bs, 1e-6)
    assert int((kc != want_k).sum()) == 0 and int((ec != want_e).sum()) == 0
    assert int((want_e != _insert_case(t, dk, dl, half, ratio, kernel_device, sum(case))[7]).sum()) > 0


def test_insert_entries_are_bit_exact_at_rounding_ties(kernel_device):
    """Entries whose unrotated groups sit on the E4M3 scale's and the e2m1 codes' rounding ties (an
    approximate division lands on the other side of these)."""
    from test_step_mx_kernels import _boundary_rows

    t, dk, dl, half = 8, 64, 512, 32
    latent = _boundary_rows("compressed", t, dl, seed=5)
    keys, latent, kw, inv, pos, blocks, kc, ec, bs = _insert_case(t, dk, dl, half, 1, kernel_device, 9, latent)
    want_k, want_e = kc.clone(), ec.clone()
    _insert_reference(keys, latent, kw, inv, pos, blocks, want_k, want_e, 1, bs, 1e-6)
    insert_entries(keys, latent, kw, inv, pos, blocks, kc, ec, 1, bs, 1e-6)
    assert int((kc != want_k).sum()) == 0 and int((ec != want_e).sum()) == 0


def test_supported_widths():
    assert supported(512, 128, 32) and supported(64, 64, 8)
    assert not supported(80, 64, 8) and not supported(64, 16, 8) and not supported(64, 64, 40)
