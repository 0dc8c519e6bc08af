"""The V4.1 shipped-format Triton kernels against their references on the GPU, at toy and at real V4.1
dimensions (fresh random inputs; tolerances in ``redknot/kernels/triton/checks_mx.py``)."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels.triton import ops_mx as fast  # noqa: E402
from redknot.kernels.triton.checks_mx import ALL_MX_CHECKS, REAL_V41, TOY_V41, moe_graph, moe_inputs  # noqa: E402

CASES = [(name, dims) for name in sorted(ALL_MX_CHECKS) for dims in ("toy", "v41")]


@pytest.mark.parametrize("name,dims", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_mx_kernel_matches_reference_on_gpu(name, dims):
    rows = ALL_MX_CHECKS[name]({"toy": TOY_V41, "v41": REAL_V41}[dims], "cuda", seed=4)
    failed = [r.line() for r in rows if not r.ok]
    assert rows and not failed, "\n".join(failed)


def test_moe_mx_captures_in_a_cuda_graph():
    """No host sync in the routed path: it captures, and the replay equals the eager result."""
    x, idx, wt, w = moe_inputs(TOY_V41, "cuda", seed=6, tokens=8)
    _, out, eager = moe_graph(x, idx, wt, w, 10.0)
    assert torch.equal(out, eager)


def test_engram_gather_reads_a_pinned_host_table():
    table = torch.randint(0, 126, (1024, 256), dtype=torch.uint8, device="cuda")
    scale = torch.randint(110, 130, (1024, 8), dtype=torch.uint8, device="cuda")
    ids = torch.randint(0, 1024, (5, 24), device="cuda")
    host_t, host_s = table.cpu().pin_memory(), scale.cpu().pin_memory()
    assert torch.equal(fast.engram_gather_mx(host_t, host_s, ids), fast.engram_gather_mx(table, scale, ids))
