"""Test tiers: tests/unit (CPU, default), tests/kernels (marker gpu), tests/e2e (marker slow)."""
import os

import pytest
import torch

# Triton picks its CPU interpreter when a kernel is decorated, i.e. at the first import of a kernel
# module. Decide once, before any test module imports one: without CUDA, kernels run interpreted.
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the default run: addopts) each worker is one process of several: share the cores out
# instead of giving every worker the whole machine's intra-op threads.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def one_torch_thread():
    """One intra-op thread for the rest of the session: the unit tests run tiny GEMMs, for which thread
    hand-offs cost more than they save (and collapse on an oversubscribed CI machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def seeded_model_cache(tmp_path_factory):
    """One engine cache folder for the session's tests that only build a model from its seeded synthetic
    checkpoint: checkpoints are keyed by architecture and seed (and the Engram token map by the tokenizer's
    digest), so each is written once here instead of once per test module. Tests about the cache's own
    contents keep a folder of their own."""
    return str(tmp_path_factory.mktemp("seeded-model-cache"))
