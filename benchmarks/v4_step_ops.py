"""How many PyTorch ops a DeepSeek-V4 tensor-only decode step dispatches, and where from.

A decode step replayed from a CUDA graph pays each launch's latency, so at batch 1 the count of small launches
limits the V4 step (benchmarks/NOTES.md, H100 run 12: 489 launches a step in the 3-layer cut). This counts the
ATen ops a tensor-only decode step dispatches (views and other metadata-only ops left out: they launch nothing),
split into the model's own glue (index arithmetic, ring writes, routing) and the ops inside the registry ops
(``redknot/kernels``), per source line of the model. It counts ops, not kernels: on the GPU a registry op is one
or a few Triton launches, and the glue ops are one launch each.

    python benchmarks/v4_step_ops.py [--backend reference|triton] [--device cpu|cuda] [--batch B] [--top N]
    TRITON_INTERPRET=1 python benchmarks/v4_step_ops.py --launches [bgemv|library] [--batch B]

The model is the synthetic tiny V4 (``synthetic.TINY_ARCHITECTURE``: sliding, CSA, HCA and CSA layers, hash and
score routing); the counted step is the second decode step (the first builds what a step keeps).
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that only make views or read metadata: no launch
_NO_LAUNCH = ("aten.view", "aten.t.", "aten._unsafe_view", "aten.unsqueeze", "aten.squeeze", "aten.expand",
              "aten.slice", "aten.select", "aten.transpose", "aten.permute", "aten.alias", "aten.detach",
              "aten.as_strided", "aten.reshape", "aten.split", "aten.unbind", "aten.unflatten", "aten.flatten",
              "aten._reshape_alias", "aten.lift_fresh", "aten.sym_size", "aten.diagonal", "aten.empty",
              "aten.is_nonzero", "aten.dim", "aten.size", "aten.stride")


class OpCounter(TorchDispatchMode):
    """Counts dispatched ATen ops by the innermost ``redknot/models`` or ``redknot/step`` frame; ops under a
    ``redknot/kernels`` frame below it count as registry-op work."""

    def __init__(self):
        super().__init__()
        self.glue: collections.Counter = collections.Counter()
        self.in_ops = 0
        self.op_sources: collections.Counter = collections.Counter()   # registry-op launches by kernels line

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not str(func).startswith(_NO_LAUNCH):
            stack = traceback.extract_stack()
            if any("/triton/runtime/interpreter" in f.filename for f in stack):  # inside an interpreted kernel
                return func(*args, **(kwargs or {}))
            frames = [f for f in stack if "/redknot/" in f.filename]
            model = [f for f in frames if "/redknot/models/" in f.filename or "/redknot/step/" in f.filename]
            if frames and "/redknot/kernels/" in frames[-1].filename:
                self.in_ops += 1
                f = frames[-1]
                self.op_sources[f"{f.filename.split('/redknot/')[1]}:{f.lineno} {f.name} ({str(func)})"] += 1
            elif model:
                f = model[-1]
                self.glue[f"{f.filename.split('/redknot/')[1]}:{f.lineno} {f.name}"] += 1
        return func(*args, **(kwargs or {}))


def count_step(backend: str, device: str, batch: int, dtype: torch.dtype = torch.float32, counter=None):
    """(OpCounter of the second tensor-only decode step, the number of layers); ``counter``: an OpCounter to
    count with (a new one by default)."""
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v4.model import DeepseekV4
    from redknot.models.deepseek_v4.state import V4State
    from redknot.models.deepseek_v4.state_layout import StateLayout
    from redknot.models.deepseek_v4.synthetic import (
        TINY_ARCHITECTURE,
        randomize_,
        synthetic_config,
    )
    from redknot.step.metadata import StepMetadata

    cfg = synthetic_config(TINY_ARCHITECTURE, quantize_fp8=False)
    model = DeepseekV4(cfg, dtype, device="cpu", kernels=KernelSet(backend), with_mtp=False)
    randomize_(model, seed=3)
    model = model.to(device)
    model.fuse_projections()  # the engine's model (build_model fuses the projection groups)
    layout = StateLayout.create(cfg, block_size=math.lcm(*[r for r in cfg.ratios if r]),
                                kv_bytes=torch.finfo(dtype).bits // 8)
    prompt = 40
    per_seq = layout.blocks_for(prompt + 4)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    state = V4State.allocate(cfg, layout, batch, batch * per_seq, device, dtype)
    ids = [[3 + (7 * b + i) % (cfg.vocab_size - 3) for i in range(prompt)] for b in range(batch)]
    slots = list(range(batch))
    meta = StepMetadata.build(ids, [0] * batch, slots, tables, device=device)
    model(meta, state)
    counter = counter if counter is not None else OpCounter()
    for step in range(2):
        n = prompt + step
        meta = StepMetadata.build([[5 + b] for b in range(batch)], [n] * batch, slots,
                                  [t[:layout.blocks_for(n + 1)] for t in tables], device=device)
        meta = StepMetadata(**{**vars(meta), "tensor_only": True})
        if step == 1:
            with counter:
                model.compute_logits(model(meta, state)[meta.logits_indices])
        else:
            model.compute_logits(model(meta, state)[meta.logits_indices])
    return counter, cfg.num_layers


def count_launches(batch: int, gemv: str):
    """(OpCounter, Triton launches by kernel, layers) of the bf16 tiny model's step on the Triton backend through the
    CPU interpreter, the small-row tuners answering ``gemv`` (a ``gemv_bf16.PLANS`` name, or the library path)
    as the GPU's tuners chose on the H100: the launches a GPU step makes, counted on the CPU."""
    import triton.runtime.interpreter as interp

    from redknot.kernels.triton import gemv_bf16
    gemv_bf16.LINEAR_SMALL_TUNER.pick = lambda key, run, device: gemv if gemv in gemv_bf16.PLANS else "cublas"
    gemv_bf16.MOE_SMALL_TUNER.pick = lambda key, run, device: gemv if gemv in gemv_bf16.PLANS else "grouped"
    kernels: collections.Counter = collections.Counter()
    counting = []
    launch = interp.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        if counting:
            kernels[self.fn.__name__] += 1
        return launch(self, *args, **kwargs)

    class Counting(OpCounter):
        def __enter__(self):
            counting.append(True)
            return super().__enter__()

        def __exit__(self, *exc):
            counting.clear()
            return super().__exit__(*exc)

    interp.GridExecutor.__call__ = counted
    try:
        counter, layers = count_step("triton", "cpu", batch, torch.bfloat16, Counting())
    finally:
        interp.GridExecutor.__call__ = launch
    return counter, kernels, layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="reference", help="KernelSet backend (reference, triton)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--top", type=int, default=20, help="source lines listed")
    ap.add_argument("--launches", metavar="GEMV", nargs="?", const="bgemv",
                    help="count the launches of the bf16 model's step on the Triton backend (interpreted; the "
                         "small-row tuners answer GEMV, default bgemv; 'library' for cuBLAS / the grouped path)")
    a = ap.parse_args(argv)
    if a.launches:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--launches: run with TRITON_INTERPRET=1 (the kernels run through Triton's CPU interpreter)")
        counter, kernels, layers = count_launches(a.batch, a.launches)
        aten = sum(counter.glue.values()) + counter.in_ops
        print(f"V4 tiny ({layers} layers, bf16), tensor-only decode step, batch {a.batch}, triton backend "
              f"(interpreted), small-row tuners: {a.launches}")
        print(f"launches: {aten + sum(kernels.values())} (Triton {sum(kernels.values())}, PyTorch {aten}: model "
              f"glue {sum(counter.glue.values())}, inside registry ops {counter.in_ops})")
        print("\n| Triton launches | kernel |\n|---|---|")
        for name, n in kernels.most_common():
            print(f"| {n} | `{name}` |")
        print("\n| PyTorch launches | source |\n|---|---|")
        for where, n in counter.glue.most_common(a.top):
            print(f"| {n} | `{where}` |")
        print("\n| PyTorch launches inside registry ops | source (ATen op) |\n|---|---|")
        for where, n in counter.op_sources.most_common(a.top):
            print(f"| {n} | `{where}` |")
        return 0
    counter, layers = count_step(a.backend, a.device, a.batch)
    glue = sum(counter.glue.values())
    print(f"V4 tiny ({layers} layers), tensor-only decode step, batch {a.batch}, backend {a.backend}, {a.device}")
    print(f"ops dispatched: {glue + counter.in_ops} (model glue {glue}, inside registry ops {counter.in_ops})")
    print("\n| glue ops | source |\n|---|---|")
    for where, n in counter.glue.most_common(a.top):
        print(f"| {n} | `{where}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
