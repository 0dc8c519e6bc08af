"""DeepSeek-V4.1 under expert parallel on 2 CPU processes (gloo, torchrun) against one process.

``v41_ep_main.py`` builds, on each rank, the unsharded model and the expert-parallel one (this
rank's routed experts, this rank's row slice of each Engram table) from the same seeded native
weights, in fp64 reference numerics; each rank runs its own sequence (prefill + decode), so
(token, expert) pairs and Engram rows cross ranks, and one step runs while the other rank is idle.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from redknot.models.deepseek_v41.parallel import HOST, REPLICATED, SHARDED, EngramLookup

HERE = Path(__file__).resolve().parent
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("v41_ep")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(HERE / "v41_ep_main.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_ep2_logits_equal_one_process(ranks):
    for rank, res in enumerate(ranks):
        assert len(res["ep"]) == len(res["single"]) == (7 if rank == 0 else 6)
        for step, (a, b) in enumerate(zip(res["ep"], res["single"])):
            # fp64: only the order of the k routed terms may differ from one process.
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"rank {rank} step {step}")


def test_ep2_bounded_replay_with_a_rank_without_tail_rows(ranks):
    a, b = ranks[0]["replay"]  # rank 0's tail rows; rank 1 had none and joined the exchanges idle
    torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_ep2_work_really_crossed_ranks(ranks):
    assert ranks[0]["local_experts"] == [0, 2] and ranks[1]["local_experts"] == [1, 3]
    for res in ranks:
        assert res["routed_pairs"] > 0
        assert res["rows_received"] > 0  # Engram rows fetched from the other rank's shard


def test_sharded_engram_lookup_equals_full_table(ranks):
    for res in ranks:
        assert res["lookup_equal"] and all(res["lookup_equal"])


@pytest.mark.parametrize("placement", [REPLICATED, HOST])
def test_single_process_placements_return_table_rows(placement):
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 256, (50, 64), dtype=torch.uint8, generator=gen)
    scale = torch.randint(100, 140, (50, 2), dtype=torch.uint8, generator=gen)
    lookup = EngramLookup(placement, {"layers.0.engram": (table, scale, 0, 50)})
    ids = torch.randint(0, 50, (33,), generator=gen)
    q, s = lookup("layers.0.engram", ids)
    assert torch.equal(q, table[ids]) and torch.equal(s, scale[ids])


def test_bad_placement_and_missing_group_are_named():
    with pytest.raises(ValueError, match="engram_placement='spread'"):
        EngramLookup("spread", {})
    with pytest.raises(ValueError, match="EP process group"):
        EngramLookup(SHARDED, {}, None, 0, 2)


def _predictions(out) -> dict:
    import json

    (records_file,) = list(out.glob("*/*/records.jsonl"))  # one run directory holds records
    records = [json.loads(line) for line in records_file.read_text().splitlines()]
    assert len(records) == 3 and {r["status"] for r in records} == {"ok"}
    return {r["case_id"]: (r["prediction_raw"], r.get("dp_rank")) for r in records}


@pytest.fixture(scope="module")
def one_process_smoke(tmp_path_factory):
    """The same cut smoke suite on tiny-v41 in one process: case -> greedy prediction."""
    from .test_launch import SUITE

    tmp = tmp_path_factory.mktemp("v41_one")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run([sys.executable, "-m", "redknot", f"output.root={tmp / 'outputs'}", "model=tiny-v41",
                          "tracking.enabled=false", *SUITE], cwd=tmp, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {case: pred for case, (pred, _) in _predictions(tmp / "outputs").items()}


@pytest.mark.parametrize("placement", [SHARDED, pytest.param(HOST, marks=pytest.mark.slow)])
def test_torchrun_smoke_suite_tiny_v41_dp2_ep2(tmp_path, one_process_smoke, placement):
    """``python -m redknot model=tiny-v41`` on 2 processes (dp=2, ep=2): the cut smoke suite completes
    with the one-process greedy predictions, both ranks route tokens, each rank read only its experts
    (and, sharded, its half of each Engram table), one MLflow run records the layout."""
    import re

    import mlflow

    from .test_launch import SUITE, torchrun

    out = tmp_path / "outputs"
    run = torchrun(tmp_path, f"output.root={out}", "model=tiny-v41", "features.parallel.dp=2",
                   "features.parallel.ep=2", f"features.parallel.engram_placement={placement}", *SUITE)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert re.search(r"suite smoke~[0-9a-f]{6}: 3/3 cases", run.stdout)
    rows = r" \(rows held per layer" if placement == SHARDED else "$"
    for rank in (0, 1):
        assert re.search(rf"EP rank {rank} of 2, routed experts \[{rank}, {rank + 2}\] of layer 0, Engram tables "
                         rf"{placement}{rows}", run.stdout, re.M), run.stdout[-3000:]
    preds = _predictions(out)
    assert {dp for _, dp in preds.values()} == {0, 1}
    assert {case: pred for case, (pred, _) in preds.items()} == one_process_smoke
    client = mlflow.tracking.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    tags, metrics = mlrun.data.tags, mlrun.data.metrics
    assert (tags["parallel.dp"], tags["parallel.ep"], tags["parallel.ep_comm"]) == ("2", "2", "all_to_all")
    for rank in (0, 1):
        assert metrics[f"rank{rank}.ep.routed_pairs"] > 0
    assert metrics["rank0.ep.forwards"] == metrics["rank1.ep.forwards"] > 0


def test_eplb_is_refused_for_v41_experts():
    from types import SimpleNamespace

    from redknot.models.deepseek_v41.parallel import V41Experts, V41MoELayer
    from redknot.models.deepseek_v41.ref_math import Numerics, Weights
    from redknot.parallel.ep import EplbSettings, ExpertParallel

    model = SimpleNamespace(cfg=SimpleNamespace(n_routed_experts=4, n_activated_experts=2))
    layer = V41MoELayer(V41Experts(Weights({}, torch.float32), "layers.0.ffn", Numerics("bf16", torch.float32),
                                   10.0, [0, 2]))
    with pytest.raises(ValueError, match="features.parallel.eplb.enabled=true.*eplb.enabled=false"):
        ExpertParallel(model, [layer], None, 0, 2, EplbSettings(True, 0, 10), torch.device("cpu"))
