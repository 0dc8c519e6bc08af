"""V4 mixture of experts (reference §5): hash routing (tid2eid) or sqrt-softplus top-k with a
selection-only bias, renormalised weights × routed scale, clamped SwiGLU experts + a shared expert."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from redknot.kernels.ref_moe import gate_up_stack
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.layers import Linear
from redknot.models.deepseek_v4.params import ParamFactory
from redknot.step.overlap import beside, concurrent


def kernel_backend(ks, op: str) -> Optional[str]:
    """The backend a kernel set resolved ``op`` to, or None for a stand-in without a ``choice`` table (a profiler's
    wrapper)."""
    choice = getattr(ks, "choice", None)
    return choice.get(op, "reference") if isinstance(choice, dict) else None


def _one_backend(ks, *ops: str) -> bool:
    """Whether the kernel set resolves ``ops`` to one backend (a composed op then runs the backend's own parts)."""
    backends = {kernel_backend(ks, op) for op in ops}
    return None not in backends and len(backends) == 1


class Router(nn.Module):
    """Expert choice: fixed ``tid2eid[token]`` (hash layers) or top-k of sqrt-softplus scores + bias."""

    def __init__(self, f: ParamFactory, cfg: V4Config, hash_layer: bool):
        super().__init__()
        self.hash_layer, self.top_k = hash_layer, cfg.num_experts_per_tok
        self.scaling = cfg.routed_scaling_factor
        self.weight = f.plain(cfg.n_routed_experts, cfg.hidden_size)
        if hash_layer:
            self.register_buffer("tid2eid", torch.empty(cfg.vocab_size, self.top_k, dtype=torch.int32,
                                                        device=f.device))
        else:
            self.register_buffer("bias", torch.empty(cfg.n_routed_experts, dtype=torch.float32, device=f.device))

    def forward(self, ks, x: torch.Tensor, input_ids: torch.Tensor):
        """-> (expert ids [T, k], weights [T, k] fp32)."""
        scores = ks.router_scores(x, self.weight)  # [T, E] fp32 (the op computes in fp32 from x's values)
        if self.hash_layer:
            return ks.route(scores, None, self.tid2eid, input_ids, self.top_k, self.scaling)
        return ks.route(scores, self.bias, None, input_ids, self.top_k, self.scaling)


class Experts(nn.Module):
    """Routed experts stacked per projection: w1/w3 [E, I, D], w2 [E, D, I] (+ scales if quantised)."""

    def __init__(self, f: ParamFactory, cfg: V4Config):
        super().__init__()
        e, d, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        for name, shape in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            w, s = f.weight(shape, f.expert_fmt, lead=(e,))
            setattr(self, name, w)
            if s is not None:
                setattr(self, f"{name}_scale", s)
            else:
                self.register_parameter(f"{name}_scale", None)
        # Expert parallel keeps some experts per rank (redknot.parallel): the logical expert of each
        # row of the stacks. None: row e is expert e (all of them).
        self.logical_ids: Optional[Tuple[int, ...]] = None

    def fuse_gate_up(self) -> int:
        """Float experts: w1 and w3 keep their Parameters but view one ``[E, 2I, D]`` stack (each expert's w3 rows
        after its w1 rows), so the routed experts' gate and up projections of a prefill run as one grouped GEMM
        (``ref_moe.gate_up_stack``). Checkpoint names and in-place loads are unchanged; restacking (``keep_only``)
        makes them separate again. Returns the launches a layer saves (0: quantised, meta, or already fused)."""
        if self.w1_scale is not None:
            return 0
        return _stack_gate_up(self.w1, self.w3)

    def keep_only(self, logical_ids: Sequence[int]) -> None:
        """Restack to these experts, in this order (an id may repeat: a replica). Works before loading
        (meta tensors: only the shapes change, and the loader then fills just these rows) and after."""
        current = list(self.logical_ids) if self.logical_ids is not None else list(range(self.w1.shape[0]))
        rows = torch.tensor([current.index(e) for e in logical_ids], dtype=torch.long, device=self.w1.device)
        for name in ("w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, nn.Parameter(t.index_select(0, rows), requires_grad=False))
        self.logical_ids = tuple(int(e) for e in logical_ids)


class SharedExpert(nn.Module):
    """The always-on expert (clamped SwiGLU of width moe_intermediate_size)."""

    def __init__(self, f: ParamFactory, cfg: V4Config):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = Linear(f, inter, d, f.linear_fmt)
        self.w2 = Linear(f, d, inter, f.linear_fmt)
        self.w3 = Linear(f, inter, d, f.linear_fmt)

    def fuse_gate_up(self) -> int:
        """As ``Experts.fuse_gate_up`` for the one expert: w1 and w3 view one ``[2I, D]`` stack (float weights)."""
        if self.w1.scale is not None:
            return 0
        return _stack_gate_up(self.w1.weight, self.w3.weight)


def _stack_gate_up(w1: nn.Parameter, w3: nn.Parameter) -> int:
    """w1 and w3 (``[..., I, D]``) keep their Parameters but view one stack, each expert's w3 rows after its w1
    rows; 1 if they were stacked now, 0 on the meta device or where they already are."""
    if w1.device.type == "meta" or w1.shape != w3.shape or w1.dim() not in (2, 3) or gate_up_stack(w1, w3) is not None:
        return 0
    inter = w1.shape[-2]
    stack = torch.cat([w1.detach(), w3.detach()], dim=-2)   # [..., 2I, D]
    w1.data, w3.data = stack[..., :inter, :], stack[..., inter:, :]
    return 1


class MoE(nn.Module):
    """Routed experts weighted by the router, plus the shared expert."""

    def __init__(self, f: ParamFactory, cfg: V4Config, hash_layer: bool):
        super().__init__()
        self.limit = cfg.swiglu_limit
        self.gate = Router(f, cfg, hash_layer)
        self.experts = Experts(f, cfg)
        self.shared_experts = SharedExpert(f, cfg)
        # Expert parallel (redknot.parallel.ep) installs its dispatcher here; None = every expert local.
        self.dispatcher = None

    def forward(self, ks, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # the shared expert reads only x: on the side stream next to the router and the routed experts for
        # steps within hardware.side_stream_max_tokens (redknot.step.overlap; same kernels, same bits)
        if self.dispatcher is None and not concurrent(x) and _one_backend(ks, "moe", "moe_shared"):
            # else one op: the Triton backend runs the shared expert in the routed experts' launches at 1-4 rows
            idx, weights = self.gate(ks, x, input_ids)
            ex, sh = self.experts, self.shared_experts
            return ks.moe_shared(x, idx, weights, ex.w1, ex.w2, ex.w3, self.limit, ex.w1_scale, ex.w2_scale,
                                 ex.w3_scale, sh.w1.weight, sh.w2.weight, sh.w3.weight, sh.w1.scale, sh.w2.scale,
                                 sh.w3.scale, *self._every_row_selects(x.shape[0], x.device))
        routed, shared = beside(x, lambda: self._routed(ks, x, input_ids), lambda: self._shared(ks, x))
        return routed + shared

    def _routed(self, ks, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        idx, weights = self.gate(ks, x, input_ids)
        ex = self.experts
        if self.dispatcher is not None:
            return self.dispatcher(ks, x, idx, weights, ex, self.limit)
        return ks.moe(x, idx, weights, ex.w1, ex.w2, ex.w3, self.limit, ex.w1_scale, ex.w2_scale, ex.w3_scale)

    def _every_row_selects(self, rows: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [rows, 1] all 0, weights [rows, 1] all 1): constants the step only reads, kept per row
        count and device so that a step does not fill them again in every layer. A pair first made inside a CUDA
        graph capture is not kept (its fills run only at the replays)."""
        kept = self.__dict__.setdefault("_one_expert_rows", {})
        got = kept.get((rows, device))
        if got is None:
            got = (torch.zeros(rows, 1, dtype=torch.long, device=device),
                   torch.ones(rows, 1, dtype=torch.float32, device=device))
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                kept[(rows, device)] = got
        return got

    def _shared(self, ks, x: torch.Tensor) -> torch.Tensor:
        """The shared expert, run as a one-expert MoE that every token selects with weight 1 (exact),
        so that its GEMMs and clamped SwiGLU go through the same registered op as the routed ones."""
        sh = self.shared_experts
        one = lambda t: None if t is None else t.unsqueeze(0)  # noqa: E731  [1, ...] expert stack
        idx, w = self._every_row_selects(x.shape[0], x.device)
        return ks.moe(x, idx, w, one(sh.w1.weight), one(sh.w2.weight), one(sh.w3.weight), self.limit,
                      one(sh.w1.scale), one(sh.w2.scale), one(sh.w3.scale))
