"""V4's compressor pooling (the ``compressor`` registry op) in one launch.

The reference op (``ref_attention.compressor``) builds the pooled entries from views, concatenations, a
softmax over the window's slots and a weighted sum: about a dozen launches per call, and in a decode step one
call per compressor (H100, V4 cut at batch 1: the softmax alone, ``cunn_SpatialSoftMaxForward`` over 4-8
slots, 24 us a call). Here one program per output entry and block of channels loads the entry's slots (the
window's ``ratio`` rows; with ``overlap`` also the previous window's, first half of the channels from the
previous window and second half from the current one), adds the positional gate bias ``ape``, and computes
the softmax over the slots per channel and the weighted sum of the kv values in fp32: the reference's
arithmetic (max, exp of the difference, sum, division, products, sum over the slots) in another summation
order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2


@triton.jit
def _slots(kv_ptr, g_ptr, ape_ptr, window, c0, cols, cmask, stride_kv, stride_g, stride_ape, M: tl.constexpr):
    """kv and biased gate [M, BLOCK_C] (fp32) of window ``window``'s rows at channels ``c0 + cols``; a window
    before the first (``window`` < 0) gives kv 0 and gate -inf."""
    r = tl.arange(0, M)
    ok = (r[:, None] + window * M >= 0) & cmask[None, :]
    rows = (window * M + r).to(tl.int64)[:, None]
    kv = tl.load(kv_ptr + rows * stride_kv + c0 + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows * stride_g + c0 + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
    g += tl.load(ape_ptr + r[:, None] * stride_ape + c0 + cols[None, :], mask=(r[:, None] < M) & cmask[None, :],
                 other=0.0)
    return kv, g


@triton.jit
def _compress(kv_ptr, g_ptr, ape_ptr, out_ptr, HD, stride_kv, stride_g, stride_ape, stride_o, M: tl.constexpr,
              OVERLAP: tl.constexpr, HAS_PREV: tl.constexpr, BLOCK_C: tl.constexpr):
    entry = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < HD
    if OVERLAP:
        cur = entry + 1 if HAS_PREV else entry
        kv_p, g_p = _slots(kv_ptr, g_ptr, ape_ptr, cur - 1, 0, cols, cmask, stride_kv, stride_g, stride_ape, M)
        kv_c, g_c = _slots(kv_ptr, g_ptr, ape_ptr, cur, HD, cols, cmask, stride_kv, stride_g, stride_ape, M)
        mx = tl.maximum(tl.max(g_p, 0), tl.max(g_c, 0))
        e_p = tl.exp(g_p - mx[None, :])
        e_c = tl.exp(g_c - mx[None, :])
        s = tl.sum(e_p, 0) + tl.sum(e_c, 0)
        out = tl.sum(e_p / s[None, :] * kv_p, 0) + tl.sum(e_c / s[None, :] * kv_c, 0)
    else:
        kv, g = _slots(kv_ptr, g_ptr, ape_ptr, entry, 0, cols, cmask, stride_kv, stride_g, stride_ape, M)
        mx = tl.max(g, 0)
        e = tl.exp(g - mx[None, :])
        out = tl.sum(e / tl.sum(e, 0)[None, :] * kv, 0)
    tl.store(out_ptr + entry.to(tl.int64) * stride_o + cols, out, mask=cmask)


def supported(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int) -> bool:
    """Whether ``compress`` takes these inputs: a power-of-two ratio up to 128, rows of whole windows, float
    inputs with contiguous channels."""
    return (0 < ratio <= 128 and ratio & (ratio - 1) == 0 and kv.dim() == 2 and kv.shape == gate.shape
            and kv.shape[0] % ratio == 0 and ape.shape == (ratio, kv.shape[1])
            and all(t.is_floating_point() and t.stride(-1) == 1 for t in (kv, gate, ape)))


def compress(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
             has_prev: bool) -> torch.Tensor:
    """``ref_attention.compressor``'s contract: kv, gate [R, C] (R a multiple of ``ratio``), ape [ratio, C]
    -> [entries, hd] fp32 (hd = C, or C / 2 with ``overlap``; entries R / ratio, one fewer with ``has_prev``)."""
    if not supported(kv, gate, ape, ratio):
        raise ValueError(f"compress: kv {tuple(kv.shape)}, gate {tuple(gate.shape)}, ape {tuple(ape.shape)}, "
                         f"ratio {ratio}: needs a power-of-two ratio <= 128, rows of whole windows, ape [ratio, C]")
    nw, c = kv.shape[0] // ratio, kv.shape[1]
    hd = c // 2 if overlap else c
    n_out = nw - 1 if (overlap and has_prev) else nw
    out = torch.empty(max(n_out, 0), hd, dtype=torch.float32, device=kv.device)
    if n_out <= 0:
        return out
    ape32 = ape if ape.dtype == torch.float32 else ape.float()
    bc = min(next_pow2(hd), max(16, 4096 // ratio))  # the slot tiles stay at most 4096 values a program
    _compress[(n_out, cdiv(hd, bc))](kv, gate, ape32, out, hd, kv.stride(0), gate.stride(0), ape32.stride(0),
                                     out.stride(0), M=ratio, OVERLAP=overlap, HAS_PREV=has_prev, BLOCK_C=bc,
                                     num_warps=4)
    return out
