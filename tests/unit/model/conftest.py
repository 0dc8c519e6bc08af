"""The model tests run many small ops; one intra-op thread avoids thread hand-off costs that
dominate at these sizes (and collapse under a loaded CI machine)."""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_torch_thread):
    yield
