"""House rules: scheduler and cache manager never import torch; the engine never imports bench, hydra or mlflow."""
import subprocess
import sys

import pytest


def _modules_after_import(stmt: str) -> set:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["redknot.cache", "redknot.engine.scheduler", "redknot.sample.params",
                                    "redknot.engine.messages", "redknot.engine.request"])
def test_pure_python_roles_do_not_import_torch(module):
    assert "torch" not in _modules_after_import(f"import {module}")
