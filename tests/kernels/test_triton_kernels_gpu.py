"""Every Triton kernel against its reference on the GPU, at toy and at V4 dimensions.

Fresh random inputs per check; shapes hit the edge cases (context < window, lengths not a multiple of
the compression ratio, fewer visible entries than top-k, exact score ties, key splits); output buffers
are poisoned first. Tolerances (norm-wise relative error): fp32 1e-5 (exact FMA dots), bf16 1e-2.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from redknot.kernels.triton.checks import ALL_CHECKS, REAL, TOY  # noqa: E402

CASES = [(name, dims_name, dtype) for name in ALL_CHECKS for dims_name, dtype in
         (("toy", torch.float32), ("toy", torch.bfloat16), ("v4", torch.bfloat16))]


@pytest.mark.parametrize("name,dims_name,dtype", CASES, ids=[f"{n}-{d}-{str(t)[6:]}" for n, d, t in CASES])
def test_kernel_matches_reference_on_gpu(name, dims_name, dtype):
    dims = {"toy": TOY, "v4": REAL}[dims_name]
    rows = ALL_CHECKS[name](dims, "cuda", dtype, seed=3)
    failed = [r.line() for r in rows if not r.ok]
    assert rows and not failed, "\n".join(failed)


def test_results_do_not_move_between_runs():
    """Same inputs, same outputs, bitwise: no races, no order-dependent reductions."""
    from redknot.kernels.triton.checks.common import paged_step, random_choice_lists
    from redknot.kernels.triton import ops
    g = torch.Generator().manual_seed(0)
    step = paged_step([3000, 17], [1, 300], REAL.block_size, "cuda", g)
    meta, t = step.meta, step.num_tokens
    q = torch.randn(t, 64, 512, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(t, 512, device="cuda", dtype=torch.bfloat16)
    ring = torch.randn(step.num_slots, 136, 512, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(step.num_blocks, 64, 512, device="cuda", dtype=torch.bfloat16)
    idx = random_choice_lists(meta.positions, 4, 512)
    sinks = torch.randn(64, device="cuda")
    first = ops.sparse_attention(q, kv, ring, sinks, 512 ** -0.5, 128, meta, pool, idx)
    for _ in range(3):
        assert torch.equal(ops.sparse_attention(q, kv, ring, sinks, 512 ** -0.5, 128, meta, pool, idx), first)
    qi = torch.randn(t, 64, 128, device="cuda", dtype=torch.bfloat16)
    wi = torch.randn(t, 64, device="cuda")
    keys = torch.randn(step.num_blocks, 64, 128, device="cuda", dtype=torch.bfloat16)
    first = ops.indexer_topk(qi, wi, keys, meta, 4, 512, 128 ** -0.5)
    for _ in range(3):
        assert torch.equal(ops.indexer_topk(qi, wi, keys, meta, 4, 512, 128 ** -0.5), first)
