"""Multi-process serving on torch.distributed: attention data parallel (DP), MoE expert parallel
(EP) with load balancing (EPLB), and context parallel (CP) for long prefill.

:func:`redknot.engine.build_engine` builds a :class:`~redknot.parallel.engine.ParallelLLM` when
``features.parallel`` (or the launcher) asks for more than one process; rank 0 takes the requests
and the other ranks call :func:`serve`. ``python -m redknot`` does this itself under ``torchrun``
(:mod:`redknot.parallel.launch`). Names are resolved lazily: importing this package does not
import torch.
"""
from __future__ import annotations

from redknot._lazy import lazy_getattr

_EXPORTS = {
    "ParallelLayout": "redknot.parallel.layout",
    "LaunchEnv": "redknot.parallel.layout",
    "ExpertPlacement": "redknot.parallel.eplb",
    "plan_placement": "redknot.parallel.eplb",
    "ParallelLLM": "redknot.parallel.engine",
    "ParallelRuntime": "redknot.parallel.runtime",
    "serve": "redknot.parallel.runtime",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
