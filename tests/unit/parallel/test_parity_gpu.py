"""The parity scenarios on two CUDA devices (NCCL; reference and batch-invariant kernels, fp32) against
one device. Skipped without two GPUs."""
import pytest
import torch

from .conftest import make_spec, run_world, single_process
from .test_parity import check_scenario

pytestmark = pytest.mark.gpu

SCENARIOS = [
    dict(name="dp2_ep2_eplb", dp=2, ep=2, cp=1, batch_invariant=True, eplb=True, redundant=2, interval=2),
    dict(name="cp2_ep2", dp=1, ep=2, cp=2, batch_invariant=True),
    dict(name="dp2_ep2_reference_kernels", dp=2, ep=2, cp=1, batch_invariant=False),
]


@pytest.fixture(scope="module")
def gpu_reference(model_cache, tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    spec = make_spec(model_cache, [], str(tmp_path_factory.mktemp("gpu-ref")), cuda=True)
    return {invariant: single_process(spec, invariant) for invariant in (True, False)}


@pytest.fixture(scope="module")
def gpu_world(model_cache, gpu_reference, tmp_path_factory):
    return run_world(2, SCENARIOS, model_cache, tmp_path_factory.mktemp("gpu-world2"), cuda=True)


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_two_gpus_match_one(sc, gpu_world, gpu_reference):
    check_scenario(sc, gpu_world, gpu_reference)
