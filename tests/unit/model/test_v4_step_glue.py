"""The V4 tensor-only decode step computes its compressors' index tensors once per step and shape (not once per
compressor), and ``benchmarks/v4_step_ops.py`` counts the step's ops."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_compressor_decode_rows_once_per_step_and_shape(monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import v4_step_ops

    from redknot.kernels import ref_attention, registry  # noqa: F401  (ref_attention registers the reference op)
    calls = []
    real = registry._OPS["compressor_decode_rows"]["reference"]

    def spy(positions, seq_slots, block_tables, ring_len, ratio, overlap, per_block, rope_inv):
        calls.append((ring_len, ratio, overlap, per_block))
        return real(positions, seq_slots, block_tables, ring_len, ratio, overlap, per_block, rope_inv)

    monkeypatch.setitem(registry._OPS["compressor_decode_rows"], "reference", spy)
    v4_step_ops.count_step("reference", "cpu", 2)   # two tensor-only decode steps of the tiny model
    # the tiny model's compressors: two CSA layers with a kv and an indexer compressor each (ratio 4, overlapping
    # windows) and one HCA layer (ratio 128): per step one call per shape (the kv and the indexer compressors'
    # pools may have their own entries a block)
    shapes = set(calls)
    assert 2 <= len(shapes) <= 3 and len(calls) == 2 * len(shapes), calls
    assert {(r, o) for _, r, o, _ in shapes} == {(4, True), (128, False)}, calls


def test_the_op_count_benchmark_prints_its_table():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "v4_step_ops.py"), "--top", "5"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "model glue" in res.stdout and "| glue ops | source |" in res.stdout
