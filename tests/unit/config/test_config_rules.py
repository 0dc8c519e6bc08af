"""Each cross-field rule: the boundary that passes and the value that fails."""
import pytest

from redknot.config.schema import ParallelConfig
from redknot.config.validate import ConfigError, check_parallel_layout, require_parallel_layout


def violations(resolved, *overrides):
    try:
        resolved(*overrides)
    except ConfigError as err:
        return [str(v) for v in err.violations]
    return []


def test_default_config_is_valid(resolved):
    ctx = resolved()
    assert ctx.cfg.model.name == "tiny" and ctx.cfg.suite.name == "smoke" and ctx.cfg.hardware.name == "cpu"


@pytest.mark.parametrize("keep, max_draft, ok", [(134, 5, True), (133, 5, False), (140, 12, False),
                                                 (141, 12, True), (129, 0, True), (128, 0, False)])
def test_keep_tokens_covers_window_plus_draft(resolved, keep, max_draft, ok):
    found = violations(resolved, "features.swa_replay.mode=compact", f"features.swa_replay.keep_tokens={keep}",
                       f"features.dspark.max_draft={max_draft}")
    assert (found == []) == ok, found
    if not ok:
        assert found[0].startswith(f"features.swa_replay.keep_tokens={keep}: must be >= model.sliding_window "
                                   f"(128) + features.dspark.max_draft ({max_draft}) + 1 = {129 + max_draft}")


def test_keep_tokens_unchecked_when_replay_is_off(resolved):
    assert violations(resolved, "features.swa_replay.keep_tokens=10") == []


def test_keep_tokens_without_drafting_needs_window_plus_one(resolved):
    found = violations(resolved, "features.swa_replay.mode=compact", "features.swa_replay.keep_tokens=128",
                       "features.dspark.enabled=false")
    assert found == ["features.swa_replay.keep_tokens=128: must be >= model.sliding_window (128) + "
                     "features.dspark.max_draft (0: features.dspark.enabled=false) + 1 = 129 when "
                     "features.swa_replay.mode=compact"]


def test_deterministic_needs_batch_invariance_and_fixed_verify_length(resolved):
    found = violations(resolved, "features.deterministic=true")
    assert len(found) == 2
    assert found[0].startswith("features.batch_invariant.enabled=false: features.deterministic=true needs")
    assert found[1].startswith("features.dspark.varlen=true: features.deterministic=true needs")
    assert violations(resolved, "features=deterministic") == []


def test_batch_invariant_refused_on_ascend(resolved):
    assert violations(resolved, "hardware=ascend950") == []
    found = violations(resolved, "hardware=ascend950", "features.batch_invariant.enabled=true")
    assert len(found) == 1 and "hardware=ascend950 has no batch-invariant kernels" in found[0]


def test_suite_plus_generation_must_fit_model_positions(resolved):
    # 64k: 65536 prompt tokens + narrativeqa's 128 new tokens = 65664
    assert violations(resolved, "suite=64k", "model.max_position=65664") == []
    found = violations(resolved, "suite=64k", "model.max_position=65663")
    assert found == ["suite.context_tokens=65536: suite.context_tokens (65536) + the largest max_new_tokens (128) "
                     "= 65664 must be <= model.max_position (65663) of model=tiny"]


def test_real_model_needs_a_path_to_run_but_not_to_prepare(resolved):
    found = violations(resolved, "model=deepseek-v4.1-flash")
    assert len(found) == 1 and found[0].startswith("model.path=null: model=deepseek-v4.1-flash has no synthetic")
    assert violations(resolved, "model=deepseek-v4.1-flash", "mode=prepare") == []
    assert violations(resolved, "model=deepseek-v4.1-flash", "model.path=/ckpt") == []


def test_generate_needs_a_prompt(resolved):
    assert violations(resolved, "mode=generate") == ['prompt=null: mode=generate needs prompt="..."']
    assert violations(resolved, "mode=generate", "prompt=hello") == []


def test_kernel_backend_must_exist_and_match_the_accelerator(resolved):
    found = violations(resolved, "hardware.kernels.default=flash_mla", "+hardware.kernels.ops.rms_norm=cutlass")
    assert found[0] == ("hardware.kernels.default=flash_mla: backend 'flash_mla' runs on accelerator cuda, "
                        "not on hardware.accelerator=cpu")
    assert found[1].startswith("hardware.kernels.ops.rms_norm=cutlass: unknown kernel backend; known: [")


def test_cuda_graphs_need_cuda(resolved):
    assert violations(resolved, "hardware.cuda_graphs=true") == [
        "hardware.cuda_graphs=true: needs hardware.accelerator=cuda (is cpu)"]


def test_max_new_tokens_entries_must_name_suite_datasets(resolved):
    found = violations(resolved, "+suite.max_new_tokens.hotpot_qa=64")
    assert len(found) == 1 and "has entries ['hotpot_qa'] for datasets not in suite.datasets" in found[0]


def test_duplicate_dataset(resolved):
    datasets = "[niah_single,niah_multikey,variable_tracking,hotpotqa,triviaqa,hotpotqa]"
    found = violations(resolved, f"suite.datasets={datasets}")
    assert len(found) == 1 and found[0].endswith(": lists ['hotpotqa'] more than once")


def test_targets_must_stay_inside_redknot(resolved):
    found = violations(resolved, "engine._target_=subprocess.run")
    assert found == ["engine._target_=subprocess.run: targets must be inside the redknot package; known targets "
                     "for engine: ['redknot.engine.LLM']"]


def test_parallel_sizes_positive(resolved):
    found = violations(resolved, "features.parallel.ep=0", "features.parallel.cp=-2")
    assert found == ["features.parallel.ep=0: parallel sizes must be positive",
                     "features.parallel.cp=-2: parallel sizes must be positive"]


def test_synthetic_architecture_must_agree_with_model_fields(resolved):
    found = violations(resolved, "model.synthetic.architecture.sliding_window=64")
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
