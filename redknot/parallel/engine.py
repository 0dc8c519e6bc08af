"""``ParallelLLM``: the engine of one rank of a multi-process layout.

:func:`redknot.engine.build_engine` builds a ``ParallelLLM`` when the layout
needs more than one process (``features.parallel`` sizes or a launched world
above 1); with every size 1 in one process it builds the plain ``LLM``. The
parallel engine is the plain one plus :class:`~redknot.parallel.runtime.ParallelRuntime`:
the process groups are made and the device bound before the engine is built,
and afterwards the public calls go through the data-parallel step loop (rank 0
takes the requests; ranks > 0 call :func:`redknot.parallel.serve`).

Steps run synchronously (``features.async_scheduling`` is not used), and CUDA
graphs stay off when expert or context parallel exchanges data inside a step.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Sequence

from redknot.config.schema import EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig
from redknot.engine.llm import LLM
from redknot.engine.outputs import EngineStats, RequestOutput
from redknot.kernels import KernelSet
from redknot.parallel.runtime import ParallelRuntime, setup_parallel
from redknot.sample.params import SamplingParams

log = logging.getLogger(__name__)


class ParallelLLM(LLM):
    """One rank's engine in a DP x CP (x EP) layout; same API as :class:`LLM` on rank 0."""

    multi_process = True

    def __init__(self, model: ModelConfig, hardware: HardwareConfig, features: FeaturesConfig,
                 engine: Optional[EngineConfig] = None, kernels: Optional[KernelSet] = None) -> None:
        runtime = setup_parallel(features, hardware)
        if runtime is None:
            raise RuntimeError("ParallelLLM needs a multi-process layout; use LLM for one process")
        self.parallel: ParallelRuntime = runtime
        par = features.parallel
        if features.async_scheduling:
            log.info("parallel engine: steps run synchronously (features.async_scheduling is not used)")
        features = dataclasses.replace(features, async_scheduling=False)
        if (par.ep > 1 or par.cp > 1) and hardware.cuda_graphs:
            log.info("parallel engine: CUDA graphs off (expert/context parallel exchange run-time sized data)")
            hardware = dataclasses.replace(hardware, cuda_graphs=False)
        # Expert parallel: the model build allocates and reads only this rank's experts.
        super().__init__(model, hardware, features, engine, kernels,
                         expert_rows=runtime.expert_rows if par.ep > 1 else None)
        runtime.attach(self, self._core)

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int],
                    params: Optional[SamplingParams] = None) -> None:
        """Rank 0: validate, draw the seed and queue the request for its DP group (added at the next
        ``step``). While a step applies its commands, the request is added to this rank's engine."""
        params = params or SamplingParams()
        if self.parallel.dp.applying:
            return super().add_request(req_id, prompt_token_ids, params)
        ids = self._check_prompt(req_id, prompt_token_ids)
        self.parallel.route_request(req_id, ids, params, self._seed_for(params))

    def abort(self, req_id: str) -> None:
        if self.parallel.dp.applying:
            return super().abort(req_id)
        self.parallel.route_abort(req_id)

    def step(self) -> List[RequestOutput]:
        return self.parallel.step()

    def has_unfinished_requests(self) -> bool:
        return self.parallel.has_unfinished()

    def stats(self) -> EngineStats:
        return self.parallel.stats(super().stats())

    def close(self) -> None:
        self.parallel.close()
        super().close()
