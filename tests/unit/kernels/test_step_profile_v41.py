"""benchmarks/step_profile_v41.py: the decode step's device time per kernel and region from a profiler trace,
its busy time against the replay's wall time, on a hand-built GPU-like trace (exact numbers), on a real
CPU trace, and through e2e_v41's --decode-graphs path on a CPU."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import step_profile_v41 as sp
finally:
    sys.path.pop(0)


def ev(name, start, end, dev="CPU", id=0, linked=0, self_us=0.0):
    return SimpleNamespace(name=name, device_type=getattr(DeviceType, dev), time_range=SimpleNamespace(
        start=start, end=end), id=id, linked_correlation_id=linked, self_cpu_time_total=self_us)


def gpu_trace():
    """Two steps. Per step: region moe (a Triton kernel launched by cuLaunchKernelEx, no host op around it),
    region attn nesting region attn.q (an aten op whose kernel is linked to it only through the op's
    correlation id) and a copy outside every region; the GPU-side annotation spans must not count as work."""
    out = []
    for k, t0 in enumerate((0.0, 1000.0)):
        c = 100 * (k + 1)
        out += [ev("v41_step.moe", t0 + 0, t0 + 50), ev("cuLaunchKernelEx", t0 + 10, t0 + 12, id=c + 1),
                ev("v41_step.attn", t0 + 60, t0 + 120), ev("v41_step.attn.q", t0 + 70, t0 + 90),
                ev("aten::mm", t0 + 72, t0 + 80, id=9000 + k),
                ev("cudaMemcpyAsync", t0 + 130, t0 + 131, id=c + 3),
                ev("fused_moe_kernel", t0 + 200, t0 + 300, "CUDA", id=c + 1),
                ev("gemm_kernel", t0 + 250, t0 + 260, "CUDA", id=c + 2, linked=9000 + k),   # overlaps moe by 10
                ev("Memcpy DtoD", t0 + 400, t0 + 405, "CUDA", id=c + 3),
                ev("v41_step.moe", t0 + 200, t0 + 300, "CUDA")]                            # GPU-side range
    return out


def test_gpu_trace_attribution_busy_time_and_gaps():
    rep = sp.kernel_report(gpu_trace(), steps=2, wall_ms=0.5)
    assert rep["kind"] == "device"
    assert rep["launches"] == 6 and rep["launches_per_step"] == 3
    assert rep["launch_calls_on_host"] == 4 and rep["launches_matched"] == 4
    assert abs(rep["device_ms_per_step"] - 0.115) < 1e-12            # 100 + 10 + 5 us
    assert abs(rep["busy_ms_per_step"] - 0.105) < 1e-12              # the overlap counted once
    assert abs(rep["gap_ms_per_step"] - (0.5 - 0.105)) < 1e-12
    assert abs(rep["coverage"] - 0.105 / 0.5) < 1e-12
    regions = {r["name"]: (r["ms"], r["calls"]) for r in rep["by_region"]}
    assert regions == {"moe": (0.2, 2), "attn.q": (0.02, 2), "(outside the regions)": (0.01, 2)}
    assert [r["name"] for r in rep["by_kernel"]] == ["fused_moe_kernel", "gemm_kernel", "Memcpy DtoD"]
    assert abs(sum(r["share"] for r in rep["by_kernel"]) - 1) < 1e-12
    # a kernel with neither a launch call nor a linked op in the trace is reported as such, not dropped
    # a kernel without a launch call in the trace, linked to the range around its launch, counts there
    linked = sp.kernel_report([ev("v41_step.engram", 0, 9, id=5), ev("k", 20, 30, "CUDA", id=6, linked=5)], 1)
    assert [(r["name"], r["calls"]) for r in linked["by_region"]] == [("engram", 1)]
    lone = sp.kernel_report([ev("k", 0, 10, "CUDA", id=77)], steps=1)
    assert lone["by_region"][0]["name"] == "(launch not in the trace)" and lone["gap_ms_per_step"] is None
    # the rest row sums what it folds
    many = sp.kernel_report([ev(f"k{i}", 10 * i, 10 * i + i + 1, "CUDA", id=i + 1) for i in range(5)], 1, top=2)
    assert [r["name"] for r in many["by_kernel"]] == ["k4", "k3", "(rest: 3 names)"]
    assert abs(many["by_kernel"][-1]["ms"] - 0.006) < 1e-12


def test_cpu_trace_reports_host_ops_by_region():
    import redknot.models.deepseek_v41.tensor_step as ts

    x = torch.randn(64, 64)

    def step():
        with ts.region("moe"):
            y = x @ x
        with ts.region("attn"), ts.region("attn.q"):
            y = torch.relu(y)
        return y + 1

    events = sp.profile_steps(step, torch.device("cpu"), steps=3)
    assert ts.PROFILE_REGIONS is False
    rep = sp.kernel_report(events, 3, wall_ms=1.0)
    assert rep["kind"].startswith("host")
    regions = {r["name"] for r in rep["by_region"]}
    assert {"moe", "attn.q", "(outside the regions)"} <= regions and "attn" not in regions
    names = {r["name"] for r in rep["by_kernel"]}
    assert any("mm" in n for n in names) and any("relu" in n for n in names)
    assert not any(n.startswith("v41_step.") for n in names)
    assert rep["busy_ms_per_step"] > 0 and rep["launches_per_step"] >= 3
    lines = sp.format_views({"eager": rep, "replay": {"error": "RuntimeError: x"}}, "test")
    text = "\n".join(lines)
    assert "### eager view, device time by region" in text and "| replay | failed: RuntimeError: x" in text


# the whole e2e_v41 smoke decode under the profiler (~30 s interpreted); the report functions are tested above
@pytest.mark.slow
def test_e2e_decode_graphs_reports_both_views(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e_v41
        res = e2e_v41.main(["--smoke", "--prefill", "24", "--decode-batch", "1", "--decode-synthetic",
                            "--decode-graphs", "--skip-parity", "--out", str(tmp_path)])
    finally:
        sys.path.pop(0)
    rows = [d for d in res["decode"] if "step_views" in d]
    assert rows
    views = rows[0]["step_views"]
    assert set(views) == {"eager", "replay"}, views
    eager = views["eager"]
    assert "error" not in eager, eager
    assert eager["steps"] == 2 and eager["wall_ms_per_step"] == rows[0]["graph_ms_per_step"]
    regions = {r["name"] for r in eager["by_region"]}
    assert len(regions - {"(outside the regions)"}) >= 3, regions
    assert "Decode step profile: tensor step, decode b1" in (tmp_path / "e2e_v41.md").read_text()
