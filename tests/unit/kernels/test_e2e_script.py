"""benchmarks/e2e_cut.py runs end to end on a CPU (toy widths, the reference backend standing in for the
kernels, so it takes about a minute) and writes a complete, passing report."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_e2e_script_smoke_run_writes_its_tables(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_cut.py"), "--smoke", "--backend", "reference",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "e2e.json").read_text())
    assert not res["errors"] and not res["skipped"]
    checks = [p for p in res["parity"] if p["path"] == "check"]
    assert checks and all(p["ok"] for p in checks)
    assert [p["n"] for p in res["prefill"]] == [96, 200]
    assert {(d["n"], d["batch"]) for d in res["decode"]} == {(200, 1), (200, 2)}
    assert res["tiny"] and res["tiny"][0]["equal"]
    assert {"prefill", "decode"} <= {o["case"].split()[0] for o in res["ops"]}
    assert (tmp_path / "e2e.csv").read_text().count("\n") == 1 + 2 + 2


def test_e2e_script_profiles_each_prefill_chunk(tmp_path):
    """``--profile-prefill N``: the last chunk of every prefill context is run N more times under the profiler
    and its time by kernel (on a CPU: by host op) lands in the report, the same positions rewritten each time."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "e2e_cut.py"), "--smoke", "--backend", "reference",
                           "--skip", "tiny,parity,truth,decode", "--profile-prefill", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "e2e.json").read_text())
    assert not res["errors"]
    profiles = res["prefill_profile"]
    assert [(p["n"], p["chunk"]) for p in profiles] == [(96, 32), (200, 8)]
    for p in profiles:
        view = p["view"]
        assert view["steps"] == 2 and view["by_kernel"] and view["busy_ms_per_step"] > 0
    assert proc.stdout.count("## Prefill chunk profile: V4 cut, prefill chunk") == 2
