import pytest

from config_testutil import resolve_overrides


@pytest.fixture
def resolved(tmp_path):
    """``resolved(*overrides, environ=None) -> RunContext`` for the real conf/, paths under tmp_path."""
    return lambda *overrides, environ=None: resolve_overrides(*overrides, tmp_path=tmp_path, environ=environ)
