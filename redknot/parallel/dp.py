"""Attention data parallel (DP): rank 0 takes requests, every DP group serves its own.

Rank 0 (the *front*) is where the public engine API is called. ``add_request``
and ``abort`` only queue a command: requests go to the DP group with the fewest
active requests (ties: lowest rank — the same rule as the harness's per-rank
admission, so its ``admission_batch_size`` bounds the active requests of each
DP rank). Each ``step`` is one global step on every rank:

1. the front broadcasts the queued commands (gloo control group);
2. every rank applies the commands of its DP group and runs one local engine
   step (scheduler, model, sampler) on its own requests and paged state; the
   ``cp`` ranks of a group run identical schedules; a rank without work joins
   the MoE all-to-alls with zero rows;
3. every rank sends a report to the front: its DP leader's outputs (times moved
   to the front's clock), counters and per-rank metrics.

Other ranks loop in :meth:`DataParallel.serve` until the front shuts them down.
The local steps are synchronous (no host/device overlap across the world yet).
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from redknot.engine.outputs import EngineStats, RequestOutput


@dataclass
class AddCommand:
    dp_rank: int
    req_id: str
    prompt_token_ids: List[int]
    params: object       # SamplingParams with the seed the front drew
    arrival_time: float  # front clock


@dataclass
class StepCommand:
    """What every rank does in one global step."""
    adds: List[AddCommand] = field(default_factory=list)
    aborts: List[Tuple[int, str]] = field(default_factory=list)  # (dp_rank, req_id)
    rebalance: bool = False
    shutdown: bool = False


@dataclass
class RankReport:
    """One rank's result of a global step."""
    rank: int
    outputs: List[RequestOutput]
    stats: Optional[EngineStats]
    metrics: Dict[str, float]


class DPRouter:
    """Which DP group serves each request (least active requests, ties to the lowest rank)."""

    def __init__(self, dp: int):
        self.active: List[set] = [set() for _ in range(dp)]
        self.owner: Dict[str, int] = {}        # active requests
        self.owner_history: Dict[str, int] = {}  # every request ever routed
        self.peak_active = [0] * dp

    def assign(self, req_id: str) -> int:
        if req_id in self.owner:
            raise ValueError(f"request id {req_id!r} is already in the engine")
        rank = min(range(len(self.active)), key=lambda r: (len(self.active[r]), r))
        self.active[rank].add(req_id)
        self.owner[req_id] = self.owner_history[req_id] = rank
        self.peak_active[rank] = max(self.peak_active[rank], len(self.active[rank]))
        return rank

    def finished(self, req_id: str) -> None:
        rank = self.owner.pop(req_id, None)
        if rank is not None:
            self.active[rank].discard(req_id)

    @property
    def num_active(self) -> int:
        return sum(len(a) for a in self.active)


def shift_times(output: RequestOutput, offset: float) -> RequestOutput:
    m = output.metrics
    if m is None or offset == 0.0:
        return output
    moved = {k: getattr(m, k) + offset for k in ("arrival_time", "scheduled_time", "first_token_time", "finish_time")
             if getattr(m, k) is not None}
    return replace(output, metrics=replace(m, **moved))


def merge_stats(stats: List[EngineStats]) -> EngineStats:
    """Counters summed over the DP groups; steps and peaks are maxima."""
    out = EngineStats()
    for s in stats:
        for name in ("num_prefill_tokens", "num_decode_tokens", "num_preemptions", "num_draft_proposed",
                     "num_draft_accepted", "num_requests_finished", "num_cuda_graph_steps", "cache_blocks_total",
                     "cache_blocks_peak_used", "execute_time_s"):
            setattr(out, name, getattr(out, name) + getattr(s, name))
        out.num_steps = max(out.num_steps, s.num_steps)
        out.peak_memory_bytes = max(out.peak_memory_bytes, s.peak_memory_bytes)
    if stats:
        out.cuda_graphs, out.step_times_s = stats[0].cuda_graphs, list(stats[0].step_times_s)
    return out


class DataParallel:
    """The global step loop of one engine (see the module docstring); ``runtime`` supplies the
    layout, the groups and the local step."""

    def __init__(self, runtime, llm):
        self.runtime, self.llm = runtime, llm
        self.layout = runtime.layout
        self.control = runtime.groups.control
        self.router = DPRouter(self.layout.dp)
        self.pending = StepCommand()
        self.applying = False  # True while this rank applies broadcast commands to its own engine
        self.closed = False
        self.rank_metrics: Dict[int, Dict[str, float]] = {}
        self._rank_stats: List[EngineStats] = []
        self.clock_offset = self._clock_offset()

    def _clock_offset(self) -> float:
        """front perf_counter - this rank's. One host shares one monotonic clock (0); across hosts,
        rank 0's reading right after a barrier, taken when it arrives (error: one broadcast latency)."""
        if self.layout.world_size == self.layout.local_world_size:
            return 0.0
        dist.barrier(group=self.control)
        box = [time.perf_counter()]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0] - time.perf_counter() if not self.layout.is_front else 0.0

    # ------------------------------------------------------------------ front side
    def add(self, req_id: str, prompt_token_ids: List[int], params, max_model_len: int) -> None:
        if len(prompt_token_ids) >= max_model_len:
            raise ValueError(f"request {req_id!r}: prompt of {len(prompt_token_ids)} tokens leaves no room to "
                             f"generate within model.max_position={max_model_len}")
        rank = self.router.assign(req_id)
        try:
            pickle.dumps(params)
        except Exception as err:
            self.router.finished(req_id)
            raise ValueError(f"request {req_id!r}: its SamplingParams cannot be sent to the DP ranks "
                             f"({type(err).__name__}: {err}); logits processors must be picklable") from err
        self.pending.adds.append(AddCommand(rank, req_id, list(prompt_token_ids), params, time.perf_counter()))

    def abort(self, req_id: str) -> None:
        rank = self.router.owner.get(req_id)
        if rank is not None:
            self.pending.aborts.append((rank, req_id))

    def request_rebalance(self) -> None:
        self.pending.rebalance = True

    def has_unfinished(self) -> bool:
        return bool(self.router.num_active or self.pending.adds or self.pending.aborts)

    def step(self) -> List[RequestOutput]:
        cmd, self.pending = self.pending, StepCommand()
        reports = self._global_step(cmd)
        outputs: List[RequestOutput] = []
        for report in reports:
            outputs += report.outputs
            self.rank_metrics[report.rank] = report.metrics
        for out in outputs:
            if out.finished:
                self.router.finished(out.req_id)
        self._rank_stats = [r.stats for r in reports if r.stats is not None]
        return outputs

    def stats(self) -> EngineStats:
        return merge_stats(self._rank_stats) if self._rank_stats else self.runtime.local_stats()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.layout.is_front:
            dist.broadcast_object_list([StepCommand(shutdown=True)], src=0, group=self.control)

    # ------------------------------------------------------------------ every rank
    def serve(self) -> None:
        """Follow the front's steps until it shuts down (ranks other than 0)."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            cmd: StepCommand = box[0]
            if cmd.shutdown:
                self.closed = True
                return
            report = self._local_step(cmd)
            dist.gather_object(report, None, dst=0, group=self.control)

    def _global_step(self, cmd: StepCommand) -> List[RankReport]:
        dist.broadcast_object_list([cmd], src=0, group=self.control)
        report = self._local_step(cmd)
        reports: List[Optional[RankReport]] = [None] * self.layout.world_size
        dist.gather_object(report, reports, dst=0, group=self.control)
        return reports

    def _local_step(self, cmd: StepCommand) -> RankReport:
        mine = self.layout.dp_rank
        errors = self._apply(cmd, mine)
        outputs = errors + self.runtime.local_step(cmd.rebalance)
        leader = self.layout.is_dp_leader
        if not leader:
            outputs = []
        outputs = [shift_times(o, self.clock_offset) for o in outputs]
        stats = self.runtime.local_stats() if leader else None
        return RankReport(self.layout.rank, outputs, stats, self.runtime.local_metrics())

    def _apply(self, cmd: StepCommand, mine: int) -> List[RequestOutput]:
        """Add and abort this DP group's requests; an add the engine refuses fails that request only."""
        errors: List[RequestOutput] = []
        self.applying = True
        try:
            for add in cmd.adds:
                if add.dp_rank != mine:
                    continue
                try:
                    self.llm.add_request(add.req_id, add.prompt_token_ids, add.params)
                    req = self.llm.scheduler.requests.get(add.req_id)
                    if req is not None:
                        req.times.arrival = add.arrival_time - self.clock_offset
                except Exception as err:  # noqa: BLE001 - reported as this request's error
                    errors.append(RequestOutput(add.req_id, add.prompt_token_ids, [], "", True, "error",
                                                f"{type(err).__name__}: {err}"))
            for rank, req_id in cmd.aborts:
                if rank == mine:
                    self.llm.abort(req_id)
        finally:
            self.applying = False
        return errors
