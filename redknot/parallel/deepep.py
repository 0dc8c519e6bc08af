"""DeepEP for the MoE all-to-all on Blackwell (sm100), when the ``deep_ep`` package is installed.

A thin swap of :class:`~redknot.parallel.ep.ExpertDispatcher`'s transport:
DeepEP's ``ElasticBuffer.dispatch`` sends each token once per destination rank
with its routing (physical slot ids, so EPLB replicas work unchanged: rank r
owns slots ``[r*S, (r+1)*S)``, DeepEP's even split), the local slots run through
the registered ``moe`` op with the received weights, and ``combine`` sums the
ranks' partial outputs. DeepEP's combine adds in its own order, so
batch-invariant mode keeps the torch.distributed all-to-all, whose combine
order is fixed. The package and the pip extra come from the kernel registry's
``deep_ep`` backend entry. Needs an sm100 machine: not exercised by the CPU tests.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from redknot.config.schema import Accelerator, FeaturesConfig, HardwareConfig
from redknot.kernels.registry import BACKENDS
from redknot.parallel.ep import ExpertDispatcher, ExpertParallel

log = logging.getLogger(__name__)


def use_deep_ep(hardware: HardwareConfig, features: FeaturesConfig) -> bool:
    """sm100 hardware, DeepEP installed, not batch-invariant (logged when it is not taken)."""
    if hardware.accelerator != Accelerator.cuda or not any(cc.startswith("10") for cc in hardware.compute_capability):
        return False
    if features.batch_invariant.enabled or features.deterministic:
        log.info("MoE all-to-all through torch.distributed: batch-invariant mode needs its fixed combine order")
        return False
    info = BACKENDS["deep_ep"]
    missing = [p for p in info.packages if importlib.util.find_spec(p) is None]
    if missing:
        log.warning("MoE all-to-all through torch.distributed (NCCL): %s is not installed "
                    "(pip install -e '.[%s]')", ", ".join(missing), info.extra)
        return False
    return True


class DeepEPDispatcher(ExpertDispatcher):
    """One MoE layer's routed experts over DeepEP's dispatch/combine."""

    buffer = None  # one ElasticBuffer per process, shared by the layers

    def __init__(self, base: ExpertDispatcher, max_tokens: int):
        super().__init__(base.owner, base.layer, base.experts, base.placement)
        self.max_tokens = max_tokens

    def _buffer(self, hidden: int, top_k: int):
        from deep_ep import ElasticBuffer

        if DeepEPDispatcher.buffer is None:
            DeepEPDispatcher.buffer = ElasticBuffer(self.owner.group, num_max_tokens_per_rank=self.max_tokens,
                                                    hidden=hidden, num_topk=top_k)
        return DeepEPDispatcher.buffer

    def __call__(self, ks, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts,
                 swiglu_limit: float) -> torch.Tensor:
        owner = self.owner
        t, k = topk_idx.shape
        owner.count(self.layer, topk_idx)
        flat = topk_idx.reshape(-1).long()
        pair = torch.arange(flat.shape[0], device=x.device)
        phys = self.rep_table[flat, (pair + owner.ep_rank) % self.rep_count[flat]].view(t, k)  # [T, k]
        buf = self._buffer(x.shape[1], k)
        recv_x, recv_idx, recv_w, handle, event = buf.dispatch(
            x, topk_idx=phys, topk_weights=topk_weight.float(), num_experts=self.placement.num_physical,
            num_max_tokens_per_rank=self.max_tokens)
        event.current_stream_wait()
        valid = recv_idx >= 0  # [R, k]; -1 = a choice served by another rank
        ex = self.experts
        y = ks.moe(recv_x, recv_idx.clamp(min=0), recv_w.float() * valid, ex.w1, ex.w2, ex.w3, swiglu_limit,
                   ex.w1_scale, ex.w2_scale, ex.w3_scale)
        combined, _, event = buf.combine(y, handle=handle)
        event.current_stream_wait()
        return combined.to(x.dtype)


def install_deep_ep(ep: ExpertParallel, max_tokens: int) -> None:
    """Swap every layer's dispatcher for the DeepEP one (same placement, same load counting)."""
    for i, moe in enumerate(ep.moe_layers):
        disp = DeepEPDispatcher(ep.dispatchers[i], max_tokens)
        ep.dispatchers[i] = disp
        moe.dispatcher = disp
