"""torch.distributed process groups of a parallel layout, and the row collectives built on them.

``init_groups`` runs at engine start, before the engine picks its device: it
checks the layout against the launched world and the devices of this host,
binds the rank to its local device, initialises the default process group
(NCCL on CUDA, gloo on CPU; env:// rendezvous from torchrun's variables) and
creates

* ``control`` — a gloo group over all ranks for host-side messages (the step's
  commands and outputs), so they never queue behind device collectives;
* ``cp`` — this rank's context-parallel group (``cp`` ranks of one DP group);
* ``ep`` — this rank's expert-parallel group (``ep`` consecutive ranks).

Every rank creates every group in the same order (``new_group`` is collective).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from redknot.config.schema import Accelerator, HardwareConfig, ParallelConfig
from redknot.config.violations import ConfigError, check_parallel_layout
from redknot.parallel.layout import LaunchEnv, ParallelLayout, export_slurm_env

log = logging.getLogger(__name__)

# Workers wait on the front between steps while it prepares inputs, scores and writes records.
COLLECTIVE_TIMEOUT = timedelta(hours=3)
BACKENDS = {Accelerator.cpu: "gloo", Accelerator.cuda: "nccl", Accelerator.npu: "hccl"}


@dataclass
class ParallelGroups:
    """The process groups this rank belongs to (``None`` where the size is 1)."""
    layout: ParallelLayout
    backend: str
    device: torch.device
    control: dist.ProcessGroup
    cp: Optional[dist.ProcessGroup] = None
    ep: Optional[dist.ProcessGroup] = None
    created: List[dist.ProcessGroup] = field(default_factory=list)

    def destroy(self) -> None:
        """Destroy the groups made here (the default group stays: it belongs to the process)."""
        for group in self.created:
            dist.destroy_process_group(group)
        self.created = []


def _accelerator(hardware: HardwareConfig) -> Accelerator:
    return Accelerator(hardware.accelerator)


def check_world(parallel: ParallelConfig, env: LaunchEnv) -> None:
    """The layout must tile the launched world; the message says how to launch it."""
    violations = check_parallel_layout(parallel, env.world_size)
    if violations:
        need = parallel.dp * parallel.cp
        hint = (f"launch {need} processes, e.g. `torchrun --nproc-per-node {need} -m redknot ...`"
                if env.world_size != need else "")
        header = "parallel layout does not fit the launched world" + (f" ({hint})" if hint else "")
        raise ConfigError(violations, header=header)


def bind_device(hardware: HardwareConfig, env: LaunchEnv) -> torch.device:
    """Make this rank's local device current; the host must have one device per local rank."""
    accel = _accelerator(hardware)
    if accel == Accelerator.cpu:
        return torch.device("cpu")
    module = torch.cuda if accel == Accelerator.cuda else getattr(torch, "npu")
    found = module.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if found == 1 and env.local_world_size > 1 and visible and "," not in visible:
        # The launcher pinned one device per task (Slurm GPU binding): ours is the only one we see.
        module.set_device(0)
        return torch.device(accel.value, 0)
    if env.local_world_size > found:
        raise RuntimeError(
            f"features.parallel: this host runs {env.local_world_size} ranks (LOCAL_WORLD_SIZE) but torch sees "
            f"{found} {accel.value} device(s); one device per rank is needed: launch at most {found} processes "
            f"per node or lower features.parallel.dp/cp")
    module.set_device(env.local_rank)
    return torch.device(accel.value, env.local_rank)


class FrontExited(RuntimeError):
    """Rank 0 finished without building an engine (e.g. nothing left to run); workers just exit."""


def init_groups(parallel: ParallelConfig, hardware: HardwareConfig, env: Optional[LaunchEnv] = None,
                proceed: bool = True) -> ParallelGroups:
    """Check, bind the device, initialise torch.distributed and create this layout's groups.

    Right after the control group exists, rank 0 tells the others whether an engine follows:
    ``proceed=False`` (rank 0 only) releases workers that are waiting for an engine that rank 0
    will not build; they raise :class:`FrontExited`."""
    if env is None:
        export_slurm_env()
        env = LaunchEnv.from_env()
    check_world(parallel, env)
    layout = ParallelLayout.create(parallel, env)
    device = bind_device(hardware, env)
    backend = BACKENDS[_accelerator(hardware)]
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=COLLECTIVE_TIMEOUT)
    elif dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}, but the launcher says rank {env.rank} of {env.world_size}")
    control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    groups = ParallelGroups(layout, backend, device, control, created=[control])
    box = [proceed]
    dist.broadcast_object_list(box, src=0, group=control)
    if not box[0]:
        groups.destroy()
        if layout.is_front:
            return groups
        raise FrontExited(f"rank 0 finished without building an engine; rank {layout.rank} has nothing to serve")
    if layout.cp > 1:
        groups.cp = _member_group(groups, [layout.cp_group_ranks(d) for d in range(layout.dp)])
    if layout.ep > 1:
        groups.ep = _member_group(groups, [layout.ep_group_ranks(g) for g in range(layout.num_ep_groups)])
    log.info("parallel layout: %s (backend %s, device %s)", layout.describe(), backend, device)
    return groups


def _member_group(groups: ParallelGroups, all_ranks: Sequence[List[int]]) -> dist.ProcessGroup:
    """Create one group per rank list (every rank takes part in every creation); return ours."""
    mine = None
    for ranks in all_ranks:
        group = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
        groups.created.append(group)
        if groups.layout.rank in ranks:
            mine = group
    return mine


def all_gather_rows(rows: torch.Tensor, sizes: Sequence[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``rows`` [n_r, ...] in group-rank order; ``sizes`` = every n_r
    (known to all ranks), so no size exchange is needed. -> [sum(sizes), ...]."""
    most = max(sizes)
    padded = rows.new_zeros((most,) + tuple(rows.shape[1:]))  # [max n_r, ...]
    padded[:rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])


def all_to_all_rows(rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
    """Rows [sum(send_counts), ...] grouped by destination -> rows received, grouped by source."""
    out = rows.new_empty((sum(recv_counts),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), list(recv_counts), list(send_counts), group=group)
    return out


def exchange_counts(send_counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """send_counts [n] (rows for each peer) -> recv_counts [n] (rows from each peer)."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=group)
    return recv
