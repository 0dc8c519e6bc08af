"""Median time of a few launches as CUDA-graph replays: the step benchmarks' shared timer.

The calls run once eagerly (first-use tuning, lazy set-up), then ``inner`` times each inside one captured graph;
after one untimed replay each of ``reps`` replays is timed with CUDA events and the median divided by the number of
calls in the graph. Off a GPU the calls run once, eagerly, with the host clock (smoke runs only: no speed claim).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def graph_ms(calls: Sequence[Callable[[], object]], device, reps: int, inner: int = 1) -> float:
    """Median ms per call of ``calls`` (thunks run in turn, ``inner`` times each) replayed as one CUDA graph."""
    import torch

    from redknot.kernels.capture import cuda_graph

    if device.type != "cuda":
        t = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t) * 1e3 / len(calls)
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        for _ in range(inner):
            for c in calls:
                c()
    graph.replay()                  # one untimed replay: the first one pays lazy set-up
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / (len(calls) * inner))
    return statistics.median(times)


def alternate_best_ms(graphs: dict, steps: int, rounds: int = 3) -> dict:
    """Best ms per replay of each captured graph in ``graphs`` (name -> CUDA graph): ``rounds`` rounds that
    replay every graph ``steps`` times in turn (host clock around a synchronised run), so the graphs compared
    share the device's state (clocks, caches) as closely as two runs can."""
    import torch

    best = {name: float("inf") for name in graphs}
    for _ in range(rounds):
        for name, g in graphs.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                g.replay()
            torch.cuda.synchronize()
            best[name] = min(best[name], (time.perf_counter() - t) / steps * 1e3)
    return best


def capture_on_side_stream(forward: Callable[[], object], side_tokens: int):
    """(graph, its output) of ``forward`` captured with ``redknot.step.overlap``'s side stream on for steps of up
    to ``side_tokens`` rows (``hardware.side_stream_max_tokens``), after one eager run on two streams (tuning and
    lazy set-up outside the capture); the process's switch is put back afterwards."""
    import torch

    from redknot.kernels.capture import cuda_graph
    from redknot.step.overlap import side_stream_max_tokens, use_side_stream

    before = side_stream_max_tokens()
    use_side_stream(side_tokens)
    try:
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with cuda_graph(graph):
            out = forward()
    finally:
        use_side_stream(before)
    return graph, out
