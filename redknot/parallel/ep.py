"""MoE expert parallel: routed experts sharded over an EP group, tokens moved by all-to-all.

Each main-layer ``MoE`` gets a :class:`ExpertDispatcher` (``moe.dispatcher``);
its ``Experts`` hold only this rank's slots of the layer's :class:`ExpertPlacement`
(``[S, I, D]`` instead of ``[E, I, D]``; the engine passes the family's
``build_model`` the rows to keep, so only those are allocated and read from the
checkpoint). The MoE modules come from the model family
(:meth:`~redknot.models.family.ModelFamily.expert_layers`). A step:

1. every (token t, choice j) pair picks one replica of its expert (spread by
   pair index) and so a destination rank; pairs are sent grouped by rank, in
   (t, j) order within a rank (stable sort);
2. each rank runs its slots through the registered ``moe`` op as a one-choice
   MoE with weight 1 — row by row the same expert GEMMs as one process;
3. results go back by the inverse all-to-all; the source multiplies by the
   routing weights in fp32 and adds the k choices in slot order j = 0..k-1,
   exactly like the single-process ``moe`` op, so batch-invariant mode stays
   bitwise equal to one process.

The router, the shared expert and the MTP layer stay replicated on every rank
(the MTP layer then needs no collectives, so drafting may run any number of
MTP steps per rank). A rank without work still calls every layer's dispatcher
with zero rows (:meth:`ExpertParallel.idle_forward`): it hosts experts other
ranks send tokens to.

Per-expert load is counted as tokens are routed; :meth:`ExpertParallel.rebalance`
all-reduces it, plans a new placement per layer (:mod:`redknot.parallel.eplb`)
and moves expert weights between ranks by point-to-point copies. Replicas are
exact copies, so a re-placement between steps does not change any result.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from redknot.parallel.eplb import ExpertPlacement, imbalance, plan_placement, uniform_placement
from redknot.parallel.groups import all_to_all_rows, exchange_counts

log = logging.getLogger(__name__)

EXPERT_TENSORS = ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale")


def set_expert_tensors(experts: nn.Module, tensors: Dict[str, Optional[torch.Tensor]]) -> None:
    for name, value in tensors.items():
        if value is None:
            setattr(experts, name, None)
        else:
            setattr(experts, name, nn.Parameter(value, requires_grad=False))


class ExpertDispatcher:
    """Routed experts of one MoE layer over the EP group (see the module docstring)."""

    def __init__(self, owner: "ExpertParallel", layer: int, experts: nn.Module, placement: ExpertPlacement):
        self.owner, self.layer, self.experts = owner, layer, experts
        self.placement = placement
        self._tables(placement)

    def _tables(self, placement: ExpertPlacement) -> None:
        reps = placement.replicas()
        width = max(len(r) for r in reps)
        device = self.owner.device
        self.rep_count = torch.tensor([len(r) for r in reps], dtype=torch.long, device=device)  # [E]
        self.rep_table = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.long,
                                      device=device)  # [E, max replicas]

    def set_placement(self, placement: ExpertPlacement) -> None:
        self.placement = placement
        self._tables(placement)

    def __call__(self, ks, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor,
                 experts: nn.Module, swiglu_limit: float) -> torch.Tensor:
        """x [T, D], topk_idx [T, k], topk_weight [T, k] fp32 -> routed output [T, D] (x.dtype)."""
        owner = self.owner
        t, k = topk_idx.shape
        owner.count(self.layer, topk_idx)
        flat = topk_idx.reshape(-1).long()
        pair = torch.arange(flat.shape[0], device=x.device)
        choice = (pair + owner.ep_rank) % self.rep_count[flat]
        phys = self.rep_table[flat, choice]  # [T*k] physical slot of each pair
        slots = self.placement.slots_per_rank
        dest = phys // slots
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination, (t, j) order inside
        send = torch.bincount(dest, minlength=owner.ep_size)
        recv = exchange_counts(send, owner.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        recv_x = all_to_all_rows(x[order // k], send_l, recv_l, owner.group)  # [R, D]
        recv_slot = all_to_all_rows((phys % slots)[order], send_l, recv_l, owner.group)  # [R]
        run_slots = getattr(experts, "run_slots", None)
        if run_slots is not None:  # the family's expert math takes the routing weight (applied before W2)
            acc = torch.promote_types(x.dtype, torch.float32)
            recv_w = all_to_all_rows(topk_weight.reshape(-1).to(acc)[order], send_l, recv_l, owner.group)
            y = run_slots(recv_x, recv_slot, recv_w).to(acc)
            back = all_to_all_rows(y, recv_l, send_l, owner.group)
            per_pair = torch.empty_like(back)
            per_pair[order] = back
            pairs = per_pair.view(t, k, x.shape[1])
            out = pairs[:, 0] if k else x.new_zeros(x.shape, dtype=acc)
            for j in range(1, k):
                out = out + pairs[:, j]
            return out  # accumulation dtype: the family adds its shared expert before rounding
        y = self._compute(ks, recv_x, recv_slot, swiglu_limit)
        back = all_to_all_rows(y, recv_l, send_l, owner.group)  # [T*k, D] in `order`
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        pairs = per_pair.view(t, k, x.shape[1]).float() * topk_weight.float().unsqueeze(-1)  # [T, k, D]
        out = pairs[:, 0] if k else x.new_zeros(x.shape, dtype=torch.float32)
        for j in range(1, k):  # slot order, as the single-process op
            out = out + pairs[:, j]
        return out.to(x.dtype)

    def _compute(self, ks, x: torch.Tensor, slot: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
        """This rank's slots on the received rows: a one-choice MoE with weight 1 (exact)."""
        if x.shape[0] == 0:
            return x.new_zeros(x.shape)
        ex = self.experts
        ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
        return ks.moe(x, slot.view(-1, 1), ones, ex.w1, ex.w2, ex.w3, swiglu_limit, ex.w1_scale, ex.w2_scale,
                      ex.w3_scale)


@dataclass
class EplbSettings:
    enabled: bool = False
    num_redundant: int = 0
    interval: int = 1000


class ExpertParallel:
    """All MoE layers of one model sharded over this rank's EP group, plus load balancing.

    ``moe_layers``: the routed-expert module of every main layer (the family's ``expert_layers``)."""

    def __init__(self, model, moe_layers: Sequence[nn.Module], group: dist.ProcessGroup, ep_rank: int, ep_size: int,
                 eplb: EplbSettings, device: torch.device):
        self.model, self.moe_layers, self.group = model, list(moe_layers), group
        self.ep_rank, self.ep_size, self.eplb, self.device = ep_rank, ep_size, eplb, device
        cfg = model.cfg
        self.num_experts = cfg.n_routed_experts
        self.top_k = getattr(cfg, "num_experts_per_tok", None) or cfg.n_activated_experts
        num_layers = len(self.moe_layers)
        self.load = torch.zeros(num_layers, self.num_experts, dtype=torch.long, device=device)  # window
        self.total_load = torch.zeros_like(self.load)  # since start
        self.num_forwards = 0
        self.num_rebalances = 0
        self.last_imbalance: Optional[Tuple[float, float]] = None  # (before, after) of the last rebalance
        self.dispatchers: List[ExpertDispatcher] = []
        redundant = eplb.num_redundant if eplb.enabled else 0
        for i, moe in enumerate(self.moe_layers):
            placement = uniform_placement(self.num_experts, ep_size, redundant)
            experts = moe.experts
            if eplb.enabled and not getattr(experts, "movable", True):
                raise ValueError(f"features.parallel.eplb.enabled=true: model family {type(model).__name__} does "
                                 f"not support moving experts between ranks; set features.parallel.eplb.enabled=false")
            mine = placement.rank_experts(ep_rank)
            if experts.logical_ids != mine:  # loaded whole (not through the sharded loader): keep ours
                experts.keep_only(mine)
            disp = ExpertDispatcher(self, i, experts, placement)
            moe.dispatcher = disp
            self.dispatchers.append(disp)

    # ------------------------------------------------------------------ serving
    def count(self, layer: int, topk_idx: torch.Tensor) -> None:
        if layer == 0:
            self.num_forwards += 1
        self.load[layer] += torch.bincount(topk_idx.reshape(-1).long(), minlength=self.num_experts)

    @torch.no_grad()
    def idle_forward(self) -> None:
        """Join every layer's all-to-alls with zero rows (this rank has no tokens this step).
        A model with other collectives in its forward joins them all itself (``ep_idle_forward``)."""
        model = self.model
        own = getattr(model, "ep_idle_forward", None)
        if own is not None:
            own()
            return
        d = model.cfg.hidden_size
        x = torch.zeros(0, d, dtype=model.dtype, device=self.device)  # [0, D]
        idx = torch.zeros(0, self.top_k, dtype=torch.long, device=self.device)
        w = torch.zeros(0, self.top_k, dtype=torch.float32, device=self.device)
        for moe, disp in zip(self.moe_layers, self.dispatchers):
            disp(model.ks, x, idx, w, moe.experts, moe.limit)

    def placements(self) -> List[ExpertPlacement]:
        return [d.placement for d in self.dispatchers]

    # ------------------------------------------------------------------ load balancing
    @torch.no_grad()
    def rebalance(self) -> bool:
        """Collective over the world: plan from the all-reduced window load and move weights.
        Returns whether any layer's placement changed."""
        load = self.load.clone()
        dist.all_reduce(load)
        self.total_load += self.load
        self.load.zero_()
        per_layer = load.cpu().tolist()
        changed, before, after = False, [], []
        for disp, layer_load in zip(self.dispatchers, per_layer):
            new = plan_placement(layer_load, self.ep_size, self.eplb.num_redundant)
            before.append(imbalance(disp.placement, layer_load))
            after.append(imbalance(new, layer_load))
            if new.phys_to_logical != disp.placement.phys_to_logical:
                self._move(disp, new)
                changed = True
        self.num_rebalances += 1
        self.last_imbalance = (sum(before) / len(before), sum(after) / len(after))
        log.info("EPLB re-placement %d: mean imbalance %.3f -> %.3f", self.num_rebalances, *self.last_imbalance)
        return changed

    def _move(self, disp: ExpertDispatcher, new: ExpertPlacement) -> None:
        """Give every rank the weights of its new slots: local copies where it already holds the
        expert, else a point-to-point receive from a rank that does (same plan on every rank)."""
        old = disp.placement
        ranks = dist.get_process_group_ranks(self.group)
        me, s = self.ep_rank, new.slots_per_rank
        held = [old.rank_experts(q) for q in range(self.ep_size)]
        holders = [sorted({p // s for p in reps}) for reps in old.replicas()]
        ex = disp.experts
        names = [n for n in EXPERT_TENSORS if getattr(ex, n) is not None]
        fresh = {n: torch.empty_like(getattr(ex, n)) for n in names}
        ops = []
        for q in range(self.ep_size):
            for slot, e in enumerate(new.rank_experts(q)):
                if e in held[q]:
                    if q == me:
                        for n in names:
                            fresh[n][slot].copy_(getattr(ex, n)[held[q].index(e)])
                    continue
                src = holders[e][(q + slot) % len(holders[e])]
                for n in names:
                    if me == src:
                        ops.append(dist.P2POp(dist.isend, getattr(ex, n)[held[me].index(e)].contiguous(), ranks[q],
                                              self.group))
                    elif me == q:
                        ops.append(dist.P2POp(dist.irecv, fresh[n][slot], ranks[src], self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        set_expert_tensors(ex, {n: fresh.get(n) for n in EXPERT_TENSORS})
        ex.logical_ids = new.rank_experts(me)
        disp.set_placement(new)

    def metrics(self) -> Dict[str, float]:
        """This rank's EP counters (the front logs them with a rank tag)."""
        total = (self.total_load + self.load).sum().item()
        out = {"ep.forwards": float(self.num_forwards), "ep.routed_pairs": float(total),
               "eplb.rebalances": float(self.num_rebalances)}
        if self.last_imbalance is not None:
            out["eplb.imbalance_before"], out["eplb.imbalance_after"] = self.last_imbalance
        return out
