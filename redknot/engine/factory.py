"""``build_engine``: the engine section's ``_target_``; the one way a run builds its engine.

One process (every ``features.parallel`` size 1 and no launched world) gets the
plain :class:`~redknot.engine.llm.LLM`; a multi-process layout gets
:class:`~redknot.parallel.engine.ParallelLLM`, which also takes the expert
placement of its rank into the model build.
"""
from __future__ import annotations

from typing import Optional

from redknot.config.schema import EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig
from redknot.engine.llm import LLM
from redknot.kernels import KernelSet
from redknot.parallel.layout import needs_parallel


def build_engine(model: ModelConfig, hardware: HardwareConfig, features: FeaturesConfig,
                 engine: Optional[EngineConfig] = None, kernels: Optional[KernelSet] = None) -> LLM:
    """The engine for this config (same arguments as :class:`LLM`)."""
    if not needs_parallel(features.parallel):
        return LLM(model, hardware, features, engine, kernels)
    from redknot.parallel.engine import ParallelLLM  # torch.distributed only for a parallel layout

    return ParallelLLM(model, hardware, features, engine, kernels)
