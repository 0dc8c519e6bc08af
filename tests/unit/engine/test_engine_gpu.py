"""The engine on a CUDA device (skipped without one): device placement, cache sizing from free
memory, CUDA-graph decode (or its stated reason for staying eager) equal to eager decode, async."""
import random

import pytest
from llm_testutil import run_all

from redknot.config.schema import (Accelerator, DType, EngineConfig, FeaturesConfig, HardwareConfig,
                                   SchedulerConfig)
from redknot.engine import SamplingParams

pytestmark = pytest.mark.gpu


def _llm(model_cfg, cache_dir, cuda_graphs, async_scheduling=False, kernels="reference", dtype=DType.float32):
    from redknot.config.schema import KernelsConfig
    from redknot.engine import LLM
    hw = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=dtype, kv_cache_dtype=dtype,
                        cuda_graphs=cuda_graphs, memory_utilization=0.5, cuda_graph_max_len=4096,
                        kernels=KernelsConfig(default=kernels))
    features = FeaturesConfig(async_scheduling=async_scheduling)
    features.dspark.method = "none"
    engine = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, block_size=16),
                          cache_dir=cache_dir)
    return LLM(model_cfg, hw, features, engine)


@pytest.mark.parametrize("kernels,dtype", [("reference", DType.float32), ("triton", DType.float32),
                                          ("triton", DType.bfloat16)])
def test_cuda_graph_decode_equals_eager(model_cfg, cache_dir, kernels, dtype):
    """Prompts up to 300 tokens and 140 new ones: decode crosses the 16-token window and closes
    CSA (4) and HCA (8) windows inside the captured steps."""
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 120000) for _ in range(rng.randrange(4, 300))] for i in range(5)}
    params = SamplingParams(max_tokens=140, ignore_eos=True)
    eager = _llm(model_cfg, cache_dir, cuda_graphs=False, kernels=kernels, dtype=dtype)
    assert eager.device.type == "cuda" and eager.runner.plan.num_blocks > 0
    ref, _ = run_all(eager, prompts, params)
    assert eager.stats().peak_memory_bytes > 0
    eager.close()
    graphs = _llm(model_cfg, cache_dir, cuda_graphs=True, kernels=kernels, dtype=dtype)
    got, _ = run_all(graphs, prompts, params)
    stats = graphs.stats()
    # Still "on" after the run: the first replay of every batch size agreed with eager execution.
    assert stats.cuda_graphs.startswith("on:"), stats.cuda_graphs
    assert stats.num_cuda_graph_steps > 100
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids
    graphs.close()


def test_async_on_off_identical_on_gpu(model_cfg, cache_dir):
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(3, 120000) for _ in range(rng.randrange(4, 40))] for i in range(6)}
    params = {rid: SamplingParams(max_tokens=rng.randrange(1, 10), temperature=rng.choice([0.0, 0.8]), seed=i)
              for i, rid in enumerate(prompts)}
    outs = []
    for flag in (False, True):
        llm = _llm(model_cfg, cache_dir, cuda_graphs=False, async_scheduling=flag)
        outs.append(run_all(llm, prompts, params)[0])
        llm.close()
    for rid in prompts:
        assert outs[0][rid].token_ids == outs[1][rid].token_ids
