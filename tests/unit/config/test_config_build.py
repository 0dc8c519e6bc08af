"""build(): redknot.* targets only; typed sections passed whole; clear errors."""
import pytest

from redknot.config.hardware_fit import DeviceFacts, check_device, fitting_options, load_hardware_options
from redknot.config.instantiate import BuildError, build
from redknot.config.schema import Accelerator, KernelsConfig, TrackingConfig
from redknot.kernels import KernelSet


def test_kernel_set_from_the_hardware_section():
    kernels = build(KernelsConfig(default="reference", ops={}), "hardware.kernels")
    assert isinstance(kernels, KernelSet) and kernels.default == "reference"


def test_fields_become_keyword_arguments_for_targets_without_a_section_parameter():
    from redknot.tracking import NullTracker

    tracker = build(TrackingConfig(_target_="redknot.tracking.NullTracker"), "tracking", uri="sqlite:///x.db")
    assert isinstance(tracker, NullTracker)


def test_section_is_passed_whole_and_objects_stay_objects(monkeypatch):
    # A redknot target taking the section by name gets the typed dataclass itself, and
    # keyword objects are not turned into DictConfig.
    import redknot.config.violations as violations_module
    from redknot.config.schema import ParallelConfig

    seen = {}

    def layout(parallel, world_size, marker):
        seen.update(parallel=parallel, marker=marker)
        return violations_module.check_parallel_layout(parallel, world_size)

    monkeypatch.setattr(violations_module, "layout_for_test", layout, raising=False)
    section = ParallelConfig(dp=2)
    section._target_ = "redknot.config.violations.layout_for_test"
    marker = object()
    assert build(section, "features.parallel", world_size=2, marker=marker) == []
    assert seen["parallel"] is section and seen["marker"] is marker


def test_targets_outside_redknot_are_refused_with_the_allowed_ones():
    with pytest.raises(BuildError) as err:
        build(KernelsConfig(_target_="os.system"), "hardware.kernels")
    assert str(err.value) == ("hardware.kernels._target_=os.system: only targets inside the redknot package are "
                              "built; allowed targets for hardware.kernels: ['redknot.kernels.KernelSet']")


def test_missing_redknot_target_names_key_and_allowed_targets():
    with pytest.raises(BuildError) as err:
        build({"_target_": "redknot.engine.NoSuchEngine"}, "engine")
    message = str(err.value)
    assert message.startswith("engine._target_=redknot.engine.NoSuchEngine cannot be imported")
    assert message.endswith("allowed targets for engine: ['redknot.engine.build_engine']")


H200 = DeviceFacts(Accelerator.cuda, 8, "NVIDIA H200", "9.0", "570.86")
B200 = DeviceFacts(Accelerator.cuda, 8, "NVIDIA B200", "10.0")
CPU = DeviceFacts(Accelerator.cpu, 0, "AMD EPYC")


def test_options_that_fit_each_device():
    options = load_hardware_options()
    assert fitting_options(H200, options) == ["sm90-port", "cpu"]
    assert fitting_options(B200, options) == ["sm100", "cpu"]
    assert fitting_options(CPU, options) == ["cpu"]


def test_engine_start_check_names_the_device_found_and_the_option_that_fits():
    options = load_hardware_options()
    assert check_device(options["sm100"], B200) is B200
    with pytest.raises(RuntimeError) as err:
        check_device(options["sm100"], H200)
    assert str(err.value) == ("hardware=sm100 needs accelerator cuda with compute capability 10., but this machine "
                              "has 8 x NVIDIA H200 (compute capability 9.0); options that fit: hardware=sm90-port, "
                              "hardware=cpu")
    with pytest.raises(RuntimeError) as err:
        check_device(options["ascend950"], CPU)
    assert "but this machine has no accelerator (CPU: AMD EPYC); options that fit: hardware=cpu" in str(err.value)


def test_every_op_a_hardware_target_names_is_a_registered_op():
    from redknot.kernels import registered_ops

    known = set(registered_ops())
    for name, hardware in load_hardware_options().items():
        assert set(hardware.kernels.ops) <= known, (name, sorted(set(hardware.kernels.ops) - known))


def test_drafting_off_records_the_effective_draft_length(resolved):
    ctx = resolved("features.dspark.method=none")
    assert ctx.cfg.features.dspark.max_draft == 5  # the config keeps what it says ...
    assert ctx.effective["features.dspark.max_draft"].startswith("0 (features.dspark.method=none")
    assert resolved().effective == {}


def test_an_overridden_suite_gets_a_derived_name_and_records_the_difference(resolved):
    ctx = resolved("suite.context_tokens=1024", "suite.datasets=[niah_single]")
    assert ctx.cfg.suite.name.startswith("smoke~") and ctx.suite_changes == {
        "context_tokens": 1024, "datasets": ["niah_single"]}
    again = resolved("suite.datasets=[niah_single]", "suite.context_tokens=1024")
    assert again.cfg.suite.name == ctx.cfg.suite.name  # the same changes, the same name
    assert resolved("suite.request_timeout_s=5").cfg.suite.name == "smoke"  # not a change of what is measured
    assert resolved("suite=64k").cfg.suite.name == "64k" and resolved("suite=64k").suite_changes == {}
    assert resolved("suite.context_tokens=1024", "suite.name=short").cfg.suite.name == "short"


def test_compare_arms_are_composed_and_validated_together(resolved):
    ctx = resolved("+compare=swa_replay")
    assert list(ctx.arms) == ["replay_off", "replay_compact"]
    assert ctx.arms["replay_off"].features.swa_replay.mode.value == "off"
    assert ctx.arms["replay_compact"].features.swa_replay.mode.value == "compact"
    import pytest

    from redknot.config.violations import ConfigError

    with pytest.raises(ConfigError) as err:
        resolved("mode=compare", "compare.baseline=[\"features.swa_replay.keep_tokens=3\"]",
                 "compare.candidate=[\"features.dspark.max_draft=-1\"]")
    text = str(err.value)
    assert "compare.baseline=" in text and "keep_tokens=3: must be >=" in text
    assert "compare.candidate=" in text and "max_draft=-1: must be >= 0" in text
