"""Pure parts of the parallel layer: ranks from the launcher's environment, the DP x CP grid and EP
groups, engine-start checks with clear messages, the zigzag split, the DP router, stats merging."""
import pytest

from redknot.config.schema import Accelerator, FeaturesConfig, HardwareConfig, ParallelConfig
from redknot.config.violations import ConfigError
from redknot.engine.outputs import EngineStats
from redknot.parallel.cp import plan_pieces, zigzag_chunks
from redknot.parallel.dp import DPRouter, merge_stats
from redknot.parallel.groups import bind_device, check_world
from redknot.parallel.layout import LaunchEnv, ParallelLayout, needs_parallel


def env(rank, world, local=None, local_world=None):
    return LaunchEnv(rank, world, rank if local is None else local, world if local_world is None else local_world)


def test_launch_env_from_torchrun_variables():
    got = LaunchEnv.from_env({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8"})
    assert got == LaunchEnv(5, 16, 5, 8)
    assert LaunchEnv.from_env({}) == LaunchEnv(0, 1, 0, 1)
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        LaunchEnv.from_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_grid_coordinates_and_groups():
    layout = ParallelLayout.create(ParallelConfig(dp=4, ep=4, cp=2), env(5, 8, 5, 8))
    assert (layout.dp_rank, layout.cp_rank, layout.ep_rank) == (2, 1, 1)
    assert layout.cp_group_ranks(2) == [4, 5]
    assert layout.ep_group_ranks(1) == [4, 5, 6, 7] and layout.num_ep_groups == 2
    assert not layout.is_front and not layout.is_dp_leader
    assert layout.as_params()["parallel.world_size"] == "8"


def test_needs_parallel():
    assert not needs_parallel(ParallelConfig(), {})
    assert needs_parallel(ParallelConfig(dp=2), {})
    assert needs_parallel(ParallelConfig(), {"WORLD_SIZE": "2"})
    assert needs_parallel(ParallelConfig(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"})
    assert not needs_parallel(ParallelConfig(), {"SLURM_NTASKS": "8"})  # not inside a Slurm job


def test_world_must_fit_the_layout():
    with pytest.raises(ConfigError) as err:
        check_world(ParallelConfig(dp=2, cp=2), env(0, 1))
    text = str(err.value)
    assert "features.parallel.dp" in text and "must equal the world size (1 processes launched)" in text
    assert "torchrun --nproc-per-node 4 -m redknot" in text
    with pytest.raises(ConfigError, match="features.parallel.ep=3: must divide the world size"):
        check_world(ParallelConfig(dp=4, ep=3), env(0, 4))
    check_world(ParallelConfig(dp=2, cp=2, ep=4), env(3, 4))


def test_one_device_per_local_rank():
    hw = HardwareConfig(name="sm90-port", accelerator=Accelerator.cuda)
    import torch

    found = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=rf"runs {found + 1} ranks \(LOCAL_WORLD_SIZE\) but torch sees {found}"):
        bind_device(hw, env(0, found + 1))
    assert bind_device(HardwareConfig(), env(1, 2)).type == "cpu"


def test_engine_start_checks_features(monkeypatch):
    from redknot.parallel.runtime import _check_features

    features = FeaturesConfig()
    features.parallel.eplb.enabled = True
    with pytest.raises(ValueError, match="features.parallel.eplb.enabled=true: .* needs features.parallel.ep > 1"):
        _check_features(features)
    features = FeaturesConfig()
    features.parallel.cp = 2
    features.swa_replay.mode = "compact"
    with pytest.raises(ValueError, match="features.swa_replay.mode=compact: not supported with context parallel"):
        _check_features(features)


@pytest.mark.parametrize("n,cp", [(64, 2), (67, 2), (1000, 4), (131072, 8)])
def test_zigzag_chunks_balance_causal_work(n, cp):
    chunks = zigzag_chunks(n, cp)
    assert sum(length for _, length, _ in chunks) == n
    assert [off for off, _, _ in chunks] == sorted(off for off, _, _ in chunks)
    for r in range(cp):
        assert [i for i, (_, _, rank) in enumerate(chunks) if rank == r] == [r, 2 * cp - 1 - r]

    def work(owner):  # causal attention cost ~ sum of (position + 1) over a rank's queries
        out = [0] * cp
        for off, length, rank in owner:
            out[rank] += sum(range(off + 1, off + length + 1))
        return out

    zig = work(chunks)
    step = -(-n // cp)
    contiguous = work([(r * step, min(step, n - r * step), r) for r in range(cp)])
    assert max(zig) / min(zig) < 1.01 + 8 * cp / n
    assert max(zig) / min(zig) < max(contiguous) / min(contiguous)


def test_plan_pieces_partition_the_step():
    counts, ctx = [70, 1, 40, 3, 31], [0, 57, 100, 9, 0]
    pieces = plan_pieces(counts, ctx, cp=2, min_chunk=8)
    rows = sorted(r for p in pieces for r in range(p.start_row, p.start_row + p.length))
    assert rows == list(range(sum(counts)))  # every row exactly once
    split = {p.seq for p in pieces if p.length < counts[p.seq]}
    assert split == {0, 2}  # 70 and 40 >= 2*cp*8; 31 is not
    for p in pieces:
        starts = sum(counts[:p.seq])
        assert p.position == ctx[p.seq] + (p.start_row - starts)  # absolute position of the first row
    whole = [p for p in pieces if p.seq in (1, 3, 4)]
    assert len({p.rank for p in whole}) == 2  # short sequences go to the rank with fewer rows


def test_router_least_active_lowest_rank():
    router = DPRouter(3)
    assert [router.assign(f"r{i}") for i in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="already in the engine"):
        router.assign("r1")
    router.finished("r1")
    assert router.assign("r4") == 1
    assert router.peak_active == [2, 1, 1] and router.num_active == 4
    assert router.owner_history["r1"] == 1 and "r1" not in router.owner


def test_merge_stats_sums_counters():
    a = EngineStats(num_steps=5, num_prefill_tokens=10, num_requests_finished=2, peak_memory_bytes=7)
    b = EngineStats(num_steps=4, num_prefill_tokens=3, num_requests_finished=1, peak_memory_bytes=9)
    m = merge_stats([a, b])
    assert (m.num_steps, m.num_prefill_tokens, m.num_requests_finished, m.peak_memory_bytes) == (5, 13, 3, 9)
