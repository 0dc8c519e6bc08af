"""Each cross-field rule: the boundary that passes and the value that fails.

Most cases change the typed default config directly (composing once); the ones that
switch a config group go through Hydra (``resolved``)."""
import pytest

from config_testutil import typed_with
from redknot.config.schema import Accelerator, Mode, SwaReplayMode
from redknot.config.schema import ParallelConfig
from redknot.config.violations import ConfigError, check_parallel_layout, require_parallel_layout, validate

COMPACT = {"features.swa_replay.mode": SwaReplayMode.compact}


def violations(resolved, *overrides):
    try:
        resolved(*overrides)
    except ConfigError as err:
        return [str(v) for v in err.violations]
    return []


def check(**changes):
    """Violations of the default config with ``changes`` (keys with __ for dots)."""
    return [str(v) for v in validate(typed_with({k.replace("__", "."): v for k, v in changes.items()}))]


def test_default_config_is_valid(resolved):
    ctx = resolved()
    assert ctx.cfg.model.name == "tiny-v41" and ctx.cfg.suite.name == "smoke" and ctx.cfg.hardware.name == "cpu"
    assert ctx.cfg.model.family == "deepseek_v41"
    assert validate(ctx.cfg) == []
    assert validate(resolved("model=tiny").cfg) == []


@pytest.mark.parametrize("keep, max_draft, ok", [(134, 5, True), (133, 5, False), (131, 3, False),
                                                 (132, 3, True), (129, 0, True), (128, 0, False)])
def test_keep_tokens_covers_window_plus_draft(keep, max_draft, ok):
    found = check(features__swa_replay__mode=SwaReplayMode.compact, features__swa_replay__keep_tokens=keep,
                  features__dspark__max_draft=max_draft)
    assert (found == []) == ok, found
    if not ok:
        assert found == [f"features.swa_replay.keep_tokens={keep}: must be >= model.sliding_window (128) + "
                         f"features.dspark.max_draft ({max_draft}) + 1 = {129 + max_draft} when "
                         f"features.swa_replay.mode=compact"]


def test_keep_tokens_follows_the_model_window():
    window = {"model__synthetic__architecture": {}, "features__swa_replay__mode": SwaReplayMode.compact}
    assert check(model__sliding_window=64, features__swa_replay__keep_tokens=70, **window) == []
    assert check(model__sliding_window=256, **window) == [
        "features.swa_replay.keep_tokens=140: must be >= model.sliding_window (256) + features.dspark.max_draft (5) "
        "+ 1 = 262 when features.swa_replay.mode=compact"]


def test_keep_tokens_unchecked_when_replay_is_off():
    assert check(features__swa_replay__mode=SwaReplayMode.off, features__swa_replay__keep_tokens=10) == []


def test_keep_tokens_without_drafting_needs_window_plus_one():
    found = check(features__swa_replay__mode=SwaReplayMode.compact, features__swa_replay__keep_tokens=128,
                  features__dspark__method="none")
    assert found == ["features.swa_replay.keep_tokens=128: must be >= model.sliding_window (128) + "
                     "features.dspark.max_draft (0: features.dspark.method=none) + 1 = 129 when "
                     "features.swa_replay.mode=compact"]


def test_deterministic_needs_batch_invariance_and_fixed_verify_length(resolved):
    found = check(features__deterministic=True)
    assert len(found) == 2
    assert found[0].startswith("features.batch_invariant.enabled=false: features.deterministic=true needs")
    assert found[1].startswith("features.dspark.adaptive=true: features.deterministic=true needs")
    assert check(features__deterministic=True, features__batch_invariant__enabled=True,
                 features__dspark__method="none") == []
    assert violations(resolved, "features=deterministic") == []


def test_batch_invariant_refused_without_kernels():
    assert check(hardware__supports_batch_invariant=False) == []
    found = check(hardware__supports_batch_invariant=False, features__batch_invariant__enabled=True)
    assert found == ["features.batch_invariant.enabled=true: hardware=cpu has no batch-invariant kernels "
                     "(hardware.supports_batch_invariant=false); use hardware=cpu, sm90-port or sm100"]


def test_suite_plus_generation_must_fit_model_positions():
    # 2048 prompt tokens + the smoke suite's 32 new tokens = 2080
    assert check(model__max_position=2080) == []
    assert check(model__max_position=2079) == [
        "suite.context_tokens=2048: suite.context_tokens (2048) + the largest max_new_tokens (32) = 2080 must be "
        "<= model.max_position (2079) of model=tiny"]
    # a dataset without an entry uses default_max_new_tokens
    assert len(check(model__max_position=2100, suite__default_max_new_tokens=100,
                     suite__datasets=["hotpotqa", "musique"], suite__max_new_tokens={"hotpotqa": 32})) == 1
    # ... and with that null, the dataset's own LongBench length (narrativeqa: 128)
    assert check(model__max_position=2048 + 128, suite__datasets=["hotpotqa", "narrativeqa"]) == []
    assert len(check(model__max_position=2048 + 127, suite__datasets=["hotpotqa", "narrativeqa"])) == 1
    # presentation cases generate presentation_max_new_tokens
    assert len(check(model__max_position=2048 + 40, suite__presentation_cases=5,
                     suite__presentation_max_new_tokens=41)) == 1


def test_real_model_needs_a_path_to_run_but_not_to_prepare(resolved):
    found = violations(resolved, "model=deepseek-v4.1-flash")
    assert len(found) == 1 and found[0].startswith("model.path=null: model=deepseek-v4.1-flash has no synthetic")
    assert violations(resolved, "model=deepseek-v4.1-flash", "mode=prepare") == []
    assert violations(resolved, "model=deepseek-v4.1-flash", "model.path=/ckpt") == []


def test_generate_needs_a_prompt():
    assert check(mode=Mode.generate) == ['prompt=null: mode=generate needs prompt="..."']
    assert check(mode=Mode.generate, prompt="hello") == []


def test_model_family_must_be_registered():
    assert check(model__family="llama") == [
        "model.family=llama: must be a registered model family: ['deepseek_v4', 'deepseek_v41']"]


def test_kernel_backend_must_exist_and_match_the_accelerator():
    found = check(hardware__kernels__default="flash_mla", hardware__kernels__ops={"rms_norm": "cutlass"})
    assert found[0] == ("hardware.kernels.default=flash_mla: backend 'flash_mla' runs on accelerator cuda, "
                        "not on hardware.accelerator=cpu")
    assert found[1].startswith("hardware.kernels.ops.rms_norm=cutlass: unknown kernel backend; known: [")
    assert check(hardware__accelerator=Accelerator.cuda, hardware__kernels__default="flash_mla") == []


def test_cuda_only_hardware_facts():
    assert check(hardware__cuda_graphs=True) == ["hardware.cuda_graphs=true: needs hardware.accelerator=cuda (is cpu)"]
    assert check(hardware__accelerator=Accelerator.cuda, hardware__compute_capability=["sm90"]) == [
        'hardware.compute_capability=["sm90"]: entry \'sm90\' must look like \'9.0\' or \'10.\' (a major.minor prefix)']


def test_side_stream_tokens_are_a_count_on_cuda_only():
    assert check(hardware__side_stream_max_tokens=-1) == [
        "hardware.side_stream_max_tokens=-1: must be >= 0 (0 keeps one stream)"]
    assert check(hardware__side_stream_max_tokens=64) == [
        "hardware.side_stream_max_tokens=64: a side stream needs hardware.accelerator=cuda (is cpu); use 0"]
    assert check(hardware__accelerator=Accelerator.cuda, hardware__side_stream_max_tokens=64) == []
    assert check(hardware__side_stream_max_tokens=0) == []


def test_max_new_tokens_entries_must_name_datasets(resolved):
    found = violations(resolved, "+suite.max_new_tokens.hotpot_qa=64")
    assert len(found) == 1 and "has entries ['hotpot_qa'] that name no dataset" in found[0]


def test_dataset_list_is_one_override_and_lengths_come_from_the_registry(resolved):
    # An entry for a dataset the suite does not run is allowed: suite.datasets=[...] is one override.
    ctx = resolved("suite=64k", "suite.datasets=[multifieldqa_en,hotpotqa]", "+suite.max_new_tokens.narrativeqa=99",
                   "mode=prepare")
    from redknot.bench import registry

    suite = ctx.cfg.suite
    got = {d: registry.max_new_tokens(d, suite.max_new_tokens, suite.default_max_new_tokens) for d in suite.datasets}
    assert got == {"multifieldqa_en": 64, "hotpotqa": 32}  # LongBench's lengths
    assert violations(resolved, "suite.datasets=[hotpotqa,no_such_set]")[0].startswith(
        "suite.datasets=[\"hotpotqa\", \"no_such_set\"]: unknown datasets ['no_such_set']")


def test_block_size_must_be_a_multiple_of_the_compress_ratios(resolved):
    found = violations(resolved, "model=tiny", "engine.scheduler.block_size=257")
    assert found == ["engine.scheduler.block_size=257: must be a multiple of every compress ratio [4, 128] of "
                     "model=tiny (e.g. 256 or 384)"]
    assert violations(resolved, "model=tiny", "engine.scheduler.block_size=384") == []
    assert violations(resolved, "engine.scheduler.block_size=257") == [
        "engine.scheduler.block_size=257: must be a multiple of every compress ratio [1, 2] of "
        "model=tiny-v41 (e.g. 256 or 258)"]


def test_duplicate_and_empty_datasets():
    found = check(suite__datasets=["hotpotqa", "triviaqa", "hotpotqa"], suite__max_new_tokens={})
    assert found == ['suite.datasets=["hotpotqa", "triviaqa", "hotpotqa"]: lists [\'hotpotqa\'] more than once']
    assert check(suite__datasets=[], suite__max_new_tokens={}) == ["suite.datasets=[]: must name at least one dataset"]


def test_targets_must_stay_inside_redknot(resolved):
    found = violations(resolved, "engine._target_=subprocess.run")
    assert found == ["engine._target_=subprocess.run: targets must be inside the redknot package; known targets "
                     "for engine: ['redknot.engine.build_engine']"]


def test_parallel_sizes_positive():
    assert check(features__parallel__ep=0, features__parallel__cp=-2) == [
        "features.parallel.ep=0: parallel sizes must be positive",
        "features.parallel.cp=-2: parallel sizes must be positive"]


def test_scheduler_chunk_within_the_step_budget():
    assert check(engine__scheduler__long_prefill_chunk=8192) == [
        "engine.scheduler.long_prefill_chunk=8192: must be <= engine.scheduler.max_num_batched_tokens (4096)"]


def test_synthetic_architecture_must_agree_with_model_fields(resolved):
    found = violations(resolved, "model=tiny", "model.synthetic.architecture.sliding_window=64")
    assert found == ["model.sliding_window=128: must equal model.synthetic.architecture.sliding_window (64)"]


@pytest.mark.parametrize("dp, ep, cp, world, devices, expected", [
    (1, 1, 1, 1, None, []),
    (4, 4, 1, 4, 8, []),
    (2, 4, 2, 4, None, []),
    (2, 1, 1, 4, None, ["features.parallel.dp=2: features.parallel.dp (2) * features.parallel.cp (1) = 2 must "
                        "equal the world size (4 processes launched)"]),
    (4, 3, 1, 4, None, ["features.parallel.ep=3: must divide the world size (4) so expert-parallel groups cover "
                        "every rank"]),
    (8, 8, 1, 8, 4, ["features.parallel.dp=8: the layout needs 8 devices (one per rank) but 4 are visible"]),
    (0, 1, 1, 1, None, ["features.parallel.dp=0: parallel sizes must be positive"]),
])
def test_parallel_layout_against_the_world(dp, ep, cp, world, devices, expected):
    found = [str(v) for v in check_parallel_layout(ParallelConfig(dp=dp, ep=ep, cp=cp), world, devices)]
    assert found == expected


def test_require_parallel_layout_raises_with_all_problems():
    with pytest.raises(ConfigError) as err:
        require_parallel_layout(ParallelConfig(dp=3, ep=5), world_size=4)
    assert str(err.value).startswith("parallel layout does not fit the launched world (2 problems):")


def test_context_parallel_refuses_compact_replay_and_eplb_needs_expert_parallel():
    found = check(features__parallel__cp=2, features__swa_replay__mode=SwaReplayMode.compact,
                  features__parallel__eplb__enabled=True)
    assert found == [
        "features.swa_replay.mode=compact: not supported with features.parallel.cp=2; "
        "set features.swa_replay.mode=off",
        "features.parallel.eplb.enabled=true: expert load balancing needs experts spread over ranks: "
        "set features.parallel.ep > 1"]
    assert check(features__parallel__cp=2, features__swa_replay__mode=SwaReplayMode.off,
                 features__parallel__ep=2, features__parallel__eplb__enabled=True) == []
