"""``benchmarks/dense_step_v41.py --smoke`` runs on the CPU (Triton interpreter, toy sizes): every case runs, the
fused names equal their two launches bit for bit, and the tables are written. The default run checks the dense
linears and wo_a (``--only linear``, ~13 s); the step attention and index-score rows (every tuner candidate through
the interpreter, ~110 s; the kernels themselves are checked candidate by candidate in test_step_mx_kernels and
test_step_index_loop) run with ``-m slow``."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[3]


def _smoke(tmp_path, *extra):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dense_step_v41.py"), "--smoke", "--out",
                           str(tmp_path), "--shapes", "toy b", "--decodes", "registers_wide", "registers_wide_f",
                           "fp8_f16", *extra], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((tmp_path / "dense_step_v41.json").read_text())


def _check_linear_rows(rows):
    timed = [r for r in rows if r.get("decode") and r.get("rows") != "tuner"]
    assert len(timed) == 6 and all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in timed)
    assert all(r["same_bits_as_two_launches"] for r in timed if r["decode"] != "registers_wide")
    woa = [r for r in rows if r.get("shape") == "wo_a"]
    assert len(woa) == 2 * 6 and all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in woa)


def test_dense_step_smoke_linear(tmp_path):
    rows = _smoke(tmp_path, "--only", "linear")
    _check_linear_rows(rows)
    assert not [r for r in rows if r.get("shape") == "step attention"]
    table = (tmp_path / "dense_step_v41.md").read_text()
    assert "## Step sums" in table and "| toy b | tuner (32 rows) |" in table
    # the smoke's row counts (5, 33) are all in the 5-64-row class: one tuner row, for that class
    assert [r.get("tuner_rows") for r in rows if r.get("rows") == "tuner"] == [32]


@pytest.mark.slow
def test_dense_step_smoke(tmp_path):
    rows = _smoke(tmp_path)
    _check_linear_rows(rows)
    attn = [r for r in rows if r.get("shape") == "step attention"]
    from redknot.kernels.triton.attention_mx import ATTN_MX_TUNER
    assert len(attn) == 2 * (len(ATTN_MX_TUNER.candidates) + 1) and all(r["status"] == "ok" and r["rel_err"] < 2e-2 for r in attn)
    idx = [r for r in rows if str(r.get("shape")).startswith("index scores")]
    from redknot.kernels.triton.step_indexer_mx import STEP_INDEX_TUNER
    assert len(idx) == 2 * 2 * (len(STEP_INDEX_TUNER.candidates) + 1)
    assert all(r["status"] == "ok" and r["inf_equal"] and r["rel_err"] < 1e-4 for r in idx)
    assert all(r["same_bits_as_one_block"] for r in idx
               if ("loop=1," not in r["variant"] or "page=True" in r["variant"]) and "tuned" not in r["variant"])
    table = (tmp_path / "dense_step_v41.md").read_text()
    assert "## Step sums" in table and "| toy b | tuner |" in table
