"""Decode of ``benchmarks/e2e_v41.py``: the rows of one context for every batch, eager and through the
tensor-only step (captured in a CUDA graph on a GPU, profiled with ``step_profile_v41``)."""
from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from e2e_v41_cut import Batch, distinct_ids, distinct_rows, sync
from e2e_v41_timing import decode_floor_s, op_shares, registry_shares
from graph_timing import alternate_best_ms, capture_on_side_stream
from step_profile_v41 import step_views

from redknot.kernels.capture import cuda_graph

print = functools.partial(print, flush=True)  # progress unbuffered


def graph_decode(b: Batch, bs: int, steps: int, device, profile: bool = False, profile_steps: int = 20,
                 profile_replay: bool = True, side_tokens: int = 0) -> dict:
    """Decode of sequences 0..bs-1 through the tensor-only step (``deepseek_v41/tensor_step.py``): captured
    in a CUDA graph and replayed on a GPU, run as is on a CPU. The step's attention, indexer and
    compressor are PyTorch math (the registry's attention ops take host spans); linears and the MoE
    go through the registry. Parity: the replay against an eager step of the same rows (position-
    addressed writes, so running both at one position is harmless). ``profile``: also where the step's
    device time goes, ``profile_steps`` eager steps and as many replays under torch.profiler, against the
    replay's wall time (``step_profile_v41.step_views``; the replays only with ``profile_replay``).
    ``side_tokens`` > 0 (a GPU): the same step captured again with ``redknot.step.overlap``'s side stream on for
    up to that many rows (``hardware.side_stream_max_tokens``), its output compared bit for bit with the one-stream
    replay's, and both graphs timed in alternation (the best of three rounds each)."""
    from redknot.models.deepseek_v41.tensor_step import TensorStep, tensor_forward

    dev = b.model.device
    seqs = list(range(bs))
    ids = distinct_ids(11, bs, b.model.cfg.vocab_size)
    step = TensorStep(torch.tensor(ids, dtype=torch.long, device=dev),
                      torch.tensor([b.lens[s] for s in seqs], dtype=torch.long, device=dev),
                      torch.arange(bs + 1, dtype=torch.int32, device=dev),
                      torch.arange(bs, dtype=torch.int32, device=dev),
                      torch.tensor([b.blocks[s] for s in seqs], dtype=torch.int32, device=dev), max_rows=1)
    try:
        out = tensor_forward(b.model, step, b.state)     # warm-up (weight caches, tuning)
        sync(device)
        graph = None
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with cuda_graph(graph):
                out = tensor_forward(b.model, step, b.state)
            graph.replay()
        else:
            out = tensor_forward(b.model, step, b.state)
        sync(device)
        got = out.float().clone()
        want = b.step([[x] for x in ids], seqs=seqs).float()
        for s in seqs:
            b.lens[s] -= 1
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)).max().item()
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            if graph is not None:
                graph.replay()
            else:
                tensor_forward(b.model, step, b.state)
        sync(device)
        ms = (time.perf_counter() - t) / steps * 1e3
        side = _side_stream_ab(b, step, graph, got, steps, side_tokens) if side_tokens and graph is not None else {}
        views = None
        if profile:
            def eager():
                return tensor_forward(b.model, step, b.state)
            replay = (graph.replay if graph is not None else eager) if profile_replay else None
            views = step_views(eager, replay, device, profile_steps, ms)
        del graph, out
    except RuntimeError as exc:   # capture refused (a host sync in a routed op) or out of memory
        return {"graph": f"failed: {str(exc).splitlines()[0][:200]}"}
    return {"graph": "captured" if device.type == "cuda" else "tensor-only step, not captured (CPU)",
            "graph_ms_per_step": ms, "graph_rel_err": rel, **side, **({"step_views": views} if views else {})}


def _side_stream_ab(b: Batch, step, graph, got: torch.Tensor, steps: int, side_tokens: int) -> dict:
    """The step captured with the side stream on (``graph_decode``'s ``side_tokens``) against ``graph``."""
    from redknot.models.deepseek_v41.tensor_step import tensor_forward

    # its eager run rewrites the step's positions (position-addressed writes)
    side, out = capture_on_side_stream(lambda: tensor_forward(b.model, step, b.state), side_tokens)
    side.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out.float(), got))
    best = alternate_best_ms({"one": graph, "side": side}, steps)
    del side, out
    return {"side_stream_tokens": side_tokens, "side_stream_same_bits": same,
            "one_stream_best_ms": best["one"], "side_stream_best_ms": best["side"]}


def decode_rows(a, report: dict, b: Batch, ctx: int, eager: bool, *, cfg, ops, device, batches: list[int],
                profiles: list, over_budget: Callable[[float], bool]) -> None:
    """Decode rows at context ``ctx`` for every batch: eager (``eager``) and through the CUDA-graph step.
    ``a``: the parsed arguments; rows go to ``report``; ``profiles[0]``: torch.profiler runs left."""
    for bs in batches:
        if over_budget(10 + a.decode_steps * bs * 0.01):
            print(f"decode ctx {ctx} batch {bs}: skipped (budget)")
            report["decode"].append({"context": ctx, "batch": bs, "skipped": "budget"})
            continue
        seqs = list(range(bs))
        floor_ms = decode_floor_s(cfg, ctx, bs) * 1e3
        if not eager:   # a synthetic state: the graph only (one eager step checks its replay)
            report["decode"].append({"context": ctx, "batch": bs, "ms_per_step": None, "floor_ms": floor_ms,
                                     "fraction_of_floor": None, "state": "synthetic"})
        else:
            b.step(distinct_rows(5, bs, cfg.vocab_size), seqs=seqs)   # warm-up
            sync(device)
            t = time.perf_counter()
            for i in range(a.decode_steps):
                b.step(distinct_rows(7 + i, bs, cfg.vocab_size), seqs=seqs)
            sync(device)
            ms = (time.perf_counter() - t) / a.decode_steps * 1e3
            print(f"decode ctx {ctx} batch {bs}: {ms:.2f} ms/step eager ({100 * floor_ms / ms:.1f} % of the "
                  f"floor {floor_ms:.3f} ms)")
            report["decode"].append({"context": ctx, "batch": bs, "ms_per_step": ms, "floor_ms": floor_ms,
                                     "fraction_of_floor": floor_ms / ms})
        if a.decode_graphs and not over_budget(10 + a.decode_steps * bs * 0.01):
            g = graph_decode(b, bs, a.decode_steps, device, profile=not a.skip_profile,
                             profile_steps=a.profile_steps, profile_replay=not a.skip_replay_profile,
                             side_tokens=a.side_stream_tokens)
            report["decode"][-1].update(g)
            if "graph_ms_per_step" in g:
                print(f"decode ctx {ctx} batch {bs}: {g['graph_ms_per_step']:.2f} ms/step {g['graph']} "
                      f"({100 * floor_ms / g['graph_ms_per_step']:.1f} % of the floor), rel err vs "
                      f"eager {g['graph_rel_err']:.2e}")
            else:
                print(f"decode ctx {ctx} batch {bs}: graph {g['graph']}")
            if "side_stream_best_ms" in g:
                print(f"decode ctx {ctx} batch {bs}: side stream (up to {g['side_stream_tokens']} rows) "
                      f"{g['side_stream_best_ms']:.3f} ms/step ({100 * floor_ms / g['side_stream_best_ms']:.1f} %) "
                      f"against one stream {g['one_stream_best_ms']:.3f} ({100 * floor_ms / g['one_stream_best_ms']:.1f}"
                      f" %), best of 3 alternating rounds; same bits: {g['side_stream_same_bits']}")
            for view, v in g.get("step_views", {}).items():
                print(f"decode ctx {ctx} batch {bs}: {view} profile: " + (v["error"] if "error" in v else
                      f"{v['launches_per_step']:.0f} launches/step, busy {v['busy_ms_per_step']:.3f} ms/step, "
                      f"replay wall - busy {v['gap_ms_per_step']:.3f} ms/step ({v['kind']})"))
        if eager and not a.skip_profile and not over_budget(10):
            report["op_shares"][f"decode b{bs} at {ctx}"] = registry_shares(
                ops, lambda bs=bs, seqs=seqs: b.step(distinct_rows(8, bs, cfg.vocab_size), seqs=seqs), device)
        if eager and not a.skip_profile and not over_budget(10) and profiles[0]:
            profiles[0] -= 1
            report["profile"][f"decode b{bs} at {ctx}"] = op_shares(
                lambda bs=bs, seqs=seqs: b.step(distinct_rows(9, bs, cfg.vocab_size), seqs=seqs), device)
