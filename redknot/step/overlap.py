"""Two independent parts of a layer on two CUDA streams (``hardware.side_stream_max_tokens``).

A decode step's small launches leave most SMs idle: the MoE's shared expert (three or four latency-bound
FP8 linears a layer at batch 32) does not depend on the router or the routed experts, so it can run on a
second stream beside them, as SGLang's dual-stream MoE does for DeepSeek below its token threshold.
:func:`beside` runs ``side`` on the device's side stream and ``main`` on the current one, the side
stream forked from the current stream before both and joined back after (event edges, so a CUDA graph
captured around it holds both branches and replays them concurrently). The kernels and their inputs are
the same either way, so the outputs are bit for bit those of the sequential order; only the overlap is new.
The model family picks the pairs (V4: ``moe.py``; V4.1: ``moe.py`` and ``tensor_step.py``).

Memory: the side branch reads tensors the caller keeps alive until the join (``beside`` returns only after
it), and what it allocates belongs to the side stream's pool; a block it frees is reused on the side
stream only after a later fork, which waits for everything the current stream had queued (so after every
read of it there). Steps of more than ``max_tokens`` rows, CPU tensors and a switch of 0 run ``main`` then
``side`` on the current stream.

The switch is process-wide (engines may share a process): the engine applies its config's value before
every step and graph capture (``ModelRunner._own_kernel_switches``), as the small-row class switch."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")

_max_tokens = 0
_streams: dict[int, torch.cuda.Stream] = {}
_open = 0   # beside() calls under way: one inside another's branch runs in order (one side stream per device)


def use_side_stream(max_tokens: int) -> None:
    """Run :func:`beside`'s two parts concurrently for steps of at most ``max_tokens`` rows (0: never)."""
    global _max_tokens
    if int(max_tokens) < 0:
        raise ValueError(f"hardware.side_stream_max_tokens={max_tokens}: must be >= 0 (0 turns the side stream off)")
    _max_tokens = int(max_tokens)


def side_stream_max_tokens() -> int:
    return _max_tokens


def _side(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _streams.get(index)
    if got is None:
        got = _streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))
    return got


def concurrent(x: torch.Tensor) -> bool:
    """Whether :func:`beside` would fork for a step whose rows are ``x``'s first dimension (never inside the
    branch of another fork: its side stream is the same stream, so a nested fork would only add waits)."""
    return bool(_max_tokens) and not _open and x.is_cuda and 0 < x.shape[0] <= _max_tokens


def beside(x: torch.Tensor, main: Callable[[], A], side: Callable[[], B]) -> tuple[A, B]:
    """(main(), side()): ``side`` on the side stream next to ``main`` where :func:`concurrent` holds for the
    step rows ``x``, else both in order on the current stream. Both must only read tensors that live until
    this returns (their arguments) and must not depend on each other: neither may read what the other writes or
    creates (a lazily made per-step tensor included) before the join."""
    global _open
    if not concurrent(x):
        return main(), side()
    current = torch.cuda.current_stream(x.device)
    stream = _side(x.device)
    stream.wait_stream(current)          # fork: the side branch starts after everything queued so far
    _open += 1
    try:
        with torch.cuda.stream(stream):
            b = side()
        a = main()
    finally:
        _open -= 1
        current.wait_stream(stream)      # join: what follows on the current stream sees the side's writes
    return a, b
