"""benchmarks/indexer_v41_prefill.py runs on a CPU (Triton interpreter, toy sizes): every variant of every
group selects what the group's first variant selects (the fused candidate-source pass against the two
passes it replaced, the candidate-list stream against the written scores)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_indexer_prefill_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, "-u", str(ROOT / "benchmarks" / "indexer_v41_prefill.py"), "--smoke",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "indexer_v41_prefill.json").read_text())["rows"]
    groups = {r["group"] for r in rows}
    assert len(groups) == 3 and all(r.get("same_as_first") for r in rows), rows
