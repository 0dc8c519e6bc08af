"""The in-register decodes of the V4.1 cache rows (Triton interpreter) equal the byte formats' PyTorch
unpacking bit for bit: compressed entries (packed e2m1, e4m3 per 16) and index keys (packed e2m1, E8M0 per
32) through the fp16 route of ``quant_mx.e2m1_half``, window rows (e4m3, E8M0 per 32) -- every code of both
signs, zero and tiny scales, all-zero rows, random bytes (every scale byte the formats can hold); and the
prefill-only attention launch shapes against the reference attention (toy sizes; real sizes with -m gpu)."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton.attention_mx import _compressed_keys, _window_keys
from redknot.kernels.triton.indexer_kernels_mx import _index_keys


@triton.jit
def _decode(src, out, stride, KIND: tl.constexpr, D: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, N)
    ok = rows >= 0
    if KIND == 0:
        v = _compressed_keys(src, rows, ok, stride, D, N)
    elif KIND == 1:
        v = _index_keys(src, rows, ok, stride, D, N)
    else:
        v = _window_keys(src, rows, ok, stride, D, N)
    tl.store(out + rows[:, None] * D + tl.arange(0, D)[None, :], v)


def _rows(pack, d: int, n: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=g) * torch.logspace(-30, 4, n)[:, None]   # tiny to large scales
    x[0] = 0.0
    x[1, ::2] = -0.0
    rows = pack(x)
    return rows


def _run(rows: torch.Tensor, kind: int, d: int) -> torch.Tensor:
    out = torch.empty(rows.shape[0], d, dtype=torch.bfloat16)
    _decode[(1,)](rows, out, rows.stride(0), KIND=kind, D=d, N=rows.shape[0])
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_compressed_entries_decode_exactly():
    rows = _rows(mx.pack_compressed_entries, 64)
    g = torch.Generator().manual_seed(3)
    rand = torch.randint(0, 256, (16, rows.shape[1]), generator=g, dtype=torch.uint8)
    rand[:, 32:] = rand[:, 32:] & 0x7F   # e4m3 scales without sign or NaN (what the writer stores)
    rand[:, 32:][rand[:, 32:] == 0x7F] = 0x7E
    for r in (rows, rand):
        assert _same_bits(_run(r, 0, 64), mx.unpack_compressed_entries(r, torch.bfloat16))


def test_index_keys_decode_exactly():
    rows = _rows(mx.pack_index_keys, 64)
    g = torch.Generator().manual_seed(4)
    rand = torch.randint(0, 256, (16, rows.shape[1]), generator=g, dtype=torch.uint8)
    rand[:, 32:] = torch.randint(1, 241, (16, 2), generator=g, dtype=torch.uint8)   # 2^-126 .. 2^113
    for r in (rows, rand):
        assert _same_bits(_run(r, 1, 64), mx.unpack_index_keys(r, torch.bfloat16))


def test_window_rows_decode_exactly():
    rows = mx.pack_window_rows(torch.randn(16, 64) * torch.logspace(-20, 3, 16)[:, None])
    assert _same_bits(_run(rows, 2, 64), mx.unpack_window_rows(rows, torch.bfloat16))


def test_the_prefill_only_attention_shapes_match_the_reference(kernel_device):
    """Launch shapes only the prefill tuner times (all heads in one program over 16 warps) against the
    reference attention (toy dims; the GPU when there is one)."""
    from redknot.kernels import ref_v41
    from redknot.kernels.triton import attention_mx
    from redknot.kernels.triton.checks_mx import TOY_V41, attention_inputs

    # the Gluon shapes run on an SM90 GPU only, at V4.1 width: test_v41_attention_prefill_wg.py
    extra = [c for c in attention_mx.ATTN_MX_PREFILL_TUNER.candidates if c not in attention_mx.ATTN_MX_TUNER.candidates
             and not isinstance(c, attention_mx.PrefillMXWGConfig)]
    assert extra
    q, win, widx, comp, cidx, sinks = attention_inputs(TOY_V41, kernel_device, seed=5)
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, 0.125, comp, cidx).float()
    for cfg in extra:
        got = attention_mx.sparse_attention_mx(q, win, widx, sinks, 0.125, comp, cidx, config=cfg).float()
        assert float((got - want).norm() / want.norm()) < 2e-2, cfg


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_attention_at_real_size_on_the_gpu():
    """A prefill-sized call (2048 queries: the prefill tuner, every shape it times) at V4.1 sizes (64 heads
    x 512, 128 window rows, 512 compressed entries) on fresh random inputs against the reference, and each
    prefill launch shape on its own."""
    from redknot.kernels import ref_v41
    from redknot.kernels.triton import attention_mx
    from redknot.kernels.triton.checks_mx import REAL_V41, attention_inputs

    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    q, win, widx, comp, cidx, sinks = attention_inputs(REAL_V41, "cuda", seed=seed, tokens=2048)
    scale = REAL_V41.latent ** -0.5
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx).float()
    ran = 0
    for cfg in [None] + list(attention_mx.ATTN_MX_PREFILL_TUNER.candidates):
        try:
            got = attention_mx.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx, config=cfg).float()
        except Exception:   # a shape the compiler rejects on this device; the tuner skips it the same way
            if cfg is None:
                raise
            continue
        ran += 1
        assert float((got - want).norm() / want.norm()) < 1e-2, (cfg, seed)
    assert ran > 1
