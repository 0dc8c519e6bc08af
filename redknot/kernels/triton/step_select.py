"""The tensor step's top-k and candidate-block selections through the radix-select kernel, guarded.

:func:`step_indexer_mx.select_topk` and :func:`step_indexer_mx.candidate_entries` state the selections
in PyTorch (a top-k over packed tie keys, then a sort; block maxima, a pin, a top-k, an expansion) and
stay their references. Here the same results come from :mod:`radix_select` in one or two launches each.
On the first call per CUDA device (outside CUDA-graph capture) every mode, under every launch
configuration the tuner may choose (``radix_select.CANDIDATES``), is checked against those
references on fresh random rows (heavy exact ties, -inf tails, rows with nothing selectable, fewer
entries than k, rows long enough for the two-launch split); a build failure or a mismatch is recorded in
``SELECT_ERRORS``, warned once, and the references run from then on (the GPU tests fail on it). Off the
GPU errors propagate, so the interpreter tests exercise the kernel itself.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Optional, Set, Tuple, TypeVar

import torch

from redknot.kernels.triton.radix_select import CANDIDATES, radix_candidates, radix_topk
from redknot.kernels.triton.step_indexer_mx import candidate_entries, select_topk
from redknot.kernels.triton.stream_guard import first_use

R = TypeVar("R")
SELECT_ERRORS: Dict[str, str] = {}   # device -> why the radix selection is not used there
_CHECKED: Set[str] = set()


def topk_reference(scores: torch.Tensor, topk: int, ids: Optional[torch.Tensor] = None,
                   block_mask: Optional[torch.Tensor] = None, mask_block: int = 1) -> torch.Tensor:
    """:func:`radix_topk` in PyTorch: ``select_topk`` over the scores with entries outside the set blocks
    of ``block_mask`` (and columns listing -1) at -inf, mapped through the entry list ``ids``."""
    if block_mask is not None:
        n = scores.shape[1]
        blk = torch.arange(n, device=scores.device) // mask_block
        nb = block_mask.shape[1]
        keep = block_mask.bool().gather(1, blk.clamp(max=nb - 1).expand(scores.shape[0], n)) & (blk < nb)
        scores = scores.masked_fill(~keep, float("-inf"))
    if ids is None:
        return select_topk(scores, topk)
    at = select_topk(scores.masked_fill(ids < 0, float("-inf")), topk)       # a listed -1 is no entry
    got = ids.long().gather(1, at.clamp(min=0))
    return torch.where(at >= 0, got, torch.full_like(got, -1))


def candidates_reference(scores: torch.Tensor, visible: torch.Tensor, num_blocks: int, block: int
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`radix_candidates` in PyTorch: ``candidate_entries`` and the map of its blocks."""
    ent = candidate_entries(scores, visible, num_blocks, block)
    t, n = scores.shape
    nblk = -(-n // block)
    first = ent.view(t, -1, block)[:, :, 0]                                   # [T, NB] first entry or -1
    mask = torch.zeros(t, nblk + 1, dtype=torch.uint8, device=scores.device)
    mask.scatter_(1, torch.where(first >= 0, first // block, nblk), 1)
    return ent, mask[:, :nblk].contiguous()


def self_check(device: torch.device, seed: int = 4321) -> Optional[str]:
    """None when every radix mode returns what its reference returns on ``device``, else what differs."""
    g = torch.Generator(device=device).manual_seed(seed)
    # resident segments of 1024, 4096 and 8192 columns (4, 8 and 16 warps), the two-launch split, fewer
    # entries than k; (1, 4096, 512) is the batch-1 decode step's selection
    for t, n, k in ((3, 1000, 64), (1, 4096, 512), (3, 70000, 512), (2, 40, 64)):
        sc = torch.randint(-6, 7, (t, n), generator=g, device=device).float() * 0.125   # many exact ties
        sc[0] = torch.randn(n, generator=g, device=device)
        sc[-1, n // 3:] = float("-inf")
        if t > 2:
            sc[1] = float("-inf")
        vis = torch.tensor([n, n // 2, 0][:t], device=device)
        nb = -(-n // 8)
        bm = (torch.rand(t, nb, generator=g, device=device) < 0.5).to(torch.uint8)
        ids = torch.where(torch.rand(t, n, generator=g, device=device) < 0.9,
                          torch.arange(n, device=device) * 3, -1)
        for c in CANDIDATES:   # every launch configuration the tuner may choose
            for name, got, want in _modes(sc, k, ids, bm, vis, c):
                a, b = got(), want()
                if not all(torch.equal(x, y) for x, y in zip(_tuple(a), _tuple(b))):
                    return f"radix {name} selection ({c}) differs from its reference (rows {t}, n {n}, k {k})"
    return None


def _modes(sc, k, ids, bm, vis, c):
    """(name, the radix selection under config ``c``, its reference) of every mode the step uses."""
    return (("topk", lambda: radix_topk(sc, k, config=c), lambda: select_topk(sc, k)),
            ("entry list", lambda: radix_topk(sc, k, ids=ids, config=c), lambda: topk_reference(sc, k, ids=ids)),
            ("block mask", lambda: radix_topk(sc, k, block_mask=bm, mask_block=8, config=c),
             lambda: topk_reference(sc, k, block_mask=bm, mask_block=8)),
            ("candidates", lambda: radix_candidates(sc, vis, k // 4, 8, config=c),
             lambda: candidates_reference(sc, vis, k // 4, 8)),
            ("candidates split", lambda: radix_candidates(sc, vis, k // 4, 8, seg=4 * k, config=c),
             lambda: candidates_reference(sc, vis, k // 4, 8)))


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def guarded(device: torch.device, fast: Callable[[], R], reference: Callable[[], R]) -> R:
    """``fast()`` unless the radix selection failed its build or self-check on this CUDA device."""
    if device.type != "cuda":
        return fast()
    return first_use(str(device), _CHECKED, SELECT_ERRORS, lambda: self_check(device), fast, reference, _fail)


def _fail(device: str, err: str) -> None:
    SELECT_ERRORS[device] = err
    warnings.warn(f"radix selection is not used on {device} ({err}); running select_topk / candidate_entries")


def topk_select(scores: torch.Tensor, topk: int, ids: Optional[torch.Tensor] = None,
                block_mask: Optional[torch.Tensor] = None, mask_block: int = 1) -> torch.Tensor:
    """The ``topk`` best entries ascending then -1 (see :func:`radix_topk` for ``ids`` and ``block_mask``)."""
    return guarded(scores.device, lambda: radix_topk(scores, topk, ids, block_mask, mask_block),
                   lambda: topk_reference(scores, topk, ids, block_mask, mask_block))


def candidate_select(scores: torch.Tensor, visible: torch.Tensor, num_blocks: int, block: int
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The candidate blocks as (entry lists [T, num_blocks·block], block map [T, ceil(n / block)] uint8)."""
    if block < 1 or block & (block - 1):   # the kernel reads a block as one power-of-two tile
        return candidates_reference(scores, visible, num_blocks, block)
    return guarded(scores.device, lambda: radix_candidates(scores, visible, num_blocks, block),
                   lambda: candidates_reference(scores, visible, num_blocks, block))
