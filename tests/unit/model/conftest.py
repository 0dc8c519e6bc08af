"""The model tests run many small ops; one intra-op thread avoids thread hand-off costs that
dominate at these sizes (and collapse under a loaded CI machine)."""
import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
