"""The V4 tensor-only decode step computes its compressors' index arithmetic once per step and shape (not once per
compressor), and ``benchmarks/v4_step_ops.py`` counts the step's ops."""
import subprocess
import sys
from pathlib import Path

import redknot.models.deepseek_v4.compressor as comp

ROOT = Path(__file__).resolve().parents[3]


def test_ring_windows_and_closing_entries_once_per_step_and_shape(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import v4_step_ops

    calls = {"rows": [], "entries": []}
    rows, entries = comp.ring_window_rows, comp._closing_entries
    monkeypatch.setattr(comp, "ring_window_rows", lambda pos, slots, span, ring: calls["rows"].append(
        (span, ring)) or rows(pos, slots, span, ring))
    monkeypatch.setattr(comp, "_closing_entries", lambda ctx, m, per_block: calls["entries"].append(
        (m, per_block)) or entries(ctx, m, per_block))
    v4_step_ops.count_step("reference", "cpu", 2)   # two tensor-only decode steps of the tiny model
    # the tiny model's compressors: two CSA layers with a kv and an indexer compressor each (ratio 4, overlapping
    # windows) and one HCA layer (ratio 128): two shapes, so two of each per step
    assert len(calls["rows"]) == len(calls["entries"]) == 4, calls
    assert len(set(calls["rows"])) == len(set(calls["entries"])) == 2, calls


def test_the_op_count_benchmark_prints_its_table():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "v4_step_ops.py"), "--top", "5"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "model glue" in res.stdout and "| glue ops | source |" in res.stdout
