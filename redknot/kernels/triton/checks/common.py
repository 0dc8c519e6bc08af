"""Dimensions, paged-step builders and comparison helpers shared by the kernel checks and benchmarks."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from redknot.step.metadata import StepMetadata

# Relative (norm-wise) tolerance by the dtype of the operands: fp32 runs exact FMA dots, bf16 rounds
# operands and outputs to 8 significant bits.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class Dims:
    """Model dimensions a check runs at."""
    heads: int
    head_dim: int
    rope_dim: int
    window: int
    csa_ratio: int
    hca_ratio: int
    topk: int
    index_heads: int
    index_dim: int
    hidden: int
    experts: int
    moe_inter: int
    experts_per_token: int
    hc_mult: int
    block_size: int


REAL = Dims(heads=64, head_dim=512, rope_dim=64, window=128, csa_ratio=4, hca_ratio=128, topk=512, index_heads=64,
            index_dim=128, hidden=4096, experts=16, moe_inter=512, experts_per_token=6, hc_mult=4, block_size=256)
TOY = Dims(heads=4, head_dim=64, rope_dim=16, window=8, csa_ratio=4, hca_ratio=8, topk=4, index_heads=16,
           index_dim=32, hidden=128, experts=8, moe_inter=32, experts_per_token=2, hc_mult=4, block_size=16)


@dataclass
class CheckResult:
    """One comparison of a Triton op with its reference."""
    op: str
    case: str
    dtype: str
    ok: bool
    err: float
    tol: float
    detail: str = ""

    def line(self) -> str:
        status = "PASS" if self.ok else "FAIL"
        return f"{status} {self.op:<18} {self.case:<44} {self.dtype:<9} err={self.err:.2e} tol={self.tol:.0e} {self.detail}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere (an unwritten poisoned element) gives inf."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    denom = r.norm().item()
    return (o - r).norm().item() / (denom if denom > 0 else 1.0)


def result(op: str, case: str, dtype: torch.dtype, out: torch.Tensor, ref: torch.Tensor,
           tol: Optional[float] = None, detail: str = "") -> CheckResult:
    tol = TOLERANCE[dtype] if tol is None else tol
    err = rel_err(out, ref)
    return CheckResult(op, case, str(dtype).replace("torch.", ""), err <= tol, err, tol, detail)


def poisoned(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """An output buffer full of NaN (or a sentinel for integers): anything left unwritten shows."""
    if dtype.is_floating_point:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.full(tuple(shape), -7, dtype=dtype, device=device)


@dataclass
class PagedStep:
    """One step of ``B`` sequences over a paged state: metadata plus the sizes of its storage."""
    meta: StepMetadata
    num_slots: int
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.meta.positions.shape[0])


def paged_step(context_lens: Sequence[int], new_tokens: Sequence[int], block_size: int, device,
               generator: Optional[torch.Generator] = None) -> PagedStep:
    """Sequences with the given context lengths and new-token counts, slots in shuffled order and
    physical blocks scattered at random over a pool with a few spare blocks."""
    b = len(context_lens)
    need = [-(-(c + n) // block_size) for c, n in zip(context_lens, new_tokens)]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    slots = torch.randperm(b + 1, generator=generator)[:b].tolist()
    meta = StepMetadata.build([[0] * n for n in new_tokens], list(context_lens), slots, tables, device=device)
    return PagedStep(meta, num_slots=b + 1, num_blocks=num_blocks, block_size=block_size)


def visible_lists(positions: torch.Tensor, ratio: int) -> Optional[torch.Tensor]:
    """``[T, max visible]`` ids of all entries ``w < (t+1)//ratio`` per query (-1 pads), as HCA layers pass."""
    most = int(((positions.max() + 1) // ratio).item()) if positions.numel() else 0
    if most == 0:
        return None
    w = torch.arange(most, device=positions.device)
    visible = (positions + 1) // ratio
    return torch.where(w[None, :] < visible[:, None], w[None, :], torch.full_like(w[None, :], -1))


def random_choice_lists(positions: torch.Tensor, ratio: int, topk: int, generator=None) -> torch.Tensor:
    """``[T, topk]`` distinct visible entry ids per query in random order, -1 padded (an indexer stand-in).

    With a CPU ``generator`` the draw is reproducible; without one it is drawn on the positions' device."""
    n_vis = (positions.long() + 1) // ratio
    most = max(int(n_vis.max()) if positions.numel() else 0, 1)
    if generator is not None:
        r = torch.rand(positions.shape[0], most, generator=generator).to(positions.device)
    else:
        r = torch.rand(positions.shape[0], most, device=positions.device)
    w = torch.arange(most, device=positions.device)
    r = torch.where(w[None, :] < n_vis[:, None], r, torch.full_like(r, -1.0))
    k = min(topk, most)
    val, idx = r.topk(k, dim=1)
    idx = torch.where(val >= 0, idx, torch.full_like(idx, -1))
    if k < topk:
        idx = torch.cat([idx, idx.new_full((idx.shape[0], topk - k), -1)], dim=1)
    return idx


def prefill_attention_args(d: Dims, mode: str, context: int, new: int, device, generator: torch.Generator) -> dict:
    """``sparse_attention_paged`` keyword arguments of one sequence's prefill chunk (``new`` queries ending at
    ``context``) at dims ``d``: fresh random bf16 rows in this step, the ring and the compressed cache, a
    shuffled block table; the compressed entries as the kernels read them after the indexer (``mode`` "csa":
    ``d.topk`` random distinct visible entries a query, -1 padded; "hca": every visible entry), already mapped
    to cache rows (ratio 1 over ``block_size // ratio`` rows a block)."""
    from redknot.kernels.step_index import step_tensors
    step = paged_step([context - new], [new], d.block_size, device, generator)
    meta, t = step.meta, step.num_tokens
    rnd = lambda *shape: torch.randn(*shape, generator=generator).to(device, torch.bfloat16)
    ratio = d.csa_ratio if mode == "csa" else d.hca_ratio
    st = step_tensors(meta)
    return {"q": rnd(t, d.heads, d.head_dim), "kv": rnd(t, d.head_dim), "token_seq": st.token_seq,
            "positions": meta.positions, "context_lens": st.context_lens, "query_start": st.query_start,
            "window": d.window, "sink": torch.randn(d.heads, generator=generator).to(device),
            "scale": d.head_dim ** -0.5, "ring": rnd(step.num_slots, d.window + 8, d.head_dim),
            "seq_slots": meta.seq_slots, "cache": rnd(step.num_blocks, d.block_size // ratio, d.head_dim),
            "block_table": meta.block_tables, "ratio": 1, "block_size": d.block_size // ratio,
            "topk": (random_choice_lists(meta.positions, ratio, d.topk, generator) if mode == "csa"
                     else visible_lists(meta.positions, ratio))}


def rope_tables(positions: torch.Tensor, rope_dim: int) -> tuple:
    """cos/sin ``[T, rope_dim/2]`` fp32 of a YaRN-free rope with base 160000 at the given positions."""
    inv = 160000.0 ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
    ang = positions.float()[:, None] * inv.float()[None, :]
    return ang.cos(), ang.sin()
