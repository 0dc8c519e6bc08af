"""The synthetic V4 model (every layer type) served with the Triton backend gives the reference path's
greedy tokens — on CPU through Triton's interpreter (minutes, hence ``slow``); tests/kernels has the GPU run."""
import random

import pytest

pytest.importorskip("triton")

from redknot.config.schema import (Accelerator, DType, EngineConfig, FeaturesConfig, HardwareConfig,  # noqa: E402
                                   KernelsConfig, ModelConfig, SchedulerConfig, SyntheticModelConfig)
from redknot.engine import LLM, SamplingParams  # noqa: E402

# Window 16, HCA ratio 8, top-4 indexer: prompts of a few dozen tokens leave the window, close HCA
# windows and give the indexer more entries than its top-k.
ARCH = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=16, index_topk=4,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
            compress_ratios=[0, 4, 8, 4, 0], compress_rate_hca=8, sliding_window=16,
            max_position_embeddings=4096)


def _llm(cache_dir, kernels):
    model = ModelConfig(name="kernel-e2e", max_position=1024, sliding_window=16,
                        synthetic=SyntheticModelConfig(seed=0, architecture=dict(ARCH)))
    hw = HardwareConfig(name=f"cpu-{kernels}", accelerator=Accelerator.cpu, dtype=DType.float32,
                        kv_cache_dtype=DType.float32, cuda_graphs=False, kernels=KernelsConfig(default=kernels))
    features = FeaturesConfig(async_scheduling=False)
    features.dspark.method = "none"
    engine = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96, block_size=16),
                          cache_dir=str(cache_dir))
    return LLM(model, hw, features, engine)


@pytest.mark.slow
def test_triton_backend_greedy_tokens_equal_reference(tmp_path, kernel_device):
    if kernel_device != "cpu":
        pytest.skip("tests/kernels/test_triton_e2e_gpu.py covers the GPU")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 120000) for _ in range(rng.randrange(20, 60))] for _ in range(3)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    outs = {}
    for kernels in ("reference", "triton"):
        llm = _llm(tmp_path, kernels)
        assert (llm.kernels.choice["sparse_attention"] == "triton") == (kernels == "triton")
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
        llm.close()
    assert outs["triton"] == outs["reference"]
