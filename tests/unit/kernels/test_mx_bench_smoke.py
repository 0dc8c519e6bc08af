"""``benchmarks/kernels_v41.py --smoke`` runs end to end on the CPU (Triton interpreter, toy sizes):
every check passes, every timed case runs, and the table is written as markdown and JSON."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def test_kernels_v41_smoke(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernels_v41.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "kernels_v41.json").read_text())
    assert result["smoke"] and result["checks"] and all(c["ok"] for c in result["checks"])
    ops = {r["op"] for r in result["rows"]}
    assert {"linear_mx", "moe_mx", "act_quant_mx", "cache_insert_mx", "sparse_attention_mx", "engram_gather_mx",
            "indexer topk", "indexer candidates", "indexer topk in candidates"} <= ops
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in result["rows"])
    table = (tmp_path / "kernels_v41.md").read_text()
    assert "| moe_mx |" in table and "% of floor" in table
