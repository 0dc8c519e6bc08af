"""``benchmarks/dspark.py --smoke --model both`` runs on a CPU: the V4-0731 cut times drafting and eager
verify steps, the V4.1 cut captures its verify tiers (host stand-in of graph capture), checks the first
replay of each against the eager step and the unpadded tensor step, and times both."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_dspark_benchmark_smoke_both_models(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dspark.py"), "--smoke", "--model", "both",
                    "--block-attention", "causal", "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=600)
    report = json.loads((tmp_path / "dspark_bench.json").read_text())
    v4, v41 = report["v4"], report["v41"]
    assert v4["block_attention"] == v41["block_attention"] == "causal"
    assert v4["varlen_verify_graphs"].startswith("off: the model's tensor-only forward handles one token")
    graphs = v41["verify_graphs"]
    assert graphs["status"].startswith("on:"), graphs["status"]
    assert set(graphs["first_replay_vs_eager"]) == {str(t) for t in graphs["tiers"]}
    assert all(c.startswith("ok") for c in graphs["first_replay_vs_eager"].values())
    for b in (1, 3):
        row = v41[f"batch_{b}"]
        assert row["draft_ms"] > 0
        assert all(row[f"verify_graph_ms_q{q}"] > 0 and row[f"verify_eager_ms_q{q}"] > 0 for q in range(1, 7))
