"""Engine tests: a small synthetic V4 (every layer type, real tokenizer vocabulary) written once
per session under tmp, engines cached per configuration, no cache leaks after any test."""
import dataclasses

import pytest

from redknot.config.schema import (EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig, SchedulerConfig,
                                   SyntheticModelConfig)

# Window 16 and HCA ratio 8 so that prompts of a few dozen tokens leave the window, close HCA
# windows and give the indexer more entries than its top-k.
ARCH = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=8, index_head_dim=16, index_topk=4,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=1,
            compress_ratios=[0, 4, 8, 4, 0], compress_rate_hca=8, sliding_window=16,
            max_position_embeddings=4096)
MAX_LEN = 1024


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def model_cfg(tmp_path_factory):
    return ModelConfig(name="engine-test", max_position=MAX_LEN, sliding_window=16,
                       synthetic=SyntheticModelConfig(seed=0, architecture=dict(ARCH)))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("model-cache"))


class EngineFactory:
    """Builds LLMs for a configuration once and hands the same engine back afterwards."""

    def __init__(self, model_cfg, cache_dir):
        self.model_cfg, self.cache_dir = model_cfg, cache_dir
        self._engines = {}

    def __call__(self, *, async_scheduling=False, batch_invariant=False, deterministic=False,
                 max_num_seqs=32, budget=256, chunk=64, num_cache_blocks=None, block_size=16, max_model_len=MAX_LEN):
        key = (async_scheduling, batch_invariant, deterministic, max_num_seqs, budget, chunk, num_cache_blocks,
               block_size, max_model_len)
        if key not in self._engines:
            from redknot.engine import LLM
            features = FeaturesConfig(async_scheduling=async_scheduling, deterministic=deterministic)
            features.batch_invariant.enabled = batch_invariant
            features.dspark.method = "none"
            sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                    long_prefill_chunk=chunk, block_size=block_size,
                                    num_cache_blocks=num_cache_blocks)
            engine = EngineConfig(scheduler=sched, seed=0, cache_dir=self.cache_dir)
            model = dataclasses.replace(self.model_cfg, max_position=max_model_len)
            self._engines[key] = LLM(model, HardwareConfig(), features, engine)
        return self._engines[key]

    def check_idle(self):
        for llm in self._engines.values():
            assert not llm.has_unfinished_requests()
            llm.scheduler.check_invariants()
            llm.scheduler.cache.assert_empty()

    def close(self):
        for llm in self._engines.values():
            llm.close()


@pytest.fixture(scope="session")
def _factory(model_cfg, cache_dir):
    f = EngineFactory(model_cfg, cache_dir)
    yield f
    f.close()


@pytest.fixture
def engines(_factory):
    """``engines(**config)`` -> LLM; after the test every engine must be idle with no cache held."""
    yield _factory
    _factory.check_idle()


def replace_params(params, **kw):
    return dataclasses.replace(params, **kw)
