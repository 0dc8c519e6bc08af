"""Reference attention-side ops of DeepSeek-V4: compressor pooling, lightning-indexer
top-k and sparse attention over the paged state (reference §4).

Ops that read the state receive the step's ``StepMetadata`` (``meta``) and use
its python-side ``query_start_list``, ``num_tokens_per_seq``, ``context_lens``,
``seq_slot_list`` and its ``block_tables`` tensor. A compressed entry ``w`` of a
sequence lives in ``pool[block_tables[b, w // E], w % E]`` (E = entries per block).
A ``meta.tensor_only`` decode step (CUDA-graph capture) is computed from its tensors
alone, with shapes fixed by the block-table width: same math, batched over sequences.
"""
from __future__ import annotations

from typing import Optional

import torch

from redknot.kernels.registry import register


def _spans(meta):
    return zip(meta.query_start_list, meta.num_tokens_per_seq, meta.context_lens, meta.seq_slot_list)


def _entry_rows(block_row: torch.Tensor, w: torch.Tensor, per_block: int) -> torch.Tensor:
    """Logical entry ids -> rows of the flattened pool [num_blocks * per_block, dim]."""
    return block_row[w // per_block].long() * per_block + w % per_block


@register("compressor")
def compressor(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool,
               has_prev: bool) -> torch.Tensor:
    """Pool raw projected rows into compressed entries (pre-norm, fp32).

    kv, gate [R, C]: rows of consecutive positions starting at a multiple of ``ratio``;
    ``ape`` [ratio, C] is added to the gate of the row at offset r in its window.
    HCA (``overlap=False``, C = hd): entry = Σ_r softmax_r(gate) ⊙ kv over each window.
    CSA (``overlap=True``, C = 2*hd): entry w pools the first halves of window w-1 and the
    second halves of window w (8 slots, softmax per channel). With ``has_prev`` the first
    window of the rows is only the previous window (no entry of its own); without it the
    first entry has no previous window (weight 0).
    Returns [num_entries, hd] fp32.
    """
    r, c = kv.shape
    nw = r // ratio
    kvw = kv.float().view(nw, ratio, c)
    g = gate.float().view(nw, ratio, c) + ape.float()
    if not overlap:
        return (torch.softmax(g, dim=1) * kvw).sum(dim=1)
    hd = c // 2
    prev_kv, prev_g, cur_kv, cur_g = kvw[..., :hd], g[..., :hd], kvw[..., hd:], g[..., hd:]
    if has_prev:
        prev_kv, prev_g, cur_kv, cur_g = prev_kv[:-1], prev_g[:-1], cur_kv[1:], cur_g[1:]
    else:
        prev_kv = torch.cat([torch.zeros_like(prev_kv[:1]), prev_kv[:-1]])
        prev_g = torch.cat([torch.full_like(prev_g[:1], float("-inf")), prev_g[:-1]])
    slots_kv = torch.cat([prev_kv, cur_kv], dim=1)  # [n, 2*ratio, hd]
    slots_g = torch.cat([prev_g, cur_g], dim=1)
    return (torch.softmax(slots_g, dim=1) * slots_kv).sum(dim=1)


def ring_window_rows(pos: torch.Tensor, seq_slots: torch.Tensor, span: int, ring: int):
    """(src [R·span]: the flat ring rows of the ``span`` positions ending at each row's position, valid
    [R·span, 1]: the positions that are >= 0) for per-slot rings of length ``ring``."""
    row_pos = pos[:, None] - (span - 1) + torch.arange(span, device=pos.device)  # [R, span]
    src = (seq_slots.long()[:, None] * ring + row_pos.remainder(ring)).flatten()
    return src, (row_pos >= 0).flatten()[:, None]  # rows before position 0 take no weight


@register("compressor_decode_rows")
def compressor_decode_rows(positions: torch.Tensor, seq_slots: torch.Tensor, block_tables: torch.Tensor,
                           ring_len: int, ratio: int, overlap: bool, per_block: int, rope_inv: torch.Tensor):
    """The index tensors ``compressor_decode`` takes, for a tensor-only decode step (row b = sequence b at
    position p_b, slot ``seq_slots[b]``) and a compressor of ``ratio`` (``overlap``: windows of 2·ratio) with
    rings of ``ring_len`` rows and ``per_block`` pool entries a block: (ring_dest [B]: the ring row of p_b,
    window_src [B·span] and window_valid [B·span, 1]: :func:`ring_window_rows`, cos, sin [B, r/2]: the compressed
    RoPE (inverse frequencies ``rope_inv`` [r/2]) at the first position of the window p_b closes, closes [B, 1]:
    whether it closes one, pool_dest [B]: the pool row of that entry, of entry 0 where it closes none)."""
    pos = positions.long()
    slots = seq_slots.long()
    span = 2 * ratio if overlap else ratio
    ring_dest = slots * ring_len + pos % ring_len
    src, valid = ring_window_rows(pos, slots, span, ring_len)
    closes = (pos + 1) % ratio == 0
    w = ((pos + 1) // ratio - 1).clamp(min=0)  # the entry p closes (where it does)
    angles = (w * ratio).float()[:, None] * rope_inv.float()[None, :]
    block = block_tables.gather(1, (w // per_block)[:, None])
    dest = block.squeeze(1).long() * per_block + w % per_block
    return ring_dest, src, valid, angles.cos(), angles.sin(), closes[:, None], dest


def compressor_decode_with(compressor_fn, rms_norm_fn, rope_fn, kv, gate, kv_ring, gate_ring, ring_dest,
                           window_src, window_valid, ape, norm_weight, eps, ratio, overlap, cos, sin, closes,
                           pool_dest, pool) -> None:
    """``compressor_decode`` composed from a backend's ``compressor``, ``rms_norm`` and ``rope`` (the reference
    op's body; the batch-invariant backend composes its own ops the same way)."""
    width = kv.shape[1]
    kv_flat, gate_flat = kv_ring.view(-1, width), gate_ring.view(-1, width)
    kv_flat.index_copy_(0, ring_dest, kv.to(kv_ring.dtype))
    gate_flat.index_copy_(0, ring_dest, gate.to(gate_ring.dtype))
    kv_rows = torch.where(window_valid, kv_flat[window_src], 0.0)  # [B*span, C]
    gate_rows = torch.where(window_valid, gate_flat[window_src], float("-inf"))
    # Without has_prev the op pools window j with window j-1 of the rows: with overlapping windows the odd
    # entries are each row's (previous, current) pair; the even ones straddle two rows.
    pooled = compressor_fn(kv_rows, gate_rows, ape, ratio, overlap, False)
    pooled = pooled[1::2] if overlap else pooled
    made = rope_fn(rms_norm_fn(pooled, norm_weight, eps), cos, sin)  # [B, hd] fp32
    flat = pool.view(-1, made.shape[1])
    flat.index_copy_(0, pool_dest, torch.where(closes, made.to(pool.dtype), flat[pool_dest]))


@register("compressor_decode")
def compressor_decode(kv: torch.Tensor, gate: torch.Tensor, kv_ring: torch.Tensor, gate_ring: torch.Tensor,
                      ring_dest: torch.Tensor, window_src: torch.Tensor, window_valid: torch.Tensor,
                      ape: torch.Tensor, norm_weight: torch.Tensor, eps: float, ratio: int, overlap: bool,
                      cos: torch.Tensor, sin: torch.Tensor, closes: torch.Tensor, pool_dest: torch.Tensor,
                      pool: torch.Tensor) -> None:
    """A tensor-only decode step's compressor update, in place (shapes independent of the positions: CUDA graphs).

    kv, gate [B, C]: this step's projected rows (row b = sequence b's token), stored at the flat ring rows
    ``ring_dest`` [B] of kv_ring / gate_ring [S, R, C]. Each row's window ending at its position (``span`` =
    ``ratio``, or 2·ratio with ``overlap``: the window before it too) is read from the rings at ``window_src``
    [B·span] (``window_valid`` [B·span, 1]: positions >= 0; the others pool as kv 0, gate -inf), pooled as
    ``compressor`` pools it (with ``ape`` [ratio, C]), RMS-normed with ``norm_weight`` [hd] and ``eps``, roped
    with cos / sin [B, r/2] (the angles of the window's first position), and written to the pool row
    ``pool_dest`` [B] of pool [.., E, hd] where ``closes`` [B, 1] (the position closes a window); the other pool
    rows keep their values."""
    from redknot.kernels import reference
    compressor_decode_with(compressor, reference.rms_norm, reference.rope, kv, gate, kv_ring, gate_ring, ring_dest,
                           window_src, window_valid, ape, norm_weight, eps, ratio, overlap, cos, sin, closes,
                           pool_dest, pool)


@register("indexer_topk")
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_pool: torch.Tensor, meta, ratio: int,
                 topk: int, scale: float, q_tile: int = 512) -> torch.Tensor:
    """Lightning indexer: score(t, w) = scale · Σ_h weights[t, h] · ReLU(q[t, h] · K[w]) over the
    entries w < (t+1)//ratio of t's sequence; returns [T, topk] entry ids (best first, ties: lower
    id first), -1 where fewer entries are visible. q [T, IH, ID], weights [T, IH], key_pool [NB, E, ID]."""
    if getattr(meta, "tensor_only", False):
        return _indexer_topk_decode(q, weights, key_pool, meta, ratio, topk, scale)
    t_rows = q.shape[0]
    out = torch.full((t_rows, topk), -1, dtype=torch.long, device=q.device)
    per_block = key_pool.shape[1]
    flat = key_pool.flatten(0, 1)
    for b, (s0, n, c, _slot) in enumerate(_spans(meta)):
        n_ent = (c + n) // ratio
        if n_ent == 0:
            continue
        w = torch.arange(n_ent, device=q.device)
        keys = flat[_entry_rows(meta.block_tables[b], w, per_block)].float()  # [Ne, ID]
        k = min(topk, n_ent)
        for i0 in range(0, n, q_tile):
            rows = slice(s0 + i0, s0 + min(n, i0 + q_tile))
            scores = torch.relu(torch.einsum("qhd,ed->qhe", q[rows].float(), keys)) * scale
            scores = (scores * weights[rows].float().unsqueeze(-1)).sum(dim=1)  # [q, Ne]
            visible = (torch.arange(c + i0, c + min(n, i0 + q_tile), device=q.device) + 1) // ratio
            scores.masked_fill_(w[None, :] >= visible[:, None], float("-inf"))
            best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
            out[rows, :k] = torch.where(best < visible[:, None], best, torch.full_like(best, -1))
    return out


def _decode_entry_rows(meta, per_block: int, width: int) -> torch.Tensor:
    """[B, width] pool rows of entries 0..width-1 of every sequence (one per block-table row)."""
    w = torch.arange(width, device=meta.block_tables.device)
    return meta.block_tables[:, w // per_block].long() * per_block + w % per_block


def _indexer_topk_decode(q, weights, key_pool, meta, ratio: int, topk: int, scale: float) -> torch.Tensor:
    """:func:`indexer_topk` of a tensor-only decode step: every entry the block tables can hold is
    scored and the invisible ones masked, so the shapes do not depend on the positions."""
    per_block = key_pool.shape[1]
    width = meta.block_tables.shape[1] * per_block
    keys = key_pool.flatten(0, 1)[_decode_entry_rows(meta, per_block, width)].float()  # [B, W, ID]
    scores = torch.relu(torch.einsum("bhd,bwd->bhw", q.float(), keys)) * scale
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=1)  # [B, W]
    w = torch.arange(width, device=q.device)
    visible = (meta.positions + 1) // ratio  # [B]
    scores.masked_fill_(w[None, :] >= visible[:, None], float("-inf"))
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    best = torch.where(best < visible[:, None], best, torch.full_like(best, -1))
    if best.shape[1] < topk:
        best = torch.cat([best, best.new_full((best.shape[0], topk - best.shape[1]), -1)], dim=1)
    return best


def _sparse_attention_decode(q, kv, swa_ring, sinks, scale: float, window: int, meta, extra_pool,
                             extra_idx) -> torch.Tensor:
    """:func:`sparse_attention` of a tensor-only decode step (row b = sequence b at position p_b)."""
    t, _h, d = q.shape
    ring = swa_ring.shape[1]
    pos = meta.positions
    kpos = pos[:, None] - (window - 1) + torch.arange(window - 1, device=q.device)  # [B, W-1] earlier rows
    old = swa_ring.view(-1, d)[meta.seq_slots.long()[:, None] * ring + kpos.remainder(ring)]  # [B, W-1, d]
    keys = torch.cat([old.float(), kv.float()[:, None]], dim=1)  # [B, W, d] positions p-W+1 .. p
    visible = torch.cat([kpos >= 0, torch.ones_like(kpos[:, :1], dtype=torch.bool)], dim=1)  # [B, W]
    qf = q.float()
    logits = torch.einsum("bhd,bkd->bhk", qf, keys).mul_(scale).masked_fill_(~visible[:, None, :], float("-inf"))
    parts = [logits]
    if extra_idx is not None:
        per_block = extra_pool.shape[1]
        idx = extra_idx.long()
        block = meta.block_tables.gather(1, (idx.clamp(min=0) // per_block).to(meta.block_tables.dtype).long())
        rows = block.long() * per_block + idx.clamp(min=0) % per_block  # [B, K]
        ext = extra_pool.flatten(0, 1)[rows].float()  # [B, K, d]
        ext_logits = torch.einsum("bhd,bkd->bhk", qf, ext).mul_(scale)
        parts.append(ext_logits.masked_fill_((idx < 0)[:, None, :], float("-inf")))
    parts.append(sinks.float().view(1, -1, 1).expand(t, -1, 1))
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    o = torch.einsum("bhk,bkd->bhd", probs[..., :window], keys)
    if extra_idx is not None:
        o = o + torch.einsum("bhk,bkd->bhd", probs[..., window:-1], ext)
    return o.to(q.dtype)


def _window_logits(qt, keys_local, lo, p0, p1, window, scale):
    """Scores of queries at positions p0..p1 against their sliding windows."""
    k_lo = max(lo, p0 - window + 1)
    keys = keys_local[k_lo - lo:p1 + 1 - lo].float()  # [K, d] positions k_lo..p1
    logits = torch.einsum("qhd,kd->qhk", qt, keys)
    qpos = torch.arange(p0, p1 + 1, device=qt.device)[:, None]
    kpos = torch.arange(k_lo, p1 + 1, device=qt.device)[None, :]
    visible = (kpos <= qpos) & (kpos > qpos - window)  # [q, K]; the window includes the query
    return logits.mul_(scale).masked_fill_(~visible[:, None, :], float("-inf")), keys


@register("sparse_attention")
def sparse_attention(q: torch.Tensor, kv: torch.Tensor, swa_ring: torch.Tensor, sinks: torch.Tensor,
                     scale: float, window: int, meta, extra_pool: Optional[torch.Tensor] = None,
                     extra_idx: Optional[torch.Tensor] = None, q_tile: int = 256) -> torch.Tensor:
    """One joint softmax per head over (SWA window ∪ extra entries ∪ sink); V = K.

    q [T, H, d] roped queries; kv [T, d] this step's K=V rows (not yet in the ring);
    swa_ring [S, R, d] rows of earlier positions at ``pos % R`` of the sequence's slot;
    extra_pool [NB, E, d] compressed entries, extra_idx [T, K] logical entry ids per query
    (-1 = none); sinks [H] fp32 logits that only add to the denominator. Returns [T, H, d].
    """
    if getattr(meta, "tensor_only", False):
        return _sparse_attention_decode(q, kv, swa_ring, sinks, scale, window, meta, extra_pool, extra_idx)
    out = torch.empty_like(q)
    ring = swa_ring.shape[1]
    sink = sinks.float().view(1, -1, 1)
    flat_pool = extra_pool.flatten(0, 1) if extra_pool is not None else None
    for b, (s0, n, c, slot) in enumerate(_spans(meta)):
        lo = max(0, c - window + 1)
        old = torch.arange(lo, c, device=q.device) % ring
        keys_local = torch.cat([swa_ring[slot, old], kv[s0:s0 + n]])  # positions lo .. c+n-1
        for i0 in range(0, n, q_tile):
            i1 = min(n, i0 + q_tile)
            qt = q[s0 + i0:s0 + i1].float()
            logits, keys = _window_logits(qt, keys_local, lo, c + i0, c + i1 - 1, window, scale)
            parts, n_win = [logits], keys.shape[0]
            if extra_idx is not None:
                idx = extra_idx[s0 + i0:s0 + i1]
                valid = idx >= 0
                ext = flat_pool[_entry_rows(meta.block_tables[b], idx.clamp(min=0), extra_pool.shape[1])]
                ext = ext.float()  # [q, K, d]
                ext_logits = torch.einsum("qhd,qkd->qhk", qt, ext).mul_(scale)
                parts.append(ext_logits.masked_fill_(~valid[:, None, :], float("-inf")))
            parts.append(sink.expand(qt.shape[0], -1, 1))
            probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
            o = torch.einsum("qhk,kd->qhd", probs[..., :n_win], keys)
            if extra_idx is not None:
                o = o + torch.einsum("qhk,qkd->qhd", probs[..., n_win:-1], ext)
            out[s0 + i0:s0 + i1] = o.to(q.dtype)
    return out
