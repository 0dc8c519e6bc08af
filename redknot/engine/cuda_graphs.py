"""CUDA graphs for decode steps: one captured forward + logits per padded batch size.

A graph replays the kernels it recorded with whatever the static input
buffers hold, so the model's decode forward must take every per-step value
from the ``StepMetadata`` tensors, never from its Python-side lists or from
host-side control flow: the captured metadata is marked ``tensor_only`` and
the model and its ops then read positions, slots and block tables from the
tensors, with shapes fixed by the graph's block-table width
(``hardware.cuda_graph_max_len``). A model states that it can with
``supports_cuda_graphs = True``. A capture that fails (an op that syncs with
the host) leaves decode eager with the reason reported; the first replay of
every batch size is checked against an eager run, so a wrong replay is never
served.

Recording sits behind a small interface (``capture(fn, pool) -> CapturedStep``):
:class:`CudaGraphCapture` records a CUDA graph; :class:`HostGraphCapture` is its
stand-in on a device without graphs (tests), which replays the recorded ATen ops
rather than the callable's Python, so a step that reads anything but its static
buffers fails there as it would on a GPU. DSpark's variable-length verify steps use
it through :class:`redknot.speculative.varlen.VerifyGraphs`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from redknot.engine.inputs import StepInputs
from redknot.kernels.capture import cuda_graph
from redknot.step.metadata import StepMetadata

log = logging.getLogger(__name__)


@dataclass
class CapturedStep:
    """A recorded step: ``replay()`` reruns it on whatever its static inputs hold and refills
    ``outputs`` (the tensors the recorded callable returned) in place."""
    replay: Callable[[], None]
    outputs: Tuple[torch.Tensor, ...]
    pool: Any = None      # the memory pool a later capture may share (CUDA)


class CudaGraphCapture:
    """Capture with ``torch.cuda.CUDAGraph``: one eager warm-up call (weight caches, kernel tuning),
    then the recorded one; graphs captured with the same ``pool`` share their memory."""

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]], pool: Any = None) -> CapturedStep:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cuda_graph(graph, pool=pool):
            outputs = tuple(fn())
        return CapturedStep(graph.replay, outputs, graph.pool())


# Ops that read device values on the host (a CUDA capture refuses them; the host stand-in too).
_HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique",
                  "_unique", "_unique2", "unique_consecutive", "unique_dim", "nonzero_static")


class HostGraphCapture:
    """What a CUDA graph does, on any device, for tests without CUDA: the capture call runs once while
    every ATen op it dispatches is recorded with its tensor arguments; ``replay`` re-executes the
    recorded ops on those same tensors (no Python of the captured callable runs again), writing each
    op's result into the tensor it produced at capture. So, as with a real graph, a replay sees only
    what the static input buffers hold now: a value the callable took from a per-step Python object,
    a list or a freshly made tensor is replayed as it was at capture. An op that reads a device value
    on the host raises RuntimeError, as the CUDA capture would."""

    def capture(self, fn: Callable[[], Sequence[torch.Tensor]], pool: Any = None) -> CapturedStep:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops: List[tuple] = []

        class _Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if _reads_on_host(func, args, kwargs):
                    raise RuntimeError(f"{func} reads a device value on the host inside a captured step")
                out = func(*args, **kwargs)
                if not func.is_view:  # a view aliases a recorded tensor: it follows it on replay
                    ops.append((func, args, kwargs, out))
                return out

        with _Record():
            outputs = tuple(fn())

        def replay() -> None:
            for func, args, kwargs, out in ops:
                _refill(out, func(*args, **kwargs))
        return CapturedStep(replay, outputs, pool)


def _reads_on_host(func, args, kwargs) -> bool:
    """Whether ``func`` needs a device value on the host (its output size or a Python scalar)."""
    name = func._schema.name.split("::")[-1]
    if name in _HOST_SYNC_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # boolean masks: a nonzero inside
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    if name == "repeat_interleave":  # tensor repeats without output_size: the total is read back
        return isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool and len(args) >= 1 \
            and func._overloadname == "Tensor" and kwargs.get("output_size") is None
    return False


def _refill(recorded, fresh) -> None:
    """Write ``fresh`` (a replayed op's result) into ``recorded`` (its result at capture)."""
    if isinstance(recorded, torch.Tensor):
        if (isinstance(fresh, torch.Tensor) and recorded.numel()
                and fresh.untyped_storage().data_ptr() != recorded.untyped_storage().data_ptr()):
            recorded.copy_(fresh)
    elif isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _refill(r, f)


def graph_batch_sizes(max_batch: int) -> List[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captures and replays decode-only steps of ``runner.model`` (see the module docstring)."""

    def __init__(self, runner, max_batch: int, max_len: int) -> None:
        self.runner = runner
        self.max_len = max_len
        self.sizes = graph_batch_sizes(max_batch)
        self.graphs: Dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.checked: set = set()
        self.num_replays = 0
        self.disabled_reason: Optional[str] = None
        host_ops = sorted(op for op, b in runner.kernels.choice.items() if b == "batch_invariant")
        if not getattr(runner.model, "supports_cuda_graphs", False):
            self.disabled_reason = "the model's decode forward reads per-step Python metadata; decode runs eagerly"
        elif host_ops:
            self.disabled_reason = (f"the batch-invariant ops {host_ops} loop over sequences on the host; "
                                    "decode runs eagerly")
        device = runner.device
        max_blocks = runner.cache_spec.blocks_for(max_len)
        b = max_batch
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)           # [B]
        self.positions = torch.zeros(b, dtype=torch.long, device=device)           # [B]
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=device)   # [B+1]
        self.seq_slots = torch.full((b,), runner.padding_slot, dtype=torch.int32, device=device)  # [B]
        self.block_tables = torch.full((b, max_blocks), runner.padding_block, dtype=torch.int32,
                                       device=device)                             # [B, max_blocks]
        self.logits_indices = torch.arange(b, dtype=torch.long, device=device)     # [B]

    @property
    def status(self) -> str:
        return f"off: {self.disabled_reason}" if self.disabled_reason else f"on: batch sizes {self.sizes}"

    def can_run(self, inputs: StepInputs) -> bool:
        meta = inputs.meta
        return (self.disabled_reason is None and inputs.sched.is_decode_only
                and len(inputs.sched.requests) <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.block_tables.shape[1]
                and max(meta.context_lens) < self.max_len)

    def _meta(self, bs: int, context_lens: List[int]) -> StepMetadata:
        return StepMetadata(input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                            query_start_loc=self.query_start[:bs + 1], seq_slots=self.seq_slots[:bs],
                            block_tables=self.block_tables[:bs], logits_indices=self.logits_indices[:bs],
                            num_tokens_per_seq=[1] * bs, context_lens=context_lens, tensor_only=True)

    def capture(self) -> None:
        if self.disabled_reason is not None:
            log.warning("hardware.cuda_graphs=true but %s", self.disabled_reason)
            return
        model, state = self.runner.model, self.runner.state
        pool = getattr(self.runner, "graph_pool", None)  # shared with the runner's other graphs
        try:
            for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
                meta = self._meta(bs, [0] * bs)
                model.compute_logits(model.forward(meta, state)[meta.logits_indices])  # warm-up, eager
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with cuda_graph(graph, pool=pool):
                    out = model.compute_logits(model.forward(meta, state)[meta.logits_indices])
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, out
            self.runner.graph_pool = pool
        except RuntimeError as exc:
            self.graphs.clear()
            self.disabled_reason = f"capture failed ({str(exc).splitlines()[0]}); decode runs eagerly"
            log.warning("hardware.cuda_graphs=true but %s", self.disabled_reason)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Logits [B, V] of a decode-only step by graph replay (padding rows go to the spare slot)."""
        meta = inputs.meta
        n = meta.num_seqs
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(meta.input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.seq_slots[:n].copy_(meta.seq_slots, non_blocking=True)
        self.seq_slots[n:bs].fill_(self.runner.padding_slot)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:n, width:].fill_(self.runner.padding_block)
        self.block_tables[n:bs].fill_(self.runner.padding_block)
        self.positions[n:bs].zero_()
        self.graphs[bs].replay()
        self.num_replays += 1
        logits = self.outputs[bs][:n].clone()
        if bs in self.checked:
            return logits
        return self._check(inputs, logits, bs)

    def _check(self, inputs: StepInputs, logits: torch.Tensor, bs: int) -> torch.Tensor:
        """First replay per size: recompute eagerly (state writes are position-addressed, so the
        step writing the same rows twice is harmless), compare, and return the eager logits."""
        self.checked.add(bs)
        eager = self.runner.eager_logits(inputs)
        # Per-row relative L2 error: a replay that read stale metadata is off by O(1); the captured ops
        # may batch their math differently from the eager ones (bf16 rounding, the reference MoE).
        err = ((logits - eager).norm(dim=-1) / eager.norm(dim=-1).clamp(min=1e-30)).max().item()
        tol = 1e-4 if self.runner.dtype == torch.float32 else 3e-2
        if not err <= tol:  # also catches NaN
            self.disabled_reason = (f"replay of batch size {bs} disagreed with eager execution "
                                    f"(row error {err:.3g} > {tol:g}); decode runs eagerly")
            log.error("cuda graphs: %s", self.disabled_reason)
        return eager
