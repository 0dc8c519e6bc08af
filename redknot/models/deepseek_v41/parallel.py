"""DeepSeek-V4.1 under expert parallel: routed experts over the EP group, Engram tables sharded.

MoE (§3.7): the engine's :class:`redknot.parallel.ep.ExpertParallel` moves the
(token, choice) pairs by all-to-all as for V4; what differs is the expert math,
which V4.1 owns (:class:`V41Experts.run_slots`): the routing weight is applied
*before* W2 (and, in reference numerics, quantised with the activation), so the
weight travels with its row and the source sums the returned rows as they are.
Rows come back in the accumulation dtype. The router and the shared expert stay
replicated on every rank; the DSpark stages' experts are read whole and run locally.

Engram (§3.2), ``features.parallel.engram_placement``:

* ``sharded``: each rank of the EP group holds rows ``[r*c, (r+1)*c)`` of every
  table (``c = ceil(rows / ep)``, read by the loader). A lookup takes the step's
  unique row ids, sends each to its owner (``owner = id // c``) by an all-to-all
  over the EP group, the owner answers with the stored FP8 bytes and E8M0 scale
  bytes of those rows, and an inverse all-to-all brings them back; the requester
  dequantises. Every rank's rows are then the unsharded table's rows, bit for bit.
* ``replicated``: the full table on every rank (no exchange).
* ``host``: the full table in CPU memory (pinned when CUDA is available); rows are
  gathered on the host and copied to the device.

Every exchange is collective over the EP group, so a rank without tokens in a step
joins each Engram layer's and each MoE layer's exchange, in layer order, with zero
rows (:func:`idle_layers`, the model's ``ep_idle_forward``).
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from redknot.models.deepseek_v41.moe import swiglu_expert
from redknot.models.deepseek_v41.ref_math import Numerics, Weights

log = logging.getLogger(__name__)

SHARDED, REPLICATED, HOST = "sharded", "replicated", "host"


class V41Experts:
    """This rank's routed experts of one layer, by native tensor name (``ExpertParallel``'s view).

    The weights stay in :class:`Weights`; ``w1``.. are None so the V4 tensor moves of load
    balancing find nothing to move (EPLB re-placement is not supported for V4.1)."""

    w1 = w2 = w3 = w1_scale = w2_scale = w3_scale = None
    movable = False   # ExpertParallel refuses features.parallel.eplb.enabled for these

    def __init__(self, w: Weights, prefix: str, num: Numerics, limit: float, logical_ids: Sequence[int]):
        self.w, self.prefix, self.num, self.limit = w, prefix, num, limit
        self.logical_ids: List[int] = list(logical_ids)

    def keep_only(self, mine: Sequence[int]) -> None:
        """Serve only ``mine`` (all loaded here); the other experts' tensors are dropped."""
        missing = [e for e in mine if f"{self.prefix}.experts.{e}.w1.weight" not in self.w]
        if missing:
            raise ValueError(f"{self.prefix}: experts {missing} of this rank were not loaded")
        drop = [e for e in self.logical_ids if e not in mine]
        for e in drop:
            for part in ("w1", "w2", "w3"):
                for name in (f"{self.prefix}.experts.{e}.{part}.weight", f"{self.prefix}.experts.{e}.{part}.scale"):
                    self.w.tensors.pop(name, None)
        self.logical_ids = list(mine)

    def run_slots(self, x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Rows x [N, D] for this rank's slots [N] with routing weights [N] -> W2(SwiGLU(x)·weight)
        [N, D] in the accumulation dtype (the single-process expert math, row by row)."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=self.num.acc, device=x.device)
        for s in torch.unique(slot).tolist():
            rows = (slot == s).nonzero().view(-1)
            e = self.logical_ids[s]
            out[rows] = swiglu_expert(x[rows].to(self.num.dtype), self.w, f"{self.prefix}.experts.{e}", self.num,
                                      self.limit, weight[rows].to(self.num.acc))
        return out


class V41MoELayer:
    """One backbone layer's routed experts as the engine's EP layer sees them."""

    def __init__(self, experts: V41Experts):
        self.experts, self.limit = experts, experts.limit
        self.dispatcher = None


def expert_layers(model) -> List[V41MoELayer]:
    """The routed-expert layer of every backbone layer (made once per model; the MoE forward
    finds each layer's dispatcher through ``Weights.expert_dispatch``)."""
    layers = getattr(model, "_ep_layers", None)
    if layers is None:
        cfg, w = model.cfg, model.w
        held = getattr(model, "expert_ids", None) or {}
        layers = []
        for i in range(cfg.n_layers):
            ids = held.get(i, range(cfg.n_routed_experts))
            layers.append(V41MoELayer(V41Experts(w, f"layers.{i}.ffn", model.num, cfg.swiglu_limit, ids)))
        model._ep_layers = layers
        w.expert_dispatch = _Dispatch(layers)
        model.ep_idle_forward = lambda: idle_layers(model, range(cfg.n_layers))
    return layers


class _Dispatch:
    """prefix -> the layer's dispatcher, once expert parallel installed one (else None)."""

    def __init__(self, layers: Sequence[V41MoELayer]):
        self.layers = {layer.experts.prefix: layer for layer in layers}

    def get(self, prefix: str):
        layer = self.layers.get(prefix)
        if layer is None or layer.dispatcher is None:
            return None
        return layer


# ---------------------------------------------------------------------------- Engram
class EngramLookup:
    """Stored rows (FP8 bytes, E8M0 scale bytes) of the Engram tables for any row ids, whatever the
    placement (see the module docstring). ``tables``: layer prefix -> (table, scale, first row held,
    total rows)."""

    def __init__(self, placement: str, tables: Dict[str, Tuple[torch.Tensor, torch.Tensor, int, int]],
                 group: Optional[dist.ProcessGroup] = None, rank: int = 0, world: int = 1,
                 device=None):
        if placement not in (SHARDED, REPLICATED, HOST):
            raise ValueError(f"features.parallel.engram_placement={placement!r}: allowed values are "
                             f"{[SHARDED, REPLICATED, HOST]}")
        if placement == SHARDED and world > 1 and group is None:
            raise ValueError("engram_placement=sharded over more than one rank needs the EP process group")
        self.placement, self.tables, self.group = placement, tables, group
        self.rank, self.world = rank, world
        self.device = device
        self.num_lookups = 0
        self.rows_received = 0   # rows this rank got from other ranks (sharded)

    def chunk(self, prefix: str) -> int:
        return -(-self.tables[prefix][3] // self.world)

    def __call__(self, prefix: str, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Row ids [N] (absolute in the layer's table) -> (FP8 bytes [N, hd], scale bytes [N, hd/32])."""
        self.num_lookups += 1
        table, scale, first, total = self.tables[prefix]
        device = ids.device
        if self.placement != SHARDED or self.world == 1:
            at = ids.to(table.device)
            q, s = table.view(torch.uint8)[at], scale.view(torch.uint8)[at]
            return q.to(device, non_blocking=True), s.to(device, non_blocking=True)
        return self._sharded(prefix, ids.long())

    def _sharded(self, prefix: str, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        table, scale, first, total = self.tables[prefix]
        tb, sb = table.view(torch.uint8), scale.view(torch.uint8)
        uniq, inverse = torch.unique(ids, return_inverse=True)                 # sorted, so grouped by owner
        owner = uniq // self.chunk(prefix)
        send = torch.bincount(owner, minlength=self.world)
        recv = exchange_counts(send, self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        asked = all_to_all_rows(uniq, send_l, recv_l, self.group)             # ids others want from us
        local = (asked - first).to(tb.device)
        if asked.numel() and (int(local.min()) < 0 or int(local.max()) >= tb.shape[0]):
            raise RuntimeError(f"{prefix}: a rank asked for rows outside this rank's slice")
        q = all_to_all_rows(tb[local].to(ids.device), recv_l, send_l, self.group)   # [U, hd] in uniq order
        s = all_to_all_rows(sb[local].to(ids.device), recv_l, send_l, self.group)
        self.rows_received += int(sum(n for r, n in enumerate(send_l) if r != self.rank))
        return q[inverse], s[inverse]


def engram_lookup(weights, cfg, placement: str, group=None, rank: int = 0, world: int = 1) -> EngramLookup:
    """The lookup over a loaded model's tables (``weights.engram_rows``: the slices held when sharded)."""
    held = getattr(weights, "engram_rows", None) or {}
    tables = {}
    for layer, total in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        prefix = f"layers.{layer}.engram"
        table, scale = weights.tensors[f"{prefix}.embed.weight"], weights.tensors[f"{prefix}.embed.scale"]
        first = held.get(layer, (0, total))[0] if placement == SHARDED else 0
        tables[prefix] = (table, scale, first, total)
    return EngramLookup(placement, tables, group, rank, world)


def host_tables(tensors: Dict[str, torch.Tensor]) -> None:
    """Move the Engram tables in ``tensors`` to CPU memory (pinned when CUDA is available)."""
    pin = torch.cuda.is_available()
    for name in [n for n in tensors if ".engram.embed." in n]:
        t = tensors[name].cpu()
        tensors[name] = t.pin_memory() if pin else t


# ---------------------------------------------------------------------------- idle rank
@torch.no_grad()
def idle_layers(model, layers) -> None:
    """Join the collectives of ``layers`` with zero rows, in the order a forward runs them
    (Engram lookup, then the MoE all-to-alls of each layer)."""
    cfg, w = model.cfg, model.w
    lookup = getattr(w, "engram_lookup", None)
    dispatch = getattr(w, "expert_dispatch", None)
    k = cfg.n_activated_experts
    x = torch.zeros(0, cfg.dim, dtype=model.dtype, device=model.device)
    for i in layers:
        if cfg.is_engram(i) and lookup is not None and lookup.placement == SHARDED and lookup.world > 1:
            lookup(f"layers.{i}.engram", torch.zeros(0, dtype=torch.long, device=model.device))
        layer = None if dispatch is None else dispatch.get(f"layers.{i}.ffn")
        if layer is not None:
            layer.dispatcher(None, x, torch.zeros(0, k, dtype=torch.long, device=model.device),
                             torch.zeros(0, k, dtype=model.num.acc, device=model.device), layer.experts, layer.limit)


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """Rows for each peer [n] -> rows from each peer [n] (models stay off the engine's modules, so
    the two row collectives of the table exchange are spelt out here)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def all_to_all_rows(rows: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    """Rows grouped by destination -> rows received, grouped by source."""
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), list(recv), list(send), group=group)
    return out


# ---------------------------------------------------------------------------- engine build
def engram_placement_of(expert_rows) -> Tuple[str, Optional[dist.ProcessGroup], int, int]:
    """(placement, EP group, EP rank, EP size) of the engine's parallel runtime behind
    ``expert_rows`` (its bound ``expert_rows`` method); one process: the full table (replicated)."""
    runtime = getattr(expert_rows, "__self__", None)
    if runtime is None or not hasattr(runtime, "layout"):
        return REPLICATED, None, 0, 1
    value = runtime.features.parallel.engram_placement
    placement = str(getattr(value, "value", value))
    layout = runtime.layout
    return placement, runtime.groups.ep, int(layout.ep_rank), int(layout.ep)


def install_engram(model, loaded, placement: str, group, rank: int, world: int) -> None:
    """Route the model's Engram row reads through :class:`EngramLookup` for ``placement``."""
    if not model.cfg.engram_layer_ids:
        return
    held = {layer: rows for layer, rows in (getattr(loaded, "engram_rows", None) or {}).items()}
    log.info("deepseek_v41: EP rank %d of %d, routed experts %s of layer 0, Engram tables %s%s", rank, world,
             list(getattr(loaded, "experts", {}).get(0, ())), placement,
             f" (rows held per layer {held})" if held else "")
    if placement == HOST:
        host_tables(model.w.tensors)
    model.w.engram_lookup = engram_lookup(loaded, model.cfg, placement, group, rank, world) \
        if placement != REPLICATED else None
    if model.w.engram_lookup is not None:
        model.w.engram_lookup.tables = {p: (model.w.tensors[f"{p}.embed.weight"], model.w.tensors[f"{p}.embed.scale"],
                                            first, total)
                                        for p, (_, _, first, total) in model.w.engram_lookup.tables.items()}
