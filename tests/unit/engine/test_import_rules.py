"""House rules at run time: the pure-Python roles and the model-family seam never import torch.

Which package may import which is checked on the source by tests/unit/test_layering.py."""
import subprocess
import sys

import pytest


def _modules_after_import(stmt: str) -> set:
    code = f"import sys; {stmt}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", ["redknot.cache", "redknot.engine.scheduler", "redknot.sample.params",
                                    "redknot.engine.messages", "redknot.engine.request", "redknot.models.registry",
                                    "redknot.models.family", "redknot.models.deepseek_v4.family"])
def test_pure_python_roles_do_not_import_torch(module):
    assert "torch" not in _modules_after_import(f"import {module}")
