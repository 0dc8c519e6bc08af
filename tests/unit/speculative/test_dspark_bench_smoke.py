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
                    "--block-attention", "causal", "--budget-s", "100000", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=600)
    report = json.loads((tmp_path / "dspark_bench.json").read_text())
    v4, v41 = report["v4"], report["v41"]
    assert v4["block_attention"] == v41["block_attention"] == "causal"
    # V4-0731's tensor-only step takes per-request query lengths now (varlen_step): its verify graphs are
    # off on a CPU only because nothing captures there (the V4.1 cut runs the host stand-in)
    assert v4["varlen_verify_graphs"].startswith("off: no graph capture on this device")
    graphs = v41["verify_graphs"]
    assert all(s.startswith("on:") for s in graphs["status"].values()), graphs["status"]
    assert graphs["verdict"] == "no mismatch"
    tiers = {str(t) for per_batch in graphs["tiers"].values() for t in per_batch}
    assert set(graphs["first_replay_vs_eager"]) == tiers == set(graphs["first_replay_errors"])
    assert all(c.startswith("ok") for c in graphs["first_replay_vs_eager"].values())
    for b in (1, 3):
        row = v41[f"batch_{b}"]
        assert row["draft"]["ms"] > 0
        assert all(row[f"verify_graph_q{q}"]["ms"] > 0 and row[f"verify_eager_q{q}"]["ms"] > 0 for q in range(1, 7))
        block = v41[f"draft_block_b{b}"]
        assert block["first_replay"]["check"].startswith("ok") and block["first_replay"]["errors"]["capture_logits"] == 0
        assert block["graph_ms"] > 0 and block["draft_step_graph_ms"] > 0
        assert v41[f"verify_math_and_schedule_b{b}"]["schedule_ms"] > 0
    assert "prefill chunk 0..40" in v41["phases_s"]


@pytest.mark.slow
def test_dspark_benchmark_v41_skips_cases_past_its_budget(tmp_path):
    """A budget spent by the build: every case is skipped with its reason, and the report is still written."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dspark.py"), "--smoke", "--model", "v41",
                    "--budget-s", "0", "--out", str(tmp_path)], check=True, cwd=ROOT, timeout=600)
    v41 = json.loads((tmp_path / "dspark_bench.json").read_text())
    assert v41["batch_1"]["all"].startswith("skipped: at ") and "--budget-s 0" in v41["batch_1"]["all"]
    assert v41["draft_block_b3"].startswith("skipped") and v41["padding_probe"].startswith("skipped")
    assert v41["verify_graphs"]["first_replay_vs_eager"] == {}
