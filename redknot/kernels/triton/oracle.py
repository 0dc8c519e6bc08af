"""Plain PyTorch statements of what the Triton kernels compute, in their own (lowered) argument form.

The registry ops (``redknot.kernels.reference``) are the authority on semantics; these oracles restate
the same equations at the level the kernels see them (paged caches, block tables, per-token lists) so
each kernel can be checked on its own, in float64, loop by loop. They are deliberately slow and simple.
"""
from __future__ import annotations

import torch


def entry_rows(cache: torch.Tensor, block_table_row: torch.Tensor, entries: torch.Tensor, ratio: int,
               block_size: int) -> torch.Tensor:
    """Rows of a paged compressed cache ``[num_blocks, block_size // ratio, D]`` for entry ids ``entries``."""
    first = entries.long() * ratio
    blocks = block_table_row.long()[first // block_size]
    return cache[blocks, (first % block_size) // ratio]


def inverse_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of the last ``2*len(cos)`` columns by minus the angle, in place."""
    rd = 2 * cos.shape[-1]
    a = x[..., -rd::2].clone()
    b = x[..., -rd + 1::2].clone()
    x[..., -rd::2] = a * cos + b * sin
    x[..., -rd + 1::2] = -a * sin + b * cos
    return x


def sparse_attention_paged(q, kv, *, token_seq, positions, context_lens, query_start, window, sink, scale,
                           ring=None, seq_slots=None, cache=None, block_table=None, ratio=0, block_size=0,
                           topk=None, rope_cos=None, rope_sin=None):
    """Float64 oracle of :func:`redknot.kernels.triton.attention.sparse_attention_paged`."""
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=torch.float64, device=q.device)
    for i in range(T):
        b = int(token_seq[i])
        t = int(positions[i])
        ctx = int(context_lens[b])
        qs = int(query_start[b])
        rows = []
        for p in range(max(0, t - window + 1), t + 1):
            if p >= ctx:
                rows.append(kv[qs + p - ctx])
            else:
                rows.append(ring[int(seq_slots[b]), p % ring.shape[1]])
        keys = torch.stack(rows).double()
        if cache is not None:
            n_vis = (t + 1) // ratio
            if topk is not None:
                ent = topk[i].long()
                ent = ent[ent >= 0]
            else:
                ent = torch.arange(n_vis, device=q.device)
            if ent.numel():
                keys = torch.cat([keys, entry_rows(cache, block_table[b], ent, ratio, block_size).double()])
        logits = q[i].double() @ keys.T * scale  # [H, M]
        if sink is not None:
            logits = torch.cat([logits, sink.double()[:, None]], dim=1)
        p = torch.softmax(logits, dim=1)[:, :keys.shape[0]]
        out[i] = p @ keys
        if rope_cos is not None:
            inverse_rope_(out[i], rope_cos[i].double(), rope_sin[i].double())
    return out


def indexer_topk_paged(q, weights, *, token_seq, positions, keys, block_table, ratio, block_size, topk, scale):
    """Float64 oracle of the lightning indexer: scores over visible entries, ordered top-k.

    Returns (indices ``[T, topk]`` int32 with ``-1`` padding, ordered by score descending then index
    ascending; scores ``[T, n]`` float64 over each token's visible entries, ``-inf`` beyond).
    """
    T = q.shape[0]
    idx = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    max_vis = int(((positions.long() + 1) // ratio).max()) if T else 0
    scores = torch.full((T, max(max_vis, 1)), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(T):
        b = int(token_seq[i])
        n_vis = (int(positions[i]) + 1) // ratio
        if n_vis == 0:
            continue
        k = entry_rows(keys, block_table[b], torch.arange(n_vis, device=q.device), ratio, block_size).double()
        s = torch.relu(q[i].double() @ k.T)  # [H, n]
        s = (weights[i].double()[:, None] * s).sum(0) * scale
        scores[i, :n_vis] = s
        order = torch.sort(s, descending=True, stable=True).indices[:topk]  # equal scores: lower id first
        idx[i, :order.numel()] = order.to(torch.int32)
    return idx, scores

