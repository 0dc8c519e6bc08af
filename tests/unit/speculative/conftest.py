"""DSpark / compact replay tests: small synthetic V4 models written once per session under tmp,
engines cached per configuration, no cache leaks after any test."""
import pytest
from spec_testutil import EngineFactory


@pytest.fixture(autouse=True, scope="session")
def _one_thread(one_torch_thread):
    yield


@pytest.fixture(scope="session")
def _factory(tmp_path_factory):
    f = EngineFactory(str(tmp_path_factory.mktemp("spec-model-cache")))
    yield f
    f.close()


@pytest.fixture
def engines(_factory):
    """``engines(**config)`` -> LLM; after the test every engine must be idle with no cache held."""
    yield _factory
    _factory.check_idle()
