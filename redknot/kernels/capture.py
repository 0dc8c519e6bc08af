"""CUDA-graph capture that leaves the process as it found it when the capture fails.

``torch.cuda.graph`` marks the current device's default CUDA generator as capturing when a capture
begins and unmarks it when the capture ends. When the captured code does something a capture refuses (a
host sync such as ``.item()``), the capture is invalidated and ending it raises before the generator is
unmarked, and before the stream the capture ran on stops being the current one. From then on every random
op on that device (``torch.randn``, the samplers' ``torch.rand`` / ``multinomial``) fails with "Offset
increment outside graph capture encountered unexpectedly", until some later capture succeeds, and later
work runs on the capture's stream. Callers that try a capture and fall back when it fails (the kernel
tuners' graph timing, the engine's decode graphs, checks) use :func:`cuda_graph` instead: on a failure it
puts the generator's state (seed and offset, as before the capture) and the current stream back, then
re-raises.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def cuda_graph(graph: torch.cuda.CUDAGraph, **kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, **kwargs)``; if the capture raises, the current device's default generator
    and the current stream are restored before the exception propagates."""
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream(device)
    generator = torch.cuda.default_generators[device]
    saved = generator.clone_state()
    try:
        with torch.cuda.graph(graph, **kwargs):
            yield
    except BaseException:
        generator.graphsafe_set_state(saved)
        torch.cuda.set_stream(stream)
        raise
