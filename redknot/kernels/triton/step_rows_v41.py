"""The V4.1 tensor-only step's per-row facts and Engram hashes in one launch each.

At batch 1 the step is bound by its number of launches, and its per-step bookkeeping is made of tiny
integer ops: which request a row belongs to (a ``searchsorted`` over the request offsets), the request's
first / last row, its state slot and block table (the spare slot / block for padding rows), the flat ring
destination of each row per ring size, the compressed entries a row sees per ratio; then the Engram
look-back of compressed ids (from the step's rows or the ring), the n-gram hash and the ring write. In
PyTorch that is ~75 launches per step; here:

* :func:`step_rows` -- every per-row fact in one launch (one program per row);
* :func:`step_hashes` -- token -> compressed id, the look-back (step rows where the request has them, else
  the ring read *before* this step's writes), the DEAD blocking, the XOR-rolled hash of every n-gram size,
  the modulo of each head's prime plus the table offset, then the ring write; one program, the write after
  a barrier, so every read sees the ring as it was before the step (the eager order).

Everything is exact integer arithmetic (int64), so the results equal the PyTorch math bit for bit.
Divisions and remainders are written as floor operations whatever the sign convention of the backend's
integer ``//`` / ``%`` (C truncation when compiled, numpy's floor in the interpreter).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import next_pow2

MAX_HASH_ROWS = 1024   # rows one hashing program takes (its loops walk them in blocks)
MAX_KINDS = 4          # ring sizes / ratios one ``step_rows`` launch computes


@triton.jit
def _floor_div(a, b):
    q = a // b
    return tl.where((a - q * b) < 0, q - 1, q)


@triton.jit
def _floor_mod(a, b):
    m = a - (a // b) * b
    return tl.where(m < 0, m + b, m)


@triton.jit
def _pick(k: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr):
    if k == 0:
        return A
    elif k == 1:
        return B
    elif k == 2:
        return C
    else:
        return D


@triton.jit
def _step_rows(qsl_ptr, pos_ptr, slots_ptr, tables_ptr, facts_ptr, blocks_ptr,
               B, W, T, spare_slot, spare_block, stride_tb, stride_f, stride_bo,
               N_RINGS: tl.constexpr, N_RATIOS: tl.constexpr, RING0: tl.constexpr, RING1: tl.constexpr,
               RING2: tl.constexpr, RING3: tl.constexpr, RATIO0: tl.constexpr, RATIO1: tl.constexpr,
               RATIO2: tl.constexpr, RATIO3: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # raw = searchsorted(qsl[1:], row, right=True): request ends at or below the row
    raw = tl.zeros([BLOCK_B], tl.int64)
    for b0 in range(0, B, BLOCK_B):
        j = b0 + tl.arange(0, BLOCK_B)
        end = tl.load(qsl_ptr + 1 + j, mask=j < B, other=0).to(tl.int64)
        raw += ((end <= row) & (j < B)).to(tl.int64)
    raw_n = tl.sum(raw, 0)
    real = raw_n < B
    seq = tl.minimum(raw_n, B - 1)
    q0 = tl.load(qsl_ptr + seq).to(tl.int64)
    q1 = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    first = tl.where(real, q0, row)
    last = tl.where(real, q1 - 1, row)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.where(real, tl.load(slots_ptr + seq).to(tl.int64), spare_slot)
    f = facts_ptr + row
    tl.store(f, row)
    tl.store(f + stride_f, seq)
    tl.store(f + 2 * stride_f, first)
    tl.store(f + 3 * stride_f, last)
    tl.store(f + 4 * stride_f, row - first)
    tl.store(f + 5 * stride_f, slot)
    for k in tl.static_range(N_RINGS):
        ring = _pick(k, RING0, RING1, RING2, RING3)
        keep = (last - row) < ring
        dest_slot = tl.where(keep, slot, spare_slot)
        tl.store(f + (6 + k) * stride_f, dest_slot * ring + _floor_mod(pos, ring))
    for k in tl.static_range(N_RATIOS):
        ratio = _pick(k, RATIO0, RATIO1, RATIO2, RATIO3)
        tl.store(f + (6 + N_RINGS + k) * stride_f, _floor_div(pos + 1, ratio))
    for w0 in range(0, W, BLOCK_W):
        c = w0 + tl.arange(0, BLOCK_W)
        blk = tl.load(tables_ptr + seq * stride_tb + c, mask=c < W, other=0).to(tl.int64)
        blk = tl.where(real, blk, spare_block)
        tl.store(blocks_ptr + row * stride_bo + c, blk, mask=c < W)


FIELDS = ("row", "seq", "first", "last", "back", "slot")


def step_rows(query_start_loc: torch.Tensor, positions: torch.Tensor, seq_slots: torch.Tensor,
              block_tables: torch.Tensor, spare_slot: int, spare_block: int, rings: Sequence[int],
              ratios: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row facts of a step of ``T = positions.shape[0]`` rows -> (facts [6 + R + V, T] int64, blocks [T, W]
    int64). facts rows: ``FIELDS`` (row index, request, its first / last row, rows of the request before the
    row, state slot), then per ring size ``n`` of ``rings`` the flat write ``slot·n + p mod n`` (the spare
    slot unless the row is among its request's last ``n``), then per ratio ``r`` of ``ratios`` the visible
    entries ``(p + 1) // r``. A row at or past ``query_start_loc[B]`` is a padding request of its own on the
    spare slot and block (see ``tensor_step._Rows``)."""
    t = positions.shape[0]
    b = query_start_loc.shape[0] - 1
    w = block_tables.shape[1]
    dev = positions.device
    if len(rings) > MAX_KINDS or len(ratios) > MAX_KINDS or min(list(rings) + list(ratios) + [1]) < 1:
        raise ValueError(f"step_rows: rings={list(rings)} ratios={list(ratios)}: at most {MAX_KINDS} of each, "
                         "every one >= 1")
    if b < 1:
        raise ValueError(f"step_rows: query_start_loc has {b + 1} entries: a step needs at least one request")
    facts = torch.empty(len(FIELDS) + len(rings) + len(ratios), t, dtype=torch.int64, device=dev)
    blocks = torch.empty(t, w, dtype=torch.int64, device=dev)
    if t == 0:
        return facts, blocks
    rg = list(rings) + [1] * (MAX_KINDS - len(rings))        # compile-time constants (static per model)
    ra = list(ratios) + [1] * (MAX_KINDS - len(ratios))
    tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    _step_rows[(t,)](query_start_loc, positions, seq_slots, tables, facts, blocks,
                     b, w, t, spare_slot, spare_block, tables.stride(0), facts.stride(0), blocks.stride(0),
                     N_RINGS=len(rings), N_RATIOS=len(ratios), RING0=rg[0], RING1=rg[1], RING2=rg[2], RING3=rg[3],
                     RATIO0=ra[0], RATIO1=ra[1], RATIO2=ra[2], RATIO3=ra[3], BLOCK_B=min(128, next_pow2(max(b, 1))),
                     BLOCK_W=min(1024, next_pow2(max(w, 1))), num_warps=1)
    return facts, blocks


@triton.jit
def _step_hashes(ids_ptr, map_ptr, ring_ptr, slot_ptr, pos_ptr, back_ptr, dest_ptr, mult_ptr, prime_ptr, off_ptr,
                 out_ptr, T, ring, pad_c, M: tl.constexpr, L: tl.constexpr, HEADS: tl.constexpr,
                 HP: tl.constexpr, BLOCK_T: tl.constexpr, WRITE: tl.constexpr):
    NCOLS: tl.constexpr = (M - 1) * HEADS
    h = tl.arange(0, HP)
    hmask = h < HEADS
    for t0 in range(0, T, BLOCK_T):
        r = t0 + tl.arange(0, BLOCK_T)
        rm = r < T
        r64 = r.to(tl.int64)
        pos = tl.load(pos_ptr + r, mask=rm, other=0).to(tl.int64)
        back = tl.load(back_ptr + r, mask=rm, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + r, mask=rm, other=0).to(tl.int64)
        blocked = r < 0
        for l in tl.static_range(L):
            # the rolled hash per layer, the n-gram sizes walked together (s = look-back 0..M-1)
            rolling = tl.zeros([BLOCK_T], tl.int64)
            for s in tl.static_range(M):
                inner = back >= s
                src_row = tl.maximum(r64 - s, 0)
                tok = tl.load(ids_ptr + src_row, mask=rm & inner, other=0).to(tl.int64)
                new = tl.load(map_ptr + tok, mask=rm & inner, other=0).to(tl.int64)
                old = tl.load(ring_ptr + slot * ring + _floor_mod(pos - s, ring), mask=rm & (back < s), other=0)
                src = tl.where(inner, new, old.to(tl.int64))
                if s == 0:
                    blk = (pos < 0) | (src == -1)
                else:
                    blk = blocked | (pos < s) | (src == -1)
                blocked = blk
                y = tl.where(blk, pad_c, src)
                term = y * tl.load(mult_ptr + l * M + s).to(tl.int64)
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
    if WRITE:
        tl.debug_barrier()       # every read of the ring above happens before any write below
        for t0 in range(0, T, BLOCK_T):
            r = t0 + tl.arange(0, BLOCK_T)
            rm = r < T
            tok = tl.load(ids_ptr + r, mask=rm, other=0).to(tl.int64)
            comp = tl.load(map_ptr + tok, mask=rm, other=0)
            dest = tl.load(dest_ptr + r, mask=rm, other=0).to(tl.int64)
            tl.store(ring_ptr + dest, comp, mask=rm)


def step_hashes(input_ids: torch.Tensor, token_map: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor,
                pos: torch.Tensor, back: torch.Tensor, dest: torch.Tensor, multipliers: torch.Tensor,
                primes: torch.Tensor, offsets: torch.Tensor, pad_c: int) -> torch.Tensor:
    """Engram row ids [T, L, (M-1)·heads] of each row's n-grams, then the ring write ``ring.flat[dest] =
    token_map[input_ids]`` (after every read). ``ring`` [S, n] int64 compressed ids of earlier positions
    (``p mod n``), ``slot``/``pos``/``back`` [T] the row's state slot, position and rows of its request
    before it in this step, ``multipliers`` [L, M], ``primes``/``offsets`` [L, (M-1)·heads] int64
    (``engram_hash.EngramHasher``). The hash of a position < s or past a DEAD id uses ``pad_c`` from there
    on, as ``EngramHasher.hash`` does."""
    t = input_ids.shape[0]
    n_layers, m = multipliers.shape
    ncols = primes.shape[1]
    heads = ncols // max(m - 1, 1)
    if m < 2 or heads * (m - 1) != ncols or ring.dtype != torch.int64 or token_map.dtype != torch.int64:
        raise ValueError(f"step_hashes: multipliers {tuple(multipliers.shape)}, primes {tuple(primes.shape)}, "
                         f"ring {ring.dtype}, token_map {token_map.dtype}: need M >= 2, (M-1)*heads columns, "
                         "int64 ring and token map")
    if t > MAX_HASH_ROWS:
        raise ValueError(f"step_hashes: {t} rows: at most {MAX_HASH_ROWS} (one program walks them)")
    out = torch.empty(t, n_layers, ncols, dtype=torch.int64, device=input_ids.device)
    if t == 0:
        return out
    if not ring.is_contiguous():
        raise ValueError("step_hashes: the ring must be contiguous (it is written in place)")
    _step_hashes[(1,)](input_ids, token_map, ring, slot, pos, back, dest, multipliers.contiguous(),
                       primes.contiguous(), offsets.contiguous(), out, t, ring.shape[1], pad_c,
                       M=m, L=n_layers, HEADS=heads, HP=next_pow2(heads), BLOCK_T=min(64, next_pow2(t)),
                       WRITE=True, num_warps=4)
    return out
