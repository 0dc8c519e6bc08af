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

from redknot.kernels.triton._common import cdiv, interpreting, next_pow2
from redknot.kernels.triton.step_compress_v41 import _LIBDEVICE, _cos_sin


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


@triton.jit
def _decode_slots(kvr_ptr, gr_ptr, ape_ptr, src_ptr, valid_ptr, fresh_kv, fresh_g, b, s0, c0, hcols, m, l, acc, C,
                  stride_ape, M: tl.constexpr, SPAN: tl.constexpr, SB: tl.constexpr):
    """One block of SB window slots s0..s0+SB-1 of row b at channels c0 + hcols into the online softmax state
    (m, l, acc) [BLOCK_HD]: rows from the flat rings at ``src`` (invalid rows: kv 0, gate -inf), the row's own
    position (the window's last slot) from this step's values, gate + ape[slot % M]."""
    s = s0 + tl.arange(0, SB)
    rows = tl.load(src_ptr + b * SPAN + s).to(tl.int64)
    ok = tl.load(valid_ptr + b * SPAN + s) != 0
    off = rows[:, None] * C + c0 + hcols[None, :]
    okb = ok[:, None] & (hcols[None, :] >= 0)
    kv = tl.load(kvr_ptr + off, mask=okb, other=0.0).to(tl.float32)
    g = tl.load(gr_ptr + off, mask=okb, other=float("-inf")).to(tl.float32)
    last = (s == SPAN - 1)[:, None] & (hcols[None, :] >= 0)
    kv = tl.where(last, fresh_kv[None, :], kv)
    g = tl.where(last, fresh_g[None, :], g)
    g += tl.load(ape_ptr + (s % M)[:, None] * stride_ape + c0 + hcols[None, :])
    m_new = tl.maximum(m, tl.max(g, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # no slot so far: every weight 0, no NaN
    alpha = tl.exp(m - m_safe)
    e = tl.exp(g - m_safe[None, :])
    return m_new, l * alpha + tl.sum(e, 0), acc * alpha + tl.sum(e * kv, 0)


@triton.jit
def _fresh_half(kv_row, g_row, kvr_ptr, gr_ptr, rd, C, c0, hcols):
    """This step's kv and gate values of a row at channels c0 + hcols (fp32), stored into the rings' row ``rd``."""
    kv = tl.load(kv_row + c0 + hcols).to(tl.float32)
    g = tl.load(g_row + c0 + hcols).to(tl.float32)
    tl.store(kvr_ptr + rd * C + c0 + hcols, kv.to(kvr_ptr.dtype.element_ty))
    tl.store(gr_ptr + rd * C + c0 + hcols, g.to(gr_ptr.dtype.element_ty))
    return kv, g


@triton.jit
def _compress_decode(kv_ptr, g_ptr, kvr_ptr, gr_ptr, rd_ptr, src_ptr, valid_ptr, ape_ptr, w_ptr, cos_ptr, sin_ptr,
                     closes_ptr, dest_ptr, pool_ptr, C, eps, stride_kv, stride_g, stride_ape, stride_cs,
                     M: tl.constexpr, OVERLAP: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr,
                     SB: tl.constexpr):
    """Program b: row b's ring writes; where its position closes a window (the only rows whose pooled entry is
    stored), the window's pooled entry (online softmax over the slots per channel), RMSNorm, RoPE of the last
    2·HALF channels and the pool write. A row that closes no window (ratio - 1 of every ratio steps) reads no
    slot."""
    b = tl.program_id(0)
    SPAN: tl.constexpr = 2 * M if OVERLAP else M
    hcols = tl.arange(0, HD)
    rd = tl.load(rd_ptr + b).to(tl.int64)
    kv_row = kv_ptr + b.to(tl.int64) * stride_kv
    g_row = g_ptr + b.to(tl.int64) * stride_g
    # OVERLAP: the previous window's slots pool the first HD channels, the current window's the second HD
    c_kv, c_g = _fresh_half(kv_row, g_row, kvr_ptr, gr_ptr, rd, C, 0, hcols)
    if OVERLAP:
        f_kv, f_g = c_kv, c_g
        c_kv, c_g = _fresh_half(kv_row, g_row, kvr_ptr, gr_ptr, rd, C, HD, hcols)
    if tl.load(closes_ptr + b) != 0:
        m = tl.full([HD], float("-inf"), tl.float32)
        l = tl.zeros([HD], tl.float32)
        acc = tl.zeros([HD], tl.float32)
        if OVERLAP:
            for s0 in tl.static_range(0, M, SB):
                m, l, acc = _decode_slots(kvr_ptr, gr_ptr, ape_ptr, src_ptr, valid_ptr, f_kv, f_g, b, s0, 0, hcols,
                                          m, l, acc, C, stride_ape, M, SPAN, SB)
            for s0 in tl.static_range(M, 2 * M, SB):
                m, l, acc = _decode_slots(kvr_ptr, gr_ptr, ape_ptr, src_ptr, valid_ptr, c_kv, c_g, b, s0, HD, hcols,
                                          m, l, acc, C, stride_ape, M, SPAN, SB)
        else:
            for s0 in range(0, M, SB):
                m, l, acc = _decode_slots(kvr_ptr, gr_ptr, ape_ptr, src_ptr, valid_ptr, c_kv, c_g, b, s0, 0, hcols,
                                          m, l, acc, C, stride_ape, M, SPAN, SB)
        y = acc / l
        y = y * tl.rsqrt(tl.sum(y * y, 0) / HD + eps) * tl.load(w_ptr + hcols)
        # RoPE on interleaved pairs of the last 2·HALF channels: (a, b) -> (a·c - b·s, a·s + b·c)
        a, bb = tl.split(tl.reshape(y, (HD // 2, 2)))
        pair = tl.arange(0, HD // 2)
        first: tl.constexpr = HD // 2 - HALF
        rot = pair >= first
        j = tl.where(rot, pair - first, 0)
        c = tl.load(cos_ptr + b * stride_cs + j, mask=rot, other=1.0)
        s = tl.load(sin_ptr + b * stride_cs + j, mask=rot, other=0.0)
        out = tl.reshape(tl.join(tl.where(rot, a * c - bb * s, a), tl.where(rot, a * s + bb * c, bb)), (HD,))
        dest = tl.load(dest_ptr + b).to(tl.int64)
        tl.store(pool_ptr + dest * HD + hcols, out.to(pool_ptr.dtype.element_ty))


def decode_supported(kv, gate, kv_ring, gate_ring, ape, norm_weight, ratio, cos, pool) -> bool:
    """Whether ``compress_decode`` takes these inputs: a power-of-two ratio up to 128 and entry width (up to
    1024), contiguous rows and rings, an fp32 ``ape`` and norm weight, RoPE pairs within the entry."""
    c = kv.shape[-1]
    hd = norm_weight.shape[0]
    return (0 < ratio <= 128 and ratio & (ratio - 1) == 0 and 0 < hd <= 1024 and hd & (hd - 1) == 0
            and c in (hd, 2 * hd) and gate.shape == kv.shape and kv_ring.shape == gate_ring.shape
            and kv_ring.shape[-1] == c and ape.shape == (ratio, c) and 2 * cos.shape[-1] <= hd
            and pool.shape[-1] == hd and ape.dtype == torch.float32 and norm_weight.dtype == torch.float32
            and kv.stride(-1) == 1 and gate.stride(-1) == 1 and ape.stride(-1) == 1
            and kv_ring.is_contiguous() and gate_ring.is_contiguous() and pool.is_contiguous())


def compress_decode(kv, gate, kv_ring, gate_ring, ring_dest, window_src, window_valid, ape, norm_weight, eps: float,
                    ratio: int, overlap: bool, cos, sin, closes, pool_dest, pool) -> None:
    """``ref_attention.compressor_decode`` in one launch (one program per row)."""
    B, C = kv.shape
    hd = norm_weight.shape[0]
    if B == 0:
        return
    cos = cos if cos.dtype == torch.float32 and cos.is_contiguous() else cos.float().contiguous()
    sin = sin if sin.dtype == torch.float32 and sin.is_contiguous() else sin.float().contiguous()
    valid = window_valid.reshape(-1)
    valid = valid if valid.dtype != torch.bool else valid.view(torch.uint8)
    cl = closes.reshape(-1)
    cl = cl if cl.dtype != torch.bool else cl.view(torch.uint8)
    sb = min(ratio, max(1, 4096 // hd))   # slots a block: at most 4096 values of a tile
    _compress_decode[(B,)](kv, gate, kv_ring, gate_ring, ring_dest, window_src, valid, ape, norm_weight, cos, sin,
                           cl, pool_dest, pool, C, float(eps), kv.stride(0), gate.stride(0), ape.stride(0),
                           cos.stride(0), M=ratio, OVERLAP=overlap, HD=hd, HALF=cos.shape[-1], SB=sb,
                           num_warps=4 if hd <= 256 else 8)


@triton.jit
def _decode_rows(pos_ptr, slot_ptr, bt_ptr, inv_ptr, ring_dest_ptr, src_ptr, valid_ptr, cos_ptr, sin_ptr,
                 closes_ptr, dest_ptr, stride_bt, R, M, per_block, HALF, SPAN: tl.constexpr, SPAN_P2: tl.constexpr,
                 HALF_P2: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program b: ``ref_attention.compressor_decode_rows`` of row b (integer arithmetic on its position, slot and
    block table row; the angles one fp32 product each, as the reference)."""
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    tl.store(ring_dest_ptr + b, slot * R + p % R)
    s = tl.arange(0, SPAN_P2)
    rp = p - (SPAN - 1) + s
    tl.store(src_ptr + b * SPAN + s, slot * R + ((rp % R) + R) % R, mask=s < SPAN)   # a remainder >= 0
    tl.store(valid_ptr + b * SPAN + s, (rp >= 0).to(tl.int8), mask=s < SPAN)
    tl.store(closes_ptr + b, ((p + 1) % M == 0).to(tl.int8))
    w = tl.maximum((p + 1) // M - 1, 0)
    blk = tl.load(bt_ptr + b * stride_bt + w // per_block).to(tl.int64)
    tl.store(dest_ptr + b, blk * per_block + w % per_block)
    i = tl.arange(0, HALF_P2)
    angle = (w * M).to(tl.float32) * tl.load(inv_ptr + i, mask=i < HALF, other=0.0)
    c, sn = _cos_sin(angle, LIBDEVICE)
    tl.store(cos_ptr + b * HALF + i, c, mask=i < HALF)
    tl.store(sin_ptr + b * HALF + i, sn, mask=i < HALF)


def decode_rows(positions: torch.Tensor, seq_slots: torch.Tensor, block_tables: torch.Tensor, ring_len: int,
                ratio: int, overlap: bool, per_block: int, rope_inv: torch.Tensor):
    """``ref_attention.compressor_decode_rows`` in one launch (one program per row)."""
    B, dev = positions.shape[0], positions.device
    span, half = (2 * ratio if overlap else ratio), rope_inv.shape[0]
    ring_dest = torch.empty(B, dtype=torch.long, device=dev)
    src = torch.empty(B * span, dtype=torch.long, device=dev)
    valid = torch.empty(B * span, 1, dtype=torch.bool, device=dev)
    cos = torch.empty(B, half, dtype=torch.float32, device=dev)
    sin = torch.empty(B, half, dtype=torch.float32, device=dev)
    closes = torch.empty(B, 1, dtype=torch.bool, device=dev)
    dest = torch.empty(B, dtype=torch.long, device=dev)
    if B:
        inv = rope_inv.float().contiguous()   # (a no-op for the model's fp32 table)
        _decode_rows[(B,)](positions, seq_slots, block_tables, inv, ring_dest, src, valid.view(torch.int8), cos, sin,
                           closes.view(torch.int8), dest, block_tables.stride(0), ring_len, ratio, per_block, half,
                           SPAN=span, SPAN_P2=next_pow2(span), HALF_P2=next_pow2(max(half, 1)),
                           LIBDEVICE=_LIBDEVICE and not interpreting(), num_warps=1)
    return ring_dest, src, valid, cos, sin, closes, dest
