"""DSpark drafting on DeepSeek-V4.1 (model=tiny-v41, its synthetic checkpoint with one DSpark stage
in the native layout): greedy with DSpark equals greedy without, token for token and logits to
fp32 rounding, for one request, a mixed batch and chunked prefill; the rejected tokens of every
partly accepted block are rolled back (window rings, compressor carry-over, compressed entries,
Engram look-back are all addressed by position).

Random weights accept almost no draft, so after the drafter has run (its blocks are drafted and
scheduled) a hook replaces the drafts with the plain run's tokens, every third one wrong: most
blocks are then accepted in part and rolled back in part."""
from pathlib import Path

import pytest
import torch
from spec_testutil import features, oracle_hook, record_logits

from redknot.bench.typed import load_yaml_option
from redknot.config.schema import Accelerator, DType, EngineConfig, HardwareConfig, ModelConfig, SchedulerConfig
from redknot.engine import SamplingParams
from redknot.models.family import DSPARK

CONF = Path(__file__).resolve().parents[3] / "conf" / "model" / "tiny-v41.yaml"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
WINDOW = 16


@pytest.fixture(scope="module")
def v41(seeded_model_cache):
    from redknot.engine import LLM

    model = load_yaml_option(CONF, ModelConfig)
    model.max_position = 512
    cache = seeded_model_cache
    made = {}

    def make(dspark: bool, method: str = "auto", compact: bool = False, cuda: bool = False):
        key = (dspark, method, compact, cuda)
        if key not in made:
            hardware = HardwareConfig()
            if cuda:  # float32 on the GPU, so equalities hold to fp32 rounding as on the CPU
                hardware = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=DType.float32,
                                          kv_cache_dtype=DType.float32, cuda_graphs=False, memory_utilization=0.5)
            sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_chunk=32, block_size=16)
            eng = EngineConfig(scheduler=sched, seed=0, cache_dir=cache)
            feats = features(dspark=dspark, max_draft=2, keep_tokens=WINDOW + 2 + 1, method=method, compact=compact)
            made[key] = LLM(model, hardware, feats, eng)
        return made[key]
    yield make
    for llm in made.values():
        llm.close()


def _check(v41, prompts, compact: bool = False, cuda: bool = False):
    off, on = v41(False, compact=compact, cuda=cuda), v41(True, compact=compact, cuda=cuda)
    ref, ref_lg = record_logits(off, prompts, GREEDY)
    spec = on.runner.speculator
    spec.draft_hook = oracle_hook(prompts, ref)
    try:
        got, got_lg = record_logits(on, prompts, GREEDY)
    finally:
        spec.draft_hook = None
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids, rid
        n = len(ref[rid].token_ids)
        torch.testing.assert_close(got_lg[rid][:n], ref_lg[rid][:n], atol=2e-4, rtol=0)
    accepted = sum(o.metrics.num_draft_accepted for o in got.values())
    proposed = sum(o.metrics.num_draft_proposed for o in got.values())
    assert accepted > 0 and proposed > accepted, (accepted, proposed)  # accepted in part, rolled back in part
    on.scheduler.cache.assert_empty()


def test_v41_drafts_with_dspark_stages(v41):
    on = v41(True)
    spec = on.runner.speculator
    assert spec is not None, "features.dspark.method=auto must draft on a V4.1 checkpoint with mtp.* stages"
    draft = on.runner.family.draft_models(on.runner.model)[DSPARK]
    assert draft.block_size == 5 and draft.dcfg.target_layer_ids == (4, 5)
    assert on.runner.model.tap_hook is not None
    assert v41(True, "dspark").runner.speculator is not None


def test_single_request_equals_plain_greedy(v41):
    _check(v41, {"one": [(37 * i + 11) % 120000 + 3 for i in range(23)]})


def test_mixed_batch_equals_plain_greedy(v41):
    _check(v41, {f"m{k}": [(53 * i + 101 * k) % 120000 + 3 for i in range(n)] for k, n in enumerate((5, 19, 40))})


def test_chunked_prefill_equals_plain_greedy(v41):
    # 70 tokens with a 32-token chunk: three prefill chunks before the first draft.
    _check(v41, {"long": [(71 * i + 5) % 120000 + 3 for i in range(70)]})


def test_bounded_replay_drafts_from_computed_taps(v41):
    """features.swa_replay.mode=compact: the tapped layers above the last kv source run on the late
    rows of a long prefill only; the rings are written from those rows, which cover every position a
    block reads, so drafting works (finite drafts) and greedy equals greedy without DSpark."""
    on = v41(True, compact=True)
    draft = on.runner.family.draft_models(on.runner.model)[DSPARK]
    real = draft.forward_block
    finite = []

    def spy(*args):
        h, logits = real(*args)
        finite.append(bool(torch.isfinite(logits).all()) and bool(torch.isfinite(h).all()))
        return h, logits
    draft.forward_block = spy
    try:
        # alone: its first prefill chunk reaches no tapped layer at all (every row before replay_from)
        _check(v41, {"alone": [(71 * i + 5) % 120000 + 3 for i in range(70)]}, compact=True)
        _check(v41, {"long": [(61 * i + 5) % 120000 + 3 for i in range(70)],
                     "short": [(13 * i + 9) % 120000 + 3 for i in range(9)]}, compact=True)
    finally:
        del draft.forward_block
    assert finite and all(finite)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_mixed_batch_equals_plain_greedy(v41):
    """The same on a CUDA device (the draft's PyTorch path beside the backbone's kernel ops)."""
    assert v41(True, cuda=True).runner.model.device.type == "cuda"
    _check(v41, {f"g{k}": [(29 * i + 7 * k) % 120000 + 3 for i in range(n)] for k, n in enumerate((6, 33, 70))},
           cuda=True)
