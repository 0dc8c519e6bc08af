"""End to end on the GPU: the synthetic V4 model (every layer type) with the Triton backend in fp32
gives the same greedy tokens as the CPU reference path."""
import random

import pytest
import torch

from redknot.config.schema import (Accelerator, DType, EngineConfig, FeaturesConfig, HardwareConfig, KernelsConfig,
                                   ModelConfig, SchedulerConfig, SyntheticModelConfig)
from redknot.engine import SamplingParams

pytestmark = pytest.mark.gpu

# Window 16, HCA ratio 8, top-4 indexer: prompts of a few dozen tokens leave the window, close HCA
# windows and give the indexer more entries than its top-k. Dimensions are powers of two >= 16.
ARCH = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=16, index_topk=4,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
            compress_ratios=[0, 4, 8, 4, 0], compress_rate_hca=8, sliding_window=16,
            max_position_embeddings=4096)


def _llm(tmp_path, accelerator, kernels):
    from redknot.engine import LLM
    model = ModelConfig(name="kernel-e2e", max_position=1024, sliding_window=16,
                        synthetic=SyntheticModelConfig(seed=0, architecture=dict(ARCH)))
    hw = HardwareConfig(name=f"{accelerator.value}-{kernels}", accelerator=accelerator, dtype=DType.float32,
                        kv_cache_dtype=DType.float32, cuda_graphs=False, memory_utilization=0.3,
                        kernels=KernelsConfig(default=kernels))
    features = FeaturesConfig(async_scheduling=False)
    features.dspark.method = "none"
    engine = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, block_size=16),
                          cache_dir=str(tmp_path))
    return LLM(model, hw, features, engine)


def test_triton_greedy_tokens_equal_cpu_reference(tmp_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 120000) for _ in range(rng.randrange(20, 90))] for _ in range(5)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = {}
    for accel, kernels in ((Accelerator.cpu, "reference"), (Accelerator.cuda, "triton")):
        llm = _llm(tmp_path, accel, kernels)
        if accel == Accelerator.cuda:
            assert llm.kernels.choice["sparse_attention"] == "triton"
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
    assert outs["triton"] == outs["reference"]
    assert torch.cuda.is_available()
