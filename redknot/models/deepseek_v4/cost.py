"""RedKnot's cost model of V4 (reference §9): prefill FLOPs by part, decode bytes per step,
and the H200 floors they imply. Pure Python; works for the full model or any cut.

Conventions (the same as the shared roofline tool): linear layers cost 2 FLOPs per active
weight per token (attention projections, compressors, indexer projections, the router,
``num_experts_per_tok`` routed + 1 shared expert; embedding and mHC excluded, lm_head
counted separately); attention costs 4·H·hd FLOPs per (query, key) pair (QKᵀ and PV) over
exact causal sums: SWA window incl. the query, CSA top-k of the visible ratio-4 entries, HCA
all visible entries, the indexer 2·IH·ID per (query, visible CSA entry). A decode step at
batch 1 reads the active weights once plus the sequence's window, selected CSA entries, all
indexer keys and all HCA entries of every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from redknot.models.deepseek_v4.config import CSA, HCA, V4Config


@dataclass(frozen=True)
class Ceilings:
    """Peak rates of one device."""
    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float


H200 = Ceilings("H200", bf16_flops=796e12, fp8_flops=1451e12, hbm_bytes_per_s=4.17e12)


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs of one prompt of ``num_tokens`` tokens (lm_head for one row)."""
    num_tokens: int
    linear: float
    swa: float
    csa: float
    hca: float
    indexer: float
    lm_head: float

    @property
    def attention(self) -> float:
        return self.swa + self.csa + self.hca + self.indexer

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head

    def floor_s(self, dev: Ceilings = H200, fp8: bool = False) -> float:
        """Time at the matmul ceiling: everything bf16, or linear + indexer at the fp8 rate."""
        if not fp8:
            return self.total / dev.bf16_flops
        return (self.linear + self.indexer + self.lm_head) / dev.fp8_flops + \
            (self.swa + self.csa + self.hca) / dev.bf16_flops


@dataclass(frozen=True)
class DecodeCost:
    """One decode step of one sequence at context ``context``."""
    context: int
    weight_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def floor_s(self, dev: Ceilings = H200) -> float:
        return max(self.bytes / dev.hbm_bytes_per_s, self.flops / dev.bf16_flops)


def _pairs_window(n: int, window: int) -> int:
    """Σ_{u=1..n} min(u, window): keys of every query in its sliding window."""
    if n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def _pairs_visible(n: int, m: int, cap: Optional[int] = None) -> int:
    """Σ_{u=1..n} min(floor(u/m), cap): visible compressed entries of every query."""
    def uncapped(k: int) -> int:
        q, r = divmod(k, m)
        return m * q * (q - 1) // 2 + q * (r + 1)
    if cap is None or n < m * cap:
        return uncapped(n)
    return uncapped(m * cap - 1) + cap * (n - m * cap + 1)


class CostModel:
    """Costs of a V4 config (use ``cfg.cut(n)`` or custom layer types for partial models)."""

    def __init__(self, cfg: V4Config):
        self.cfg = cfg

    def _attention_weights(self) -> int:
        c = self.cfg
        return (c.hidden_size * c.q_lora_rank + c.q_lora_rank * c.num_heads * c.head_dim
                + c.hidden_size * c.head_dim + c.num_heads * c.head_dim * c.o_lora_rank
                + c.o_groups * c.o_lora_rank * c.hidden_size)

    def active_linear_params(self, layer_kind: str) -> int:
        """Weights one token multiplies in a layer of the given type (router included)."""
        c = self.cfg
        n = self._attention_weights() + (c.num_experts_per_tok + 1) * 3 * c.hidden_size * c.moe_intermediate_size
        n += c.hidden_size * c.n_routed_experts
        if layer_kind == CSA:
            n += c.hidden_size * 2 * 2 * c.head_dim
            n += c.q_lora_rank * c.index_n_heads * c.index_head_dim + c.hidden_size * c.index_n_heads
            n += c.hidden_size * 2 * 2 * c.index_head_dim
        elif layer_kind == HCA:
            n += c.hidden_size * 2 * c.head_dim
        return n

    def prefill(self, num_tokens: int) -> PrefillCost:
        c, n = self.cfg, num_tokens
        core = 4 * c.num_heads * c.head_dim
        lin = swa = csa = hca = idx = 0
        for kind in c.layer_types:
            lin += 2 * self.active_linear_params(kind) * n
            swa += _pairs_window(n, c.sliding_window) * core
            if kind == CSA:
                csa += _pairs_visible(n, c.csa_ratio, c.index_topk) * core
                idx += _pairs_visible(n, c.csa_ratio) * 2 * c.index_n_heads * c.index_head_dim
            elif kind == HCA:
                hca += _pairs_visible(n, c.hca_ratio) * core
        return PrefillCost(n, float(lin), float(swa), float(csa), float(hca), float(idx),
                           2.0 * c.vocab_size * c.hidden_size)

    def decode(self, context: int, weight_bytes: float = 2.0, kv_bytes: float = 2.0) -> DecodeCost:
        """Batch-1 step at ``context`` tokens of history (lm_head weights and FLOPs excluded)."""
        c, n = self.cfg, context
        core = 4 * c.num_heads * c.head_dim
        weights = kv = flops = 0.0
        for kind in c.layer_types:
            weights += self.active_linear_params(kind) * weight_bytes
            flops += 2 * self.active_linear_params(kind)
            keys = c.sliding_window
            kv += c.sliding_window * c.head_dim * kv_bytes
            if kind == CSA:
                chosen, entries = min(n // c.csa_ratio, c.index_topk), n // c.csa_ratio
                kv += (chosen * c.head_dim + entries * c.index_head_dim) * kv_bytes
                keys += chosen
                flops += entries * 2 * c.index_n_heads * c.index_head_dim
            elif kind == HCA:
                kv += (n // c.hca_ratio) * c.head_dim * kv_bytes
                keys += n // c.hca_ratio
            flops += keys * core
        return DecodeCost(n, weights, kv, flops)
