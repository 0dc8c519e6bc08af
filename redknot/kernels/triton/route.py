"""V4's MoE routing (the ``route`` registry op) in one launch: one program per token holds the token's expert
affinities, takes its experts (the hash table's row, or the top-k of affinities + bias by repeated maxima: best
first, ties to the lower expert id) and renormalises their affinities to sum 1 times the routed scale, instead of
the reference's five to seven PyTorch launches (index or add + top-k, gather, sum, add, divide, multiply)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import next_pow2


@triton.jit
def _route(s_ptr, b_ptr, tab_ptr, ids_ptr, idx_ptr, w_ptr, E, stride_s, stride_tab, scaling, K: tl.constexpr,
           HASH: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    em = e < E
    kk = tl.arange(0, KP)
    km = kk < K
    row = s_ptr + t.to(tl.int64) * stride_s
    if HASH:
        tok = tl.load(ids_ptr + t).to(tl.int64)
        ids = tl.load(tab_ptr + tok * stride_tab + kk, mask=km, other=0).to(tl.int64)
        w = tl.load(row + ids, mask=km, other=0.0)
    else:
        sc = tl.load(row + e, mask=em, other=0.0)
        v = tl.where(em, sc + tl.load(b_ptr + e, mask=em, other=0.0), float("-inf"))
        ids = tl.zeros([KP], tl.int64)
        w = tl.zeros([KP], tl.float32)
        for j in tl.static_range(K):
            best = tl.max(v, 0)
            i = tl.min(tl.where(v == best, e, EP), 0)   # the lowest expert id among equal maxima
            ids = tl.where(kk == j, i.to(tl.int64), ids)
            w = tl.where(kk == j, tl.sum(tl.where(e == i, sc, 0.0), 0), w)
            v = tl.where(e == i, float("-inf"), v)
    w = w / (tl.sum(tl.where(km, w, 0.0), 0) + 1e-20) * scaling
    tl.store(idx_ptr + t * K + kk, ids, mask=km)
    tl.store(w_ptr + t * K + kk, w, mask=km)


def supported(scores: torch.Tensor, top_k: int) -> bool:
    """One program holds a token's affinities: up to 4096 experts, fp32, contiguous rows."""
    return (scores.dim() == 2 and scores.dtype == torch.float32 and scores.stride(-1) == 1
            and 0 < scores.shape[1] <= 4096 and 0 < top_k <= scores.shape[1])


def route(scores: torch.Tensor, bias: Optional[torch.Tensor], tid2eid: Optional[torch.Tensor],
          input_ids: torch.Tensor, top_k: int, scaling: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``reference.route`` in one launch (see the module docstring)."""
    T, E = scores.shape
    idx = torch.empty(T, top_k, dtype=torch.int64, device=scores.device)
    w = torch.empty(T, top_k, dtype=torch.float32, device=scores.device)
    if T == 0:
        return idx, w
    hashed = tid2eid is not None
    tab = tid2eid if hashed else scores
    _route[(T,)](scores, bias if bias is not None else scores, tab, input_ids if hashed else scores, idx, w, E,
                 scores.stride(0), tab.stride(0), float(scaling), K=top_k, HASH=hashed, EP=next_pow2(E),
                 KP=next_pow2(top_k), num_warps=4)
    return idx, w
