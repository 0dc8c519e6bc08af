"""benchmarks/e2e_v41.py runs end to end on a CPU (toy width, the kernel ops' references) and writes its
report: block-by-block parity of the registry path against the PyTorch path, prefill, decode, time shares."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """``benchmarks/e2e_v41.py --smoke`` run once as a user runs it: (its JSON report, its output folder)."""
    out = tmp_path_factory.mktemp("e2e_v41_smoke")
    proc = subprocess.run([sys.executable, "-u", str(ROOT / "benchmarks" / "e2e_v41.py"), "--smoke", "--out",
                           str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "e2e_v41.json").read_text()), out


def test_e2e_v41_smoke_run_writes_its_report(smoke_run):
    res, out = smoke_run
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
    for r in (r for rows in res["profile"].values() for r in rows if "launch_ms" in r):
        assert 1 <= len(r["launch_ms"]) <= r["calls"] <= 8, r
    shares = res["op_shares"]
    assert {"decode b1 at 40", "decode b3 at 40", "prefill chunk 32 after 40"} <= set(shares)
    for rows in shares.values():
        ops = {r["op"] for r in rows}
        assert {"moe_mx", "linear_mx", "sparse_attention_mx", "(outside the registry ops)"} <= ops
        assert abs(sum(r["ms"] for r in rows[:-1]) - rows[-1]["ms"]) < 1e-6 * max(1.0, rows[-1]["ms"])
    assert "## Prefill" in (out / "e2e_v41.md").read_text()


def test_the_kernel_profile_splits_a_few_launches_by_launch():
    """``op_shares`` lists each launch's time of a kernel (an op on a CPU) called 2 to ``max_launches`` times,
    adding up to its total; one called more often gets no split."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from e2e_v41_timing import op_shares

    big, small = torch.randn(384, 384), torch.randn(48, 48)

    def step():
        for _ in range(3):
            torch.mm(big, big)
        for _ in range(12):
            torch.mm(small, small).exp_()

    rows = {r["op"]: r for r in op_shares(step, torch.device("cpu"), max_launches=8)}
    mm, exp = rows["aten::mm"], rows["aten::exp_"]
    assert "launch_ms" not in mm and "launch_ms" not in exp   # 15 and 12 calls
    rows = {r["op"]: r for r in op_shares(step, torch.device("cpu"), max_launches=15)}
    mm = rows["aten::mm"]
    assert len(mm["launch_ms"]) == mm["calls"] == 15
    assert abs(sum(mm["launch_ms"]) - mm["ms"]) <= 1e-3 * 15


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


def test_the_prefill_profile_regions_add_up_and_the_chunk_fit_predicts(smoke_run):
    """The region profile's self times plus the time between regions add up to the chunk's wall time, the
    routed ops and the PyTorch parts (mHC, norms, compressor) each appear, and the chunk fit recovers a
    linear growth exactly. (The regions of the smoke run above: its one prefill chunk's profile.)"""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from v41_prefill_profile import ChunkFit
    finally:
        sys.path.pop(0)
    res, _ = smoke_run
    (name, rows), = res["regions"].items()
    assert rows[-1]["region"] == "(step, wall)"
    assert abs(sum(r["ms"] for r in rows[:-1]) - rows[-1]["ms"]) < 1e-6 * rows[-1]["ms"]
    names = {r["region"] for r in rows}
    assert {"op moe_mx", "op sparse_attention_mx", "attention.AttentionLayer._compress"} <= names
    assert any(".hc_mixes" in n or "._Site" in n for n in names)   # the mHC sites, however they are built
    assert all(r["calls"] > 0 for r in rows[:-2])
    row = res["prefill"][0]
    assert row["chunk_seconds"]
    assert row["cache_bytes"]["measured_bytes_per_token"] == row["global_cache_bytes_per_token"]
    fit = ChunkFit.fit([(s, 0.5 + 2e-6 * s) for s in range(0, 65536, 8192)])
    assert abs(fit.a - 0.5) < 1e-9 and abs(fit.b - 2e-6) < 1e-12
    assert abs(fit.prefill(32768, 8192) - sum(0.5 + 2e-6 * s for s in range(0, 32768, 8192))) < 1e-9


def test_synthetic_decode_state_is_valid_and_its_graph_step_equals_eager(tmp_path):
    """``--decode-synthetic``: a decode context no prefill reaches runs on caches of valid random bytes (every
    stored row unpacks to finite values, every sequence at the context's length) and the tensor-only step
    equals the eager step there, as after a real prefill."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e_v41
    finally:
        sys.path.pop(0)
    from redknot.kernels import KernelSet
    from redknot.kernels import mx_formats as mx
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    from redknot.kernels.triton import step_moe_v41, step_proj_v41

    before = (step_proj_v41.MAX_ROWS, step_moe_v41.MAX_ROWS)
    with pytest.raises(SystemExit):     # argparse's message names the flag and the value
        e2e_v41.main(["--smoke", "--step-rows", "0", "--out", str(tmp_path)])
    res = e2e_v41.main(["--smoke", "--prefill", "24", "--decode-synthetic", "--decode-graphs", "--skip-parity",
                        "--skip-profile", "--step-rows", "2", "--out", str(tmp_path)])
    assert res["step_rows"] == 2 and (step_proj_v41.MAX_ROWS, step_moe_v41.MAX_ROWS) == before   # put back
    rows = [d for d in res["decode"] if d["context"] == 40]
    assert {d["batch"] for d in rows} == {1, 3} and all(d["state"] == "synthetic" for d in rows)
    for d in rows:
        assert d["ms_per_step"] is None and d["graph_ms_per_step"] > 0
        assert d["graph_rel_err"] < 1e-6, d
    cfg = e2e_v41.cut_config(True, 100)
    model = e2e_v41.build(cfg, e2e_v41.random_tensors(cfg, torch.device("cpu")), "reference",
                          V41Ops(KernelSet(default="reference"), route_all=True), torch.device("cpu"))
    b = e2e_v41.Batch(model, 2, 128)
    e2e_v41.fill_synthetic(b, 100, seed=3)
    assert b.lens == [100, 100]
    st = b.state
    for w in st.windows:
        assert torch.isfinite(mx.unpack_window_rows(w.view(-1, w.shape[-1]))).all()
    for src in st.sources.values():
        ent = mx.unpack_compressed_entries(src.entries.view(-1, src.entries.shape[-1]))
        keys = mx.unpack_index_keys(src.keys.view(-1, src.keys.shape[-1]))
        assert torch.isfinite(ent).all() and torch.isfinite(keys).all()
        assert ent.abs().amax() > 0 and keys.abs().amax() > 0
