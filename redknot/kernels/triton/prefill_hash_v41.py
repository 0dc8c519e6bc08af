"""The Engram hashes of a V4.1 prefill step in two launches (``DeepseekV41._hashes``' PyTorch math: ~60 small
integer launches, host-bound at prefill).

:func:`prefill_hashes` takes the step's spans as one small table ``[B, 4]`` = (first step row, rows, context,
state slot) and the step's token ids; rows are in span order (the spans cover rows ``0 .. T-1`` back to back):

* ``_prefill_hashes`` (``WRITE`` off), one program per ``BLOCK_T`` rows: the row's span (a walk over the B
  spans), token -> compressed id, the look-back of compressed ids (the step's own rows where the span has them,
  else the state's id ring, read before this step writes it), DEAD / position-below-s blocking, the XOR-rolled
  hash of every n-gram size, each head's prime remainder plus the table offset;
* ``_prefill_hashes`` (``WRITE`` on): each span's last ``min(n, ring)`` compressed ids into the ring, after
  every read (the next launch on the stream).

Integer arithmetic only (int64; the rolled values are non-negative, so C truncation and floor remainders agree),
so the row ids and the ring equal the PyTorch math bit for bit (``tests/unit/kernels/test_prefill_hash_v41.py``).
Speed: not measured on the H200 (the H100's profile put the PyTorch form at 2.4 ms of host time per 8192-row
chunk); ``e2e_v41``'s prefill row-fusion on/off comparison (``fused_rows.PREFILL_ROWS["hashes"]``) measures it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2

BLOCK_T = 128


@triton.jit
def _prefill_hashes(ids_ptr, map_ptr, ring_ptr, span_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr, T, B, ring, pad_c,
                    M: tl.constexpr, L: tl.constexpr, HEADS: tl.constexpr, HP: tl.constexpr,
                    BLOCK_T: tl.constexpr, WRITE: tl.constexpr):
    NCOLS: tl.constexpr = (M - 1) * HEADS
    r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rm = r < T
    r64 = r.to(tl.int64)
    row0 = tl.zeros([BLOCK_T], tl.int64)
    n = tl.zeros([BLOCK_T], tl.int64)
    ctx = tl.zeros([BLOCK_T], tl.int64)
    slot = tl.zeros([BLOCK_T], tl.int64)
    for b in range(B):                                   # the row's span
        s0 = tl.load(span_ptr + 4 * b)
        sn = tl.load(span_ptr + 4 * b + 1)
        inb = (r64 >= s0) & (r64 < s0 + sn)
        row0 = tl.where(inb, s0, row0)
        n = tl.where(inb, sn, n)
        ctx = tl.where(inb, tl.load(span_ptr + 4 * b + 2), ctx)
        slot = tl.where(inb, tl.load(span_ptr + 4 * b + 3), slot)
    back = r64 - row0                                    # rows of the span before this one
    pos = ctx + back
    if WRITE:
        keep = tl.minimum(n, ring)
        tok = tl.load(ids_ptr + r64, mask=rm, other=0).to(tl.int64)
        comp = tl.load(map_ptr + tok, mask=rm, other=0)
        tl.store(ring_ptr + slot * ring + pos % ring, comp, mask=rm & (back >= n - keep))
    else:
        h = tl.arange(0, HP)
        hmask = h < HEADS
        for l in tl.static_range(L):
            blocked = r < 0
            rolling = tl.zeros([BLOCK_T], tl.int64)
            for s in tl.static_range(M):                 # look-back s: the n-gram sizes walked together
                inner = back >= s
                tok = tl.load(ids_ptr + tl.maximum(r64 - s, 0), mask=rm & inner, other=0).to(tl.int64)
                new = tl.load(map_ptr + tok, mask=rm & inner, other=0).to(tl.int64)
                old = tl.load(ring_ptr + slot * ring + tl.maximum(pos - s, 0) % ring,
                              mask=rm & (back < s) & (pos >= s), other=0).to(tl.int64)
                src = tl.where(inner, new, old)
                blocked = blocked | (pos < s) | (src == -1)
                term = tl.where(blocked, pad_c, src) * tl.load(mult_ptr + l * M + s).to(tl.int64)
                if s == 0:
                    rolling = term
                else:
                    rolling = rolling ^ term
                    col = (s - 1) * HEADS + h
                    prime = tl.load(prime_ptr + l * NCOLS + col, mask=hmask, other=1).to(tl.int64)
                    off = tl.load(off_ptr + l * NCOLS + col, mask=hmask, other=0).to(tl.int64)
                    val = rolling[:, None] % prime[None, :] + off[None, :]
                    tl.store(out_ptr + r64[:, None] * (L * NCOLS) + l * NCOLS + col[None, :], val,
                             mask=rm[:, None] & hmask[None, :])


def prefill_hashes(ids: torch.Tensor, token_map: torch.Tensor, ring: torch.Tensor, spans: torch.Tensor,
                   multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor, pad_c: int,
                   block_t: int = BLOCK_T) -> torch.Tensor:
    """Engram row ids [T, L, (M-1)·heads] of the step's rows, then the ring write (each span's last
    ``min(n, ring)`` compressed ids at ``slot·ring + pos mod ring``), the results of ``DeepseekV41._hashes``.

    ``ids`` [T] the token ids of the spans' rows in span order; ``token_map`` int64 token -> compressed id (DEAD
    -1); ``ring`` [S, n] int64 (written in place); ``spans`` int64 [B, 4] = (first row, rows, context, slot) per
    span, back to back from row 0; ``multipliers`` [L, M], ``primes`` / ``offsets`` [L, (M-1)·heads] int64
    (``engram_hash.EngramHasher``)."""
    t = ids.shape[0]
    n_layers, m = multipliers.shape
    ncols = primes.shape[1]
    heads = ncols // max(m - 1, 1)
    if (m < 2 or heads * (m - 1) != ncols or ring.dtype != torch.int64 or token_map.dtype != torch.int64
            or spans.dtype != torch.int64 or spans.dim() != 2 or spans.shape[1] != 4):
        raise ValueError(f"prefill_hashes: multipliers {tuple(multipliers.shape)}, primes {tuple(primes.shape)}, "
                         f"ring {ring.dtype}, token_map {token_map.dtype}, spans {spans.dtype} "
                         f"{tuple(spans.shape)}: need M >= 2, (M-1)*heads columns, int64 ring, map and [B, 4] spans")
    if not ring.is_contiguous():
        raise ValueError("prefill_hashes: the ring must be contiguous (it is written in place)")
    out = torch.empty(t, n_layers, ncols, dtype=torch.int64, device=ids.device)
    if t == 0:
        return out
    ids = ids if ids.is_contiguous() else ids.contiguous()
    spans = spans.contiguous()
    args = (ids, token_map, ring, spans, multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out,
            t, spans.shape[0], ring.shape[1], pad_c)
    shape = {"M": m, "L": n_layers, "HEADS": heads, "HP": next_pow2(heads), "BLOCK_T": block_t, "num_warps": 4}
    grid = (cdiv(t, block_t),)
    _prefill_hashes[grid](*args, WRITE=False, **shape)
    _prefill_hashes[grid](*args, WRITE=True, **shape)   # after every read of the ring (stream order)
    return out
