"""The compressor of a V4.1 kv source in two launches after its projections (decode and verify steps).

The PyTorch compressor spends ~60 small launches per layer on index arithmetic, the ratio-2 look-back,
the pooling, the norms, the RoPE tables and the two cache inserts. Here:

* :func:`pool_rows` (ratio ``r`` > 1): per row, the ``r`` raw ``wkv`` / ``wgate`` rows of its group
  (positions p-r+1..p: the step's own rows where its request has them, else the compressor ring as it
  was before this step), the softmax over the group, the gated sum, the cast to the row dtype and the RMS
  norm (of the stored row, loaded back: its reduction then runs on the layout ``rope_rows`` gives a row);
  then the step's rows are stored into the ring. One program per request runs its rows in order and
  stores only after all of them read (a ring of ``2 + backtrack`` rows can be smaller than a verify's
  look-back reach), so no store can land before a read of the same ring row.
* :func:`insert_entries`: per row whose position closes a group (every row at ratio 1), the page row of
  its entry (block table, entry position), the index key's RMS norm, RoPE of the key and of the latent by
  the entry position, and both quantised on insert: the index key FP4 e2m1 with an E8M0 scale per 32,
  the entry FP4 e2m1 with an E4M3 scale per 16 (the byte layouts of ``cache_insert_mx``).

Bits: the norm is the one of ``step_rope_v41.rope_rows`` (same tensor shape, same reduction, same
cast), which the PyTorch compressor of a model on the Triton ops runs too (``fused_rows.norm``); RoPE's
products are rounded apart as there, and the angles are ``pos · θ`` in fp64 with fp64 cos/sin rounded to
fp32 (``rope_table``). The softmax is exp(g - max) / sum with libdevice's ``exp`` and IEEE division (what
PyTorch's CUDA softmax computes); the gated sum rounds its products apart and adds them oldest first. Under
Triton's CPU interpreter numpy's ``exp`` / ``cos`` / ``sin`` stand in for PyTorch's, which may differ by an
ulp (a pooled value may then round to the neighbouring bf16 value).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from redknot.kernels.triton._common import interpreting
from redknot.kernels.triton.quant_mx import e2m1_code, e8m0_exponent, pow2
from redknot.kernels.triton.step_rope_v41 import _mul_rn

# Triton's CPU interpreter runs no extern (libdevice) calls: there numpy's exp / cos / sin stand in.
_LIBDEVICE = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")

# Rows up to which the step runs these kernels (decode and verify batches up to 128 requests of 4 rows): one
# program per request walks that request's rows in order, so a step of long chunks (prefill-like) would run
# them one after another; there the PyTorch ops, whose per-launch cost no longer dominates, are kept.
MAX_ROWS = 512


def supported(latent_dim: int, key_dim: int, half: int) -> bool:
    """Whether the kernels take these widths: powers of two, at least one FP4 scale group each, the rotated
    pairs inside both rows."""
    def pow2_at_least(d: int, g: int) -> bool:
        return d >= g and d & (d - 1) == 0
    return pow2_at_least(latent_dim, 16) and pow2_at_least(key_dim, 32) and 2 * half <= min(latent_dim, key_dim)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _cos_sin(a, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        c = libdevice.cos(a)
        s = libdevice.sin(a)
    else:
        c = tl.cos(a)
        s = tl.sin(a)
    return c, s


@triton.jit
def _norm_pairs(x, w_ptr, offs, eps, D: tl.constexpr):
    """``rope_rows``' RMS norm of one row held as (re, im) pairs [D/2, 2], before the cast to the row dtype."""
    r = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / D + eps)
    w = tl.load(w_ptr + offs).to(tl.float32)
    return w * (x * r)


@triton.jit
def _pool_rows(kv_ptr, gate_ptr, kv_ring_ptr, gate_ring_ptr, slot_ptr, pos_ptr, back_ptr, last_ptr, w_ptr,
               out_ptr, stride_step, stride_out, ring, eps,
               D: tl.constexpr, R: tl.constexpr, LIBDEVICE: tl.constexpr, ASM: tl.constexpr):
    first = tl.program_id(0)
    # Only the program of a request's first row runs; it walks the request's rows.
    n = tl.where(tl.load(back_ptr + first) == 0, tl.load(last_ptr + first).to(tl.int32) - first + 1, 0)
    slot = tl.load(slot_ptr + first).to(tl.int64)
    i = tl.arange(0, D // 2)
    two = tl.arange(0, 2)
    offs = i[:, None] * 2 + two[None, :]        # [D/2, 2]: (re, im) of pair i, as rope_rows holds a row
    for j in range(0, n):
        row = first + j
        p = tl.load(pos_ptr + row)
        gm = tl.full((D // 2, 2), float("-inf"), tl.float32)
        for s in tl.static_range(R):            # the group's max
            k = R - 1 - s                        # look-back of the s-th oldest row
            q = p - k
            old = slot * ring + ((q % ring + ring) % ring)
            g_old = tl.load(gate_ring_ptr + old * D + offs)
            g_new = tl.load(gate_ptr + tl.maximum(row - k, first).to(tl.int64) * stride_step + offs)
            gm = tl.maximum(gm, tl.where(k <= j, g_new, g_old))
        den = tl.zeros((D // 2, 2), tl.float32)
        for s in tl.static_range(R):            # sum of exp(g - max), oldest first
            k = R - 1 - s
            q = p - k
            old = slot * ring + ((q % ring + ring) % ring)
            g_old = tl.load(gate_ring_ptr + old * D + offs)
            g_new = tl.load(gate_ptr + tl.maximum(row - k, first).to(tl.int64) * stride_step + offs)
            den = den + _exp(tl.where(k <= j, g_new, g_old) - gm, LIBDEVICE)
        acc = tl.zeros((D // 2, 2), tl.float32)   # 0 + first: PyTorch's sum from 0
        for s in tl.static_range(R):            # sum of kv · softmax weight, oldest first
            k = R - 1 - s
            q = p - k
            old = slot * ring + ((q % ring + ring) % ring)
            new = tl.maximum(row - k, first).to(tl.int64) * stride_step + offs
            g = tl.where(k <= j, tl.load(gate_ptr + new), tl.load(gate_ring_ptr + old * D + offs))
            kv = tl.where(k <= j, tl.load(kv_ptr + new), tl.load(kv_ring_ptr + old * D + offs))
            wt = tl.div_rn(_exp(g - gm, LIBDEVICE), den)
            acc = acc + _mul_rn(kv, wt, ASM)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty))
    tl.debug_barrier()                          # every read of the ring above precedes the stores below
    for j in range(0, n):                       # the norm of the stored row, loaded as rope_rows loads its rows
        dst = out_ptr + (first + j).to(tl.int64) * stride_out + offs
        y = _norm_pairs(tl.load(dst).to(tl.float32), w_ptr, offs, eps, D)
        tl.store(dst, y.to(out_ptr.dtype.element_ty))
    for j in range(tl.maximum(n - ring, 0), n):  # the request's last ``ring`` rows (the others: nowhere)
        row = first + j
        dst = slot * ring + tl.load(pos_ptr + row) % ring
        src = row.to(tl.int64) * stride_step + offs
        tl.store(kv_ring_ptr + dst * D + offs, tl.load(kv_ptr + src))
        tl.store(gate_ring_ptr + dst * D + offs, tl.load(gate_ptr + src))


def pool_rows(kv: torch.Tensor, gate: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
              slot: torch.Tensor, pos: torch.Tensor, back: torch.Tensor, last: torch.Tensor, norm_w: torch.Tensor,
              eps: float, ratio: int, dtype: torch.dtype) -> torch.Tensor:
    """The pooled, normed latents [T, D] in ``dtype`` of the step's rows, and the ring update.

    kv, gate [T, D] fp32: the rows' ``wkv`` / ``wgate`` projections; kv_ring, gate_ring [S, ring, D] fp32
    (updated in place: each request's last ``ring`` rows at ``pos % ring``); slot, pos, back (rows of its
    request before a row), last (a request's last row) [T] per row; norm_w [D] fp32.
    """
    t, d = kv.shape
    if d & (d - 1) or d < 2:
        raise ValueError(f"pool_rows: row width {d} must be a power of two")
    if kv_ring.dtype != torch.float32 or kv.dtype != torch.float32 or gate.dtype != torch.float32:
        raise ValueError(f"pool_rows: fp32 rows and rings expected, got {kv.dtype}, {gate.dtype}, {kv_ring.dtype}")
    kv, gate = kv.contiguous(), gate.contiguous()
    slot, pos, back, last = (x.contiguous() for x in (slot, pos, back, last))
    if not (kv_ring.is_contiguous() and gate_ring.is_contiguous()):
        raise ValueError("pool_rows: the rings must be contiguous [S, ring, D]")
    ring = kv_ring.shape[1]
    out = torch.empty(t, d, dtype=dtype, device=kv.device)
    if t:
        _pool_rows[(t,)](kv, gate, kv_ring, gate_ring, slot, pos, back, last, norm_w, out, kv.stride(0),
                         out.stride(0), ring, eps, D=d, R=ratio, LIBDEVICE=_LIBDEVICE,
                         ASM=not interpreting() and kv.is_cuda, num_warps=1 if d <= 128 else 4)
    return out


@triton.jit
def _rope_pairs(x, epos, inv_ptr, D: tl.constexpr, HALF: tl.constexpr, LIBDEVICE: tl.constexpr,
                ASM: tl.constexpr, OUT_T: tl.constexpr):
    """``rope_rows``' rotation of a row [D/2, 2] (values of the row dtype, in fp32) by ``epos``: the last
    HALF pairs turn by angles epos·θ (fp64, cos/sin rounded to fp32), each result cast to the row dtype."""
    i = tl.arange(0, D // 2)
    FIRST: tl.constexpr = D // 2 - HALF
    rot = i >= FIRST
    theta = tl.load(inv_ptr + tl.maximum(i - FIRST, 0), mask=rot, other=0.0)
    c64, s64 = _cos_sin(epos.to(tl.float64) * theta, LIBDEVICE)
    c = tl.where(rot, c64.to(tl.float32), 1.0)
    s = tl.where(rot, s64.to(tl.float32), 0.0)
    re, im = tl.split(x)
    new_re = _mul_rn(re, c, ASM) - _mul_rn(im, s, ASM)
    new_im = _mul_rn(re, s, ASM) + _mul_rn(im, c, ASM)
    new_re = tl.where(rot, new_re.to(OUT_T).to(tl.float32), re)
    new_im = tl.where(rot, new_im.to(OUT_T).to(tl.float32), im)
    return tl.join(new_re, new_im)


@triton.jit
def _store_fp4(y, base, ok, D: tl.constexpr, G: tl.constexpr, E4M3: tl.constexpr):
    """``cache_insert_mx``'s FP4 rows: y [D/2, 2] fp32 -> D/2 code bytes (element 2i the low nibble), then
    D/G scale bytes (E4M3 of amax/6 when ``E4M3``, else E8M0); nothing where ``ok`` is false."""
    yg = tl.reshape(y, (D // G, G // 2, 2))
    amax = tl.max(tl.max(tl.abs(yg), 2), 1)                 # [D/G]
    if E4M3:
        a = tl.maximum(amax, 0.01171875)
        s8 = tl.div_rn(a, tl.zeros_like(a) + 6.0).to(tl.float8e4nv)
        v = tl.div_rn(yg, tl.zeros_like(yg) + s8.to(tl.float32)[:, None, None])
        sbyte = s8.to(tl.uint8, bitcast=True)
    else:
        e = e8m0_exponent(amax, 6.0, 7.052966104933725e-38)
        v = yg * pow2(-e)[:, None, None]
        sbyte = (e + 127).to(tl.uint8)
    lo, hi = tl.split(tl.reshape(e2m1_code(v), (D // 2, 2)))
    c = tl.arange(0, D // 2)
    tl.store(base + c, (lo | (hi << 4)).to(tl.uint8), mask=(c * 0 + ok.to(tl.int32)) != 0)
    g = tl.arange(0, D // G)
    tl.store(base + D // 2 + g, sbyte, mask=(g * 0 + ok.to(tl.int32)) != 0)


@triton.jit
def _insert_entries(keys_ptr, lat_ptr, kw_ptr, inv_ptr, pos_ptr, blocks_ptr, key_cache_ptr, ent_cache_ptr,
                    stride_k, stride_l, stride_b, stride_kc, stride_ec, n_blocks, block_size, per, eps,
                    DK: tl.constexpr, DL: tl.constexpr, HALF: tl.constexpr, R: tl.constexpr,
                    LIBDEVICE: tl.constexpr, ASM: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + row).to(tl.int64)
    ok = (p + 1) % R == 0                        # the row closes a group (every row at ratio 1)
    ent = tl.maximum((p + 1) // R - 1, 0)
    epos = ent * R
    col = tl.minimum(epos // block_size, n_blocks - 1)
    blk = tl.load(blocks_ptr + row * stride_b + col).to(tl.int64)
    dest = blk * per + (epos % block_size) // R
    two = tl.arange(0, 2)
    OUT_T: tl.constexpr = keys_ptr.dtype.element_ty
    # index key: norm, RoPE, FP4 + E8M0 per 32
    koffs = tl.arange(0, DK // 2)[:, None] * 2 + two[None, :]
    x = tl.load(keys_ptr + row * stride_k + koffs).to(tl.float32)
    x = _norm_pairs(x, kw_ptr, koffs, eps, DK).to(OUT_T).to(tl.float32)
    y = _rope_pairs(x, epos, inv_ptr, DK, HALF, LIBDEVICE, ASM, OUT_T)
    _store_fp4(y, key_cache_ptr + dest * stride_kc, ok, DK, 32, False)
    # compressed entry: RoPE, FP4 + E4M3 per 16
    loffs = tl.arange(0, DL // 2)[:, None] * 2 + two[None, :]
    z = tl.load(lat_ptr + row * stride_l + loffs).to(tl.float32)
    y = _rope_pairs(z, epos, inv_ptr, DL, HALF, LIBDEVICE, ASM, OUT_T)
    _store_fp4(y, ent_cache_ptr + dest * stride_ec, ok, DL, 16, True)


def insert_entries(keys: torch.Tensor, latent: torch.Tensor, k_norm_w: torch.Tensor, inv: torch.Tensor,
                   pos: torch.Tensor, blocks: torch.Tensor, key_cache: torch.Tensor, entry_cache: torch.Tensor,
                   ratio: int, block_size: int, eps: float) -> torch.Tensor:
    """Store the entries the step's rows close: keys [T, DK] (``indexer.wk`` rows before their norm) and
    latent [T, DL] in the row dtype, k_norm_w [DK] fp32, inv [half] fp64 (the layer's RoPE table), pos [T],
    blocks [T, W] (each row's block table); key_cache [S, DK/2 + DK/32] and entry_cache [S, DL/2 + DL/16]
    uint8 page rows (``per = block_size / ratio`` per block). A row at position p closes entry
    (p + 1) / ratio - 1 when (p + 1) % ratio == 0; rows that close none store nothing. -> entry_cache."""
    t, dk = keys.shape
    dl = latent.shape[1]
    half = inv.shape[0]
    for name, d, g in (("index key", dk, 32), ("entry", dl, 16)):
        if d & (d - 1) or d < g or 2 * half > d:
            raise ValueError(f"insert_entries: {name} width {d} must be a power of two >= {g} and >= 2*half "
                             f"({2 * half})")
    keys, latent, blocks, pos = keys.contiguous(), latent.contiguous(), blocks.contiguous(), pos.contiguous()
    if t:
        _insert_entries[(t,)](keys, latent, k_norm_w, inv.to(torch.float64).contiguous(), pos, blocks,
                              key_cache, entry_cache, keys.stride(0), latent.stride(0), blocks.stride(0),
                              key_cache.stride(0), entry_cache.stride(0), blocks.shape[1], block_size,
                              block_size // ratio, eps, DK=dk, DL=dl, HALF=half, R=ratio,
                              LIBDEVICE=_LIBDEVICE, ASM=not interpreting() and keys.is_cuda,
                              num_warps=1 if dk <= 128 else 4)   # rope_rows' launch of the key norm
    return entry_cache

