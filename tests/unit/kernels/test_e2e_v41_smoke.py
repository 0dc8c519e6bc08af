"""benchmarks/e2e_v41.py runs end to end on a CPU (toy width, the kernel ops' references) and writes its
report: block-by-block parity of the registry path against the PyTorch path, prefill, decode, time shares."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_e2e_v41_smoke_run_writes_its_report(tmp_path):
    proc = subprocess.run([sys.executable, "-u", str(ROOT / "benchmarks" / "e2e_v41.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "e2e_v41.json").read_text())
    assert [p["numerics"] for p in res["parity"]] == ["reference", "bf16"]
    for p in res["parity"]:
        assert p["ok"], p
        assert p["state_bytes_compared"] > 0 and p["topk_rows"] > 0
        assert any(k.startswith("attention L4") for k in p["errors"])   # the candidate index source was compared
    assert "moe_mx" in res["parity"][0]["routed_ops"] and "moe_mx" not in res["parity"][1]["routed_ops"]
    assert [r["context"] for r in res["prefill"]] == [40]
    assert res["prefill"][0]["global_cache_bytes_per_token"] > 0
    assert {(d["context"], d["batch"]) for d in res["decode"]} == {(40, 1), (40, 3)}
    assert all(d["ms_per_step"] > 0 for d in res["decode"])
    assert res["profile"] and all(rows[-1]["op"] == "(rest)" for rows in res["profile"].values())
    shares = res["op_shares"]
    assert {"decode b1 at 40", "decode b3 at 40", "prefill chunk 32 after 40"} <= set(shares)
    for rows in shares.values():
        ops = {r["op"] for r in rows}
        assert {"moe_mx", "linear_mx", "sparse_attention_mx", "(outside the registry ops)"} <= ops
        assert abs(sum(r["ms"] for r in rows[:-1]) - rows[-1]["ms"]) < 1e-6 * max(1.0, rows[-1]["ms"])
    assert "## Prefill" in (tmp_path / "e2e_v41.md").read_text()


@pytest.mark.slow
def test_e2e_v41_smoke_with_the_triton_kernels_interpreted(tmp_path):
    """The same run with the Triton kernels (CPU interpreter): the model's calls meet the kernels' contracts."""
    proc = subprocess.run([sys.executable, "-u", str(ROOT / "benchmarks" / "e2e_v41.py"), "--smoke", "--backend",
                           "triton", "--skip-profile", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "e2e_v41.json").read_text())
    assert all(b == "triton" for b in res["ops"].values())
    assert [p["ok"] for p in res["parity"]] == [True, True], res["parity"]
