"""Cost model and memory plan of DeepSeek-V4.1 (pure Python; any config, the real one or a cut).

FLOPs (same conventions as the shared roofline tool and the V4 cost model): a linear layer
costs 2 FLOPs per active weight per token (attention projections, compressor and
index-key projections of the kv sources, indexer projections of the index sources,
router, top-k routed + shared expert, Engram projection, mHC mixes; embedding gather
excluded, lm_head counted apart); attention costs 4·H·Dh per (query, key) pair (QKᵀ and
PV; K = V) over exact causal sums: the window (incl. the query) on every layer, plus
``min(visible entries, index_topk)`` compressed keys on every ratio != 0 layer; an index
source costs 2·Hi·Di per (query, scored entry), where a re-indexing layer (above the
candidate source) scores only the candidate pool (``candidate_topk_blocks ×
candidate_block_size`` entries).

Bytes of a decode step at batch 1: the active weights in their stored formats (FP8 1 B,
MXFP4 0.5 B, BF16 2 B, plus one E8M0 byte per scaled block), the Engram rows read (24
rows of 264 B per Engram layer), and the cache rows read in their trained byte formats:
every layer's window ring (528 B a row), each consumer's selected compressed entries
(288 B), and each index source's scored index keys (68 B).

Memory plan (:func:`memory_plan`): weights per GPU for a parallel layout -- routed
experts (backbone and DSpark) sharded over ``ep``, every other dense weight replicated,
the Engram tables placed by ``features.parallel.engram_placement`` -- and the sequences
of a given context one GPU's remaining memory holds (global KV: 890 B per token for
V4.1-Flash, plus the fixed window rings and compressor carry-over per sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from redknot.models.deepseek_v41 import state_layout
from redknot.models.deepseek_v4.cost import H200, Ceilings  # the device peak rates both families use
from redknot.models.deepseek_v41.checkpoint import ENGRAM, ROUTED, checkpoint_spec

GIB = 1 << 30
MX = 32

# Engram table placement (features.parallel.engram_placement).
SHARDED, REPLICATED, HOST = "sharded", "replicated", "host"
ENGRAM_PLACEMENTS = (SHARDED, REPLICATED, HOST)
DEFAULT_ENGRAM_PLACEMENT = SHARDED

# Memory one device reports (torch total_memory), by device name; used where no device is probed.
DEVICE_MEMORY = {"H200": int(139.8 * GIB), "H100": int(79.1 * GIB), "B200": int(178.4 * GIB)}
WORKSPACE_BYTES = 4 * GIB   # activations, graphs and allocator slack kept out of the cache budget




# ---------------------------------------------------------------------------- row sizes
def window_row_bytes(cfg) -> int:
    """FP8 e4m3 over the whole head + one E8M0 per 32 (528 B at head_dim 512)."""
    return state_layout.window_row_bytes(cfg.head_dim)


def compressed_entry_bytes(cfg) -> int:
    """FP4 e2m1 + one E4M3 scale per 16 (288 B at head_dim 512)."""
    return state_layout.compressed_entry_bytes(cfg.head_dim)


def index_key_bytes(cfg) -> int:
    """FP4 e2m1 + one E8M0 per 32 (68 B at index_head_dim 128)."""
    return state_layout.index_key_bytes(cfg.index_head_dim)


def global_kv_bytes_per_token(cfg) -> float:
    """Compressed KV + index keys of every kv source per token: Σ (288 + 68) / r (890 for V4.1-Flash)."""
    per = compressed_entry_bytes(cfg) + index_key_bytes(cfg)
    return sum(per / cfg.compress_ratios[s] for s in cfg.kv_source_layers)


def sequence_bytes(cfg, context: int, with_draft: bool = True) -> int:
    """State one sequence of ``context`` tokens holds: window rings of every layer (and the DSpark
    stages), the global caches, the ratio-2 compressors' fp32 carry-over [2, 2, head_dim]."""
    rings = (cfg.n_layers + (cfg.n_mtp_layers if with_draft else 0)) * cfg.window_size * window_row_bytes(cfg)
    per = compressed_entry_bytes(cfg) + index_key_bytes(cfg)
    glob = sum((context // cfg.compress_ratios[s]) * per for s in cfg.kv_source_layers)
    carry = sum(2 * 2 * cfg.head_dim * 4 for s in cfg.kv_source_layers if cfg.compress_ratios[s] > 1)
    return rings + glob + carry


# ---------------------------------------------------------------------------- FLOPs and bytes
def _stored_bytes_per_param(kind: str) -> float:
    return {"fp8": 1 + 1 / 1024, "fp4": 0.5 + 1 / MX, "engram": 1 + 1 / MX, "bf16": 2.0, "f32": 4.0}[kind]


def _pairs_window(n: int, window: int, start: int = 0) -> int:
    """Σ over queries u = start+1..n of min(u, window)."""
    def upto(m: int) -> int:
        return m * (m + 1) // 2 if m <= window else window * (window + 1) // 2 + (m - window) * window
    return upto(n) - upto(start)


def _pairs_visible(n: int, r: int, cap: Optional[int] = None, start: int = 0) -> int:
    """Σ over queries u = start+1..n of min(floor(u / r), cap)."""
    def upto(k: int) -> int:
        if k <= 0:
            return 0
        if cap is not None and k >= r * cap:
            return upto(r * cap - 1) + cap * (k - r * cap + 1)
        q, rem = divmod(k, r)
        return r * q * (q - 1) // 2 + q * (rem + 1)
    return upto(n) - upto(start)


@dataclass(frozen=True)
class PrefillCost:
    """FLOPs of one prompt of ``num_tokens`` tokens (lm_head for one row)."""
    num_tokens: int
    linear: float
    window: float
    compressed: float
    indexer: float
    lm_head: float

    @property
    def attention(self) -> float:
        return self.window + self.compressed + self.indexer

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head

    @property
    def per_token(self) -> float:
        return self.total / max(1, self.num_tokens)

    def floor_s(self, dev: Ceilings = H200, fp8: bool = True) -> float:
        """Time at the matmul ceiling: linears and the indexer at the FP8 rate (or all bf16)."""
        if not fp8:
            return self.total / dev.bf16_flops
        return (self.linear + self.indexer + self.lm_head) / dev.fp8_flops + \
            (self.window + self.compressed) / dev.bf16_flops


@dataclass(frozen=True)
class DecodeCost:
    """One decode step of one sequence at context ``context`` (batch 1; lm_head included)."""
    context: int
    weight_bytes: float
    engram_bytes: float
    kv_bytes: float
    flops: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.engram_bytes + self.kv_bytes

    def floor_s(self, dev: Ceilings = H200) -> float:
        return max(self.bytes / dev.hbm_bytes_per_s, self.flops / dev.fp8_flops)


class CostModel:
    """Costs of a V4.1 config (from its checkpoint schema, so a cut or a toy config works too)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._params: Dict[int, float] = {}
        self._bytes: Dict[int, float] = {}
        for s in checkpoint_spec(cfg, include_draft=False):
            if s.layer is None or len(s.shape) != 2 or s.kind == ENGRAM:
                continue
            if s.component == ROUTED and s.expert >= cfg.n_activated_experts:
                continue
            per_token = s.numel
            if s.name.endswith("indexer.wk.weight"):   # runs once per compressed entry
                per_token = s.numel / cfg.compress_ratios[s.layer]
            self._params[s.layer] = self._params.get(s.layer, 0) + per_token
            self._bytes[s.layer] = self._bytes.get(s.layer, 0) + per_token * _stored_bytes_per_param(s.kind)

    def active_linear_params(self, layer: int) -> float:
        """Weights one token multiplies in ``layer`` (mHC mixes, router and Engram projection included)."""
        return self._params.get(layer, 0.0)

    def prefill(self, num_tokens: int, keep_tokens: Optional[int] = None, split_layer: Optional[int] = None
                ) -> PrefillCost:
        """One prompt; with ``keep_tokens`` (bounded replay) layers ``split_layer``.. (default: above the
        last kv source) run only on the last ``keep_tokens`` rows (their window keys included)."""
        c, n = self.cfg, num_tokens
        core = 4 * c.n_heads * c.head_dim
        split = split_layer if split_layer is not None else max(c.kv_source_layers, default=-1) + 1
        lin = win = comp = idx = 0.0
        for layer in range(c.n_layers):
            start = max(0, n - keep_tokens) if keep_tokens is not None and layer >= split else 0
            rows = n - start
            lin += 2 * self.active_linear_params(layer) * rows
            win += _pairs_window(n, c.window_size, start) * core
            r = c.compress_ratios[layer]
            if r:
                comp += _pairs_visible(n, r, c.index_topk, start) * core
                if c.is_index_source(layer):
                    cap = c.candidate_topk_blocks * c.candidate_block_size if c.reads_candidates(layer) else None
                    idx += _pairs_visible(n, r, cap, start) * 2 * c.index_n_heads * c.index_head_dim
        return PrefillCost(n, lin, win, comp, idx, 2.0 * c.vocab_size * c.dim)

    def decode(self, context: int) -> DecodeCost:
        """A batch-1 step at ``context`` tokens of history."""
        c, n = self.cfg, context
        core = 4 * c.n_heads * c.head_dim
        weights = 2.0 * c.vocab_size * c.dim          # BF16 head
        flops = 2.0 * c.vocab_size * c.dim
        kv = engram = 0.0
        for layer in range(c.n_layers):
            weights += self._bytes.get(layer, 0.0)
            flops += 2 * self.active_linear_params(layer)
            keys = min(n + 1, c.window_size)
            kv += keys * window_row_bytes(c)
            r = c.compress_ratios[layer]
            if r:
                visible = (n + 1) // r
                chosen = min(visible, c.index_topk)
                keys += chosen
                kv += chosen * compressed_entry_bytes(c)
                if c.is_index_source(layer):
                    scored = min(visible, c.candidate_topk_blocks * c.candidate_block_size) \
                        if c.reads_candidates(layer) else visible
                    kv += scored * index_key_bytes(c)
                    flops += scored * 2 * c.index_n_heads * c.index_head_dim
            flops += keys * core
            if c.is_engram(layer):
                engram += c.n_engram_cols * (c.engram_head_dim + c.engram_head_dim // MX)
        return DecodeCost(n, weights, engram, kv, flops)


# ---------------------------------------------------------------------------- memory plan
@dataclass(frozen=True)
class MemoryPlan:
    """Per-GPU memory of one parallel layout (bytes)."""
    ep: int
    dp: int
    engram_placement: str
    device_name: str
    device_bytes: int
    memory_utilization: float
    routed_experts: int        # backbone routed experts on this GPU (stored + scales)
    draft_experts: int         # DSpark routed experts on this GPU
    dense: int                 # everything else but the Engram tables, replicated
    engram: int                # Engram tables on this GPU (0 when in host memory)
    engram_host: int           # Engram tables in host memory (per node)
    workspace: int
    kv_per_token: float        # global KV bytes per token (890 for V4.1-Flash)
    contexts: Tuple[int, ...] = ()
    sequence_bytes: Tuple[int, ...] = ()
    with_draft: bool = True
    notes: Tuple[str, ...] = field(default=())

    @property
    def weights(self) -> int:
        return self.routed_experts + self.draft_experts + self.dense + self.engram

    @property
    def budget(self) -> int:
        """Bytes of the device the engine may take."""
        return int(self.device_bytes * self.memory_utilization)

    @property
    def free_for_state(self) -> int:
        return self.budget - self.weights - self.workspace

    @property
    def fits(self) -> bool:
        return self.free_for_state > (self.sequence_bytes[0] if self.sequence_bytes else 0)

    def sequences(self, context: int) -> int:
        """Sequences of ``context`` tokens one GPU holds."""
        i = self.contexts.index(context)
        return max(0, self.free_for_state // self.sequence_bytes[i])

    def kv_tokens(self) -> int:
        """Global-KV token capacity of one GPU (window rings of a single sequence set aside)."""
        return max(0, int(self.free_for_state // self.kv_per_token))

    def describe(self) -> List[str]:
        g = GIB
        lines = [
            f"layout dp={self.dp} ep={self.ep}, Engram tables {self.engram_placement}; device {self.device_name} "
            f"{self.device_bytes / g:.1f} GiB x memory_utilization {self.memory_utilization} = "
            f"{self.budget / g:.1f} GiB",
            f"weights per GPU {self.weights / g:.1f} GiB: routed experts {self.routed_experts / g:.1f} "
            f"(/{self.ep}), DSpark experts {self.draft_experts / g:.1f} (/{self.ep}), dense (replicated) "
            f"{self.dense / g:.1f}, Engram {self.engram / g:.1f}"
            + (f" (+{self.engram_host / g:.1f} GiB host memory per node)" if self.engram_host else ""),
            f"workspace {self.workspace / g:.1f} GiB; left for state {self.free_for_state / g:.1f} GiB; "
            f"global KV {self.kv_per_token:.0f} B/token -> {self.kv_tokens():,} tokens per GPU",
        ]
        for ctx, per in zip(self.contexts, self.sequence_bytes):
            lines.append(f"context {ctx:,}: {per / 2**20:.1f} MiB per sequence (window rings + global KV) -> "
                         f"{self.sequences(ctx):,} sequences per GPU")
        lines.extend(self.notes)
        return lines


def _split(cfg, include_draft: bool):
    routed = draft_routed = dense = engram = 0
    per_table: List[int] = []
    for s in checkpoint_spec(cfg, include_draft=include_draft):
        b = s.nbytes + s.scale_numel
        if s.kind == ENGRAM:
            engram += b
            per_table.append(b)
        elif s.component == ROUTED:
            if s.draft:
                draft_routed += b
            else:
                routed += b
        else:
            dense += b
    return routed, draft_routed, dense, engram, per_table


def memory_plan(cfg, *, ep: int = 1, dp: int = 1, engram_placement: str = DEFAULT_ENGRAM_PLACEMENT,
                device_bytes: int, device_name: str = "device", memory_utilization: float = 0.9,
                workspace_bytes: int = WORKSPACE_BYTES, contexts: Sequence[int] = (131072, 1048576),
                include_draft: bool = True) -> MemoryPlan:
    """Weights and state capacity per GPU. Routed experts (backbone and DSpark) are split evenly
    over the ``ep`` ranks (ceil(E/ep) experts a layer); ``sharded`` Engram tables are split by rows
    over the same ranks, ``replicated`` ones are whole on every GPU, ``host`` ones stay in host memory."""
    if engram_placement not in ENGRAM_PLACEMENTS:
        raise ValueError(f"features.parallel.engram_placement={engram_placement!r}: allowed values are "
                         f"{list(ENGRAM_PLACEMENTS)}")
    if ep < 1 or dp < 1:
        raise ValueError(f"features.parallel.ep={ep}, dp={dp}: must be >= 1")
    routed, draft_routed, dense, engram, tables = _split(cfg, include_draft)
    per_rank = -(-cfg.n_routed_experts // ep) / cfg.n_routed_experts
    draft_rank = -(-cfg.dspark_n_routed_experts // ep) / cfg.dspark_n_routed_experts
    if engram_placement == SHARDED:
        on_gpu, host = sum(-(-t // ep) for t in tables), 0
    elif engram_placement == REPLICATED:
        on_gpu, host = engram, 0
    else:
        on_gpu, host = 0, engram
    notes = cost_lines(cfg, contexts)
    if engram_placement == HOST:
        notes.append(f"host Engram: {cfg.n_engram_cols} rows x {cfg.engram_head_dim + cfg.engram_head_dim // MX} B "
                     f"per token per Engram layer cross PCIe")
    return MemoryPlan(ep=ep, dp=dp, engram_placement=engram_placement, device_name=device_name,
                      device_bytes=int(device_bytes), memory_utilization=memory_utilization,
                      routed_experts=int(routed * per_rank), draft_experts=int(draft_routed * draft_rank),
                      dense=dense, engram=on_gpu, engram_host=host, workspace=int(workspace_bytes),
                      kv_per_token=global_kv_bytes_per_token(cfg), contexts=tuple(contexts),
                      sequence_bytes=tuple(sequence_bytes(cfg, n, include_draft) for n in contexts),
                      with_draft=include_draft, notes=tuple(notes))


def cost_lines(cfg, contexts: Sequence[int] = (131072, 1048576), keep_tokens: int = 140,
               dev: Ceilings = H200) -> List[str]:
    """Prefill FLOPs per token (exact and bounded replay) and batch-1 decode bytes per step, with
    the one-device floors they imply (FP8 linears)."""
    cm = CostModel(cfg)
    lines = []
    for n in contexts:
        full, tail = cm.prefill(n), cm.prefill(n, keep_tokens=keep_tokens)
        step = cm.decode(n)
        lines.append(
            f"cost at {n:,} tokens: prefill {full.per_token / 1e9:.1f} GFLOP/token (floor {full.floor_s(dev):.2f} s on "
            f"one {dev.name}; bounded replay keep {keep_tokens}: {tail.per_token / 1e9:.1f} GFLOP/token), decode step "
            f"{step.bytes / 1e9:.2f} GB read (weights {step.weight_bytes / 1e9:.2f}, cache {step.kv_bytes / 1e6:.1f} MB,"
            f" Engram rows {step.engram_bytes / 1e3:.1f} KB), {step.flops / 1e9:.1f} GFLOP, floor "
            f"{step.floor_s(dev) * 1e3:.2f} ms at batch 1")
    return lines


class LayoutDoesNotFit(ValueError):
    """A parallel layout whose weights (plus one sequence) exceed one device's memory."""


def check_fits(plan: MemoryPlan, context: int) -> None:
    """Refuse a layout that cannot hold its weights and one sequence of ``context`` tokens."""
    need = plan.weights + plan.workspace + sequence_bytes_for(plan, context)
    if need > plan.budget:
        g = GIB
        hint = []
        if plan.engram_placement == REPLICATED and plan.engram:
            hint.append("features.parallel.engram_placement=sharded (or host)")
        elif plan.engram_placement == SHARDED and plan.engram:
            hint.append("features.parallel.engram_placement=host")
        if plan.routed_experts + plan.draft_experts > plan.budget // 2:
            hint.append(f"a larger features.parallel.ep (now {plan.ep})")
        raise LayoutDoesNotFit(
            f"the parallel layout does not fit one {plan.device_name} ({plan.device_bytes / g:.1f} GiB x "
            f"hardware.memory_utilization {plan.memory_utilization} = {plan.budget / g:.1f} GiB): weights per GPU "
            f"{plan.weights / g:.1f} GiB (routed experts {plan.routed_experts / g:.1f} GiB at ep={plan.ep}, DSpark "
            f"experts {plan.draft_experts / g:.1f} GiB, dense {plan.dense / g:.1f} GiB, Engram tables "
            f"{plan.engram / g:.1f} GiB {plan.engram_placement}) + workspace {plan.workspace / g:.1f} GiB + one "
            f"{context:,}-token sequence {sequence_bytes_for(plan, context) / g:.2f} GiB = {need / g:.1f} GiB"
            + (f"; try {' or '.join(hint)}" if hint else ""))


def sequence_bytes_for(plan: MemoryPlan, context: int) -> int:
    if context in plan.contexts:
        return plan.sequence_bytes[plan.contexts.index(context)]
    # linear in the context past the fixed rings: interpolate from the first planned context
    base = plan.sequence_bytes[0] - int(plan.kv_per_token * plan.contexts[0])
    return base + int(plan.kv_per_token * context)
