"""Where this process sits in the parallel layout (pure Python; no torch).

Ranks tile a ``dp x cp`` grid: ``rank = dp_rank * cp + cp_rank``. Every data
parallel (DP) group owns whole requests; the ``cp`` ranks of one DP group share
its requests and split long prefills between them (context parallel). MoE
expert parallel (EP) groups are blocks of ``ep`` consecutive ranks
(``ep_rank = rank % ep``); each EP group holds every expert once, sharded.

The launcher's environment says who we are: ``torchrun`` sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; a Slurm job step
started by the submitit launcher is translated into the same variables (see
:func:`export_slurm_env`). Without either, the world is this one process.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional

from redknot.config.schema import ParallelConfig

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """What the launcher told this process."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "LaunchEnv":
        env = os.environ if env is None else env
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world} (set by the launcher)")
        return cls(rank, world, local, local_world)


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates in the DP x CP grid and its EP group."""
    dp: int
    cp: int
    ep: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def create(cls, parallel: ParallelConfig, env: LaunchEnv) -> "ParallelLayout":
        return cls(parallel.dp, parallel.cp, parallel.ep, env.rank, env.world_size, env.local_rank,
                   env.local_world_size)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    @property
    def is_front(self) -> bool:
        """Rank 0 takes the requests and hands back every output."""
        return self.rank == 0

    @property
    def is_dp_leader(self) -> bool:
        """The first rank of a DP group reports its group's outputs."""
        return self.cp_rank == 0

    @property
    def is_single(self) -> bool:
        return self.world_size == 1 and self.dp == self.cp == self.ep == 1

    def cp_group_ranks(self, dp_rank: int) -> List[int]:
        return [dp_rank * self.cp + c for c in range(self.cp)]

    def ep_group_ranks(self, group: int) -> List[int]:
        return list(range(group * self.ep, (group + 1) * self.ep))

    @property
    def num_ep_groups(self) -> int:
        return self.world_size // self.ep

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}): "
                f"dp {self.dp_rank}/{self.dp}, cp {self.cp_rank}/{self.cp}, ep {self.ep_rank}/{self.ep}")

    def as_params(self) -> Dict[str, str]:
        """The layout as MLflow params/tags (``parallel.*``)."""
        return {"parallel.world_size": str(self.world_size), "parallel.dp": str(self.dp),
                "parallel.cp": str(self.cp), "parallel.ep": str(self.ep),
                "parallel.nodes": str(max(1, self.world_size // max(1, self.local_world_size)))}


def export_slurm_env(env: Optional[Mapping[str, str]] = None) -> bool:
    """Inside a multi-task Slurm job step without torchrun variables (the submitit launcher with
    ``tasks_per_node > 1``), export RANK/WORLD_SIZE/MASTER_* from Slurm's variables through
    submitit. Returns whether it did."""
    env = os.environ if env is None else env
    if "RANK" in env or int(env.get("SLURM_NTASKS", "1")) <= 1 or "SLURM_JOB_ID" not in env:
        return False
    from submitit.helpers import TorchDistributedEnvironment

    # submitit sets this in the jobs it submits; a plain `srun` task is a Slurm job all the same.
    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True


def needs_parallel(parallel: ParallelConfig, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether an engine with this config runs as one rank of a multi-process layout: a parallel
    size above 1, or a launcher that started more than one process."""
    env = os.environ if env is None else env
    launched = max(int(env.get("WORLD_SIZE", "1")), int(env.get("SLURM_NTASKS", "1")) if "SLURM_JOB_ID" in env else 1)
    return parallel.dp * parallel.cp * parallel.ep > 1 or launched > 1
