"""The parallel side of one engine: groups, expert parallel, context parallel and the DP step loop.

The engine calls :func:`setup_parallel` first thing (before choosing its device):
it returns ``None`` for a one-process layout, and then nothing else changes.
Otherwise the engine (:class:`~redknot.parallel.engine.ParallelLLM`) builds itself as usual
on the rank's device and calls :meth:`ParallelRuntime.attach`, which shards the
routed experts (EP), routes the model forward through the context-parallel plan
(CP) and starts the data-parallel step loop (DP); from then on ``add_request /
abort / step / has_unfinished_requests / stats / close`` go through the runtime.
Ranks other than 0 call :func:`serve`.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Dict, List, Optional

import torch

from redknot.config.schema import FeaturesConfig, HardwareConfig, SwaReplayMode
from redknot.engine.device import peak_memory_bytes
from redknot.engine.outputs import EngineStats, RequestOutput
from redknot.parallel.dp import DataParallel
from redknot.parallel.ep import EplbSettings, ExpertParallel
from redknot.parallel.eplb import check_sizes, uniform_placement
from redknot.parallel.groups import ParallelGroups, init_groups
from redknot.parallel.layout import LaunchEnv, ParallelLayout, export_slurm_env

log = logging.getLogger(__name__)

ACTIVE: List["ParallelRuntime"] = []  # runtimes of this process not yet destroyed (the launcher closes them)


def setup_parallel(features: FeaturesConfig, hardware: HardwareConfig) -> Optional["ParallelRuntime"]:
    """None for one process with every parallel size 1; else the runtime of this rank (groups made,
    device bound). Layout problems raise a ConfigError naming the keys and the launched world."""
    parallel = features.parallel
    export_slurm_env()
    env = LaunchEnv.from_env()
    if env.world_size == 1 and parallel.dp == parallel.cp == parallel.ep == 1:
        return None
    _check_features(features)
    return ParallelRuntime(init_groups(parallel, hardware, env), features, hardware)


def _check_features(features: FeaturesConfig) -> None:
    par, eplb = features.parallel, features.parallel.eplb
    if eplb.enabled and par.ep == 1:
        raise ValueError("features.parallel.eplb.enabled=true: load balancing moves experts between the ranks "
                         "of an expert-parallel group; it needs features.parallel.ep > 1")
    mode = SwaReplayMode(features.swa_replay.mode)
    if par.cp > 1 and mode != SwaReplayMode.off:
        raise ValueError(f"features.swa_replay.mode={mode.value}: not supported with context parallel "
                         f"(features.parallel.cp={par.cp}); use features.swa_replay.mode=off")


class ParallelRuntime:
    """This rank's groups and the parallel parts installed into its engine."""

    def __init__(self, groups: ParallelGroups, features: FeaturesConfig, hardware: HardwareConfig):
        self.groups, self.features, self.hardware = groups, features, hardware
        self.layout: ParallelLayout = groups.layout
        self.ep: Optional[ExpertParallel] = None
        self.cp = None
        self.dp: Optional[DataParallel] = None
        self.ep_comm = "none"
        self.num_steps = 0
        self._llm = self._core = None
        ACTIVE.append(self)

    @property
    def device(self) -> torch.device:
        return self.groups.device

    # ------------------------------------------------------------------ installation
    def attach(self, llm, core) -> None:
        """Install EP/CP into ``llm``'s model and runner and start the DP loop (collective)."""
        self._llm, self._core = llm, core
        runner, par = llm.runner, self.features.parallel
        if par.ep > 1:
            self._install_ep(llm.family, runner.model, llm.engine_config.scheduler.max_num_batched_tokens)
        if par.cp > 1:
            from redknot.parallel.cp import ContextParallel

            hooks = llm.family.context_parallel()
            if hooks is None:
                raise ValueError(f"features.parallel.cp={par.cp}: model family {llm.family.name!r} has no "
                                 f"context-parallel layers; use features.parallel.cp=1")
            self.cp = ContextParallel(self.groups.cp, self.layout.cp_rank, par.cp, hooks)
            self.cp.install(runner.model)
        self.dp = DataParallel(self, llm)
        if self.layout.is_front:
            atexit.register(self.close)
        log.info("parallel engine ready: %s, MoE all-to-all: %s", self.layout.describe(), self.ep_comm)

    def expert_rows(self, layer: int, num_experts: int):
        """The experts this rank keeps in a main layer before any load is known (the model build
        allocates and loads only these)."""
        eplb = self.features.parallel.eplb
        redundant = eplb.num_redundant_experts if eplb.enabled else 0
        check_sizes(num_experts, self.layout.ep, redundant)
        return uniform_placement(num_experts, self.layout.ep, redundant).rank_experts(self.layout.ep_rank)

    def _install_ep(self, family, model, max_tokens: int) -> None:
        eplb = self.features.parallel.eplb
        redundant = eplb.num_redundant_experts if eplb.enabled else 0
        check_sizes(model.cfg.n_routed_experts, self.layout.ep, redundant)
        settings = EplbSettings(eplb.enabled, redundant, eplb.rebalance_interval)
        self.ep = ExpertParallel(model, family.expert_layers(model), self.groups.ep, self.layout.ep_rank,
                                 self.layout.ep, settings, self.device)
        self.ep_comm = "all_to_all"
        from redknot.parallel.deepep import use_deep_ep

        if use_deep_ep(self.hardware, self.features):
            from redknot.parallel.deepep import install_deep_ep

            install_deep_ep(self.ep, max_tokens)
            self.ep_comm = "deep_ep"

    # ------------------------------------------------------------------ engine hooks
    def route_request(self, req_id: str, prompt_token_ids: List[int], params, seed: int) -> None:
        """Queue a validated request for its DP group (added by the next step)."""
        self._front_only("add_request")
        if params.seed is None:  # the front draws every seed, in arrival order, as one process would
            params = dataclasses.replace(params, seed=seed)
        self.dp.add(req_id, prompt_token_ids, params, self._llm.scheduler.max_model_len)

    def route_abort(self, req_id: str) -> None:
        self._front_only("abort")
        self.dp.abort(req_id)

    def step(self) -> List[RequestOutput]:
        self._front_only("step")
        return self.dp.step()

    def has_unfinished(self) -> bool:
        self._front_only("has_unfinished_requests")
        return self.dp.has_unfinished()

    def stats(self, local: EngineStats) -> EngineStats:
        return self.dp.stats() if self.layout.is_front else local

    def close(self) -> None:
        if self.dp is not None and not self.dp.closed:
            self.dp.close()

    def request_rebalance(self) -> None:
        """Re-place the experts after the next step (on every rank, between two steps)."""
        self._front_only("request_rebalance")
        self.dp.request_rebalance()

    def _front_only(self, what: str) -> None:
        if not self.layout.is_front:
            raise RuntimeError(f"{what}: rank {self.layout.rank} is a worker of a parallel engine; requests go "
                               f"to rank 0, and this rank calls redknot.parallel.serve(llm)")

    # ------------------------------------------------------------------ the local step
    def local_step(self, rebalance: bool) -> List[RequestOutput]:
        """One engine step on this rank's requests; exactly one model forward per rank per step
        when expert parallel spans ranks (an idle rank joins with zero rows)."""
        ep = self.ep
        before = ep.num_forwards if ep is not None else 0
        outputs = self._core.step()
        self.num_steps += 1
        if ep is None:
            return outputs
        ran = ep.num_forwards - before
        if ran == 0:
            ep.idle_forward()
        elif ran > 1:
            raise RuntimeError(f"one engine step ran the model {ran} times; expert parallel needs exactly one "
                               f"target forward per step on every rank")
        settings = ep.eplb
        if rebalance or (settings.enabled and self.num_steps % settings.interval == 0):
            ep.rebalance()
        return outputs

    def local_stats(self) -> EngineStats:
        stats = self._core.stats
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
        return stats

    def local_metrics(self) -> Dict[str, float]:
        """This rank's counters, reported to the front every step (logged with a rank tag)."""
        stats = self._core.stats
        out = {"steps": float(self.num_steps), "prefill_tokens": float(stats.num_prefill_tokens),
               "decode_tokens": float(stats.num_decode_tokens), "execute_time_s": float(stats.execute_time_s),
               "peak_memory_bytes": float(peak_memory_bytes(self.device))}
        if self.ep is not None:
            out.update(self.ep.metrics())
        if self.cp is not None:
            out["cp.split_steps"] = float(self.cp.num_split_steps)
        return out

    def rank_metrics(self) -> Dict[int, Dict[str, float]]:
        """Latest metrics of every rank (front only)."""
        return dict(self.dp.rank_metrics) if self.dp is not None else {}

    def describe(self) -> Dict[str, str]:
        params = self.layout.as_params()
        eplb = self.features.parallel.eplb
        params.update({"parallel.ep_comm": self.ep_comm, "parallel.backend": self.groups.backend,
                       "parallel.eplb": f"{eplb.enabled}/{eplb.num_redundant_experts}/{eplb.rebalance_interval}"})
        return params

    def destroy(self) -> None:
        """Close the DP loop and destroy this runtime's process groups."""
        self.close()
        self.groups.destroy()
        if self in ACTIVE:
            ACTIVE.remove(self)


def serve(llm) -> None:
    """Run a worker rank's engine until the front closes (ranks other than 0 call this)."""
    runtime = getattr(llm, "parallel", None)
    if runtime is None:
        raise RuntimeError("serve(llm): this engine was built for one process (features.parallel all 1)")
    if runtime.layout.is_front:
        raise RuntimeError("serve(llm): rank 0 is the front; it takes requests through the LLM API")
    runtime.dp.serve()
