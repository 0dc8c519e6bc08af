"""Host-side pieces of the Triton backend: tile maps, step indices, top-k validation, interpreter fixes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import fp8, indexer, ops  # noqa: E402
from redknot.kernels.triton.checks.indexer import topk_violations  # noqa: E402
from redknot.kernels.triton.checks.common import paged_step  # noqa: E402


def test_token_tiles_cover_each_sequence_once_without_crossing():
    qsl = torch.tensor([0, 5, 5 + 1, 6 + 7, 13 + 2])  # sequences of 5, 1, 7, 2 tokens
    tok0, length, seq, bound = indexer.token_tiles(qsl, 15, 4)
    covered = []
    for t0, n, b in zip(tok0.tolist(), length.tolist(), seq.tolist()):
        if n == 0:
            continue
        assert qsl[b] <= t0 and t0 + n <= qsl[b + 1], (t0, n, b)
        covered += list(range(t0, t0 + n))
    assert sorted(covered) == list(range(15))
    assert bound >= sum(-(-n // 4) for n in (5, 1, 7, 2))


def test_grouped_gemm_tile_map_keeps_tiles_inside_groups():
    offs = torch.tensor([3, 3, 70, 71], dtype=torch.int32)  # groups of 3, 0, 67, 1 rows
    group, row0, end, bound = fp8._tile_map(offs, 32, 71)
    starts = [0, 3, 3, 70]
    rows = []
    for g, r, e in zip(group.tolist(), row0.tolist(), end.tolist()):
        if g < 0:
            continue
        assert starts[g] <= r < offs[g] and e == offs[g]
        rows += list(range(r, min(r + 32, e)))
    assert sorted(rows) == list(range(71))


def test_step_tensors_match_the_python_lists():
    step = paged_step([0, 17, 5], [3, 1, 4], 16, "cpu", torch.Generator().manual_seed(0))
    st = ops.step_tensors(step.meta)
    assert st.context_lens.tolist() == [0, 17, 5]
    assert st.query_start.tolist() == [0, 3, 4]
    assert st.token_seq.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert ops.step_tensors(step.meta) is st  # derived once per step


def test_step_tensors_of_a_decode_capture_equal_the_general_form():
    import dataclasses

    from redknot.kernels import step_index
    from redknot.step.context import StepContext
    step = paged_step([9, 0, 130, 4], [1, 1, 1, 1], 16, "cpu", torch.Generator().manual_seed(1))
    general = step_index._compute(step.meta)
    captured = dataclasses.replace(step.meta, tensor_only=True)
    fast = ops.step_tensors(captured)
    for name in ("token_seq", "context_lens", "query_start", "positions"):
        got, want = getattr(fast, name), getattr(general, name)
        assert got.dtype == want.dtype == torch.int32, name
        assert got.tolist() == want.tolist(), name
    assert ops.step_tensors(captured) is fast  # every layer of one forward reads the same tensors
    captured.positions.add_(5)  # the next forward (a replay's fresh positions) reads them again
    StepContext(captured, None, torch.float32)
    again = ops.step_tensors(captured)
    assert again.context_lens.tolist() == again.positions.tolist() == [14, 5, 135, 9]


def test_topk_validation_rejects_a_worse_entry_and_accepts_near_ties():
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0 - 1e-9, -1.0]], dtype=torch.float64)
    pos = torch.tensor([4 * 5 - 1])  # 5 visible entries at ratio 4
    assert topk_violations(torch.tensor([[1, 3, 2]]), scores, pos, 4, 3, rtol=1e-6) == []
    assert topk_violations(torch.tensor([[3, 1, 2]]), scores, pos, 4, 3, rtol=1e-6) == []  # near tie
    assert topk_violations(torch.tensor([[1, 3, 0]]), scores, pos, 4, 3, rtol=1e-6)  # 1.0 < k-th best 2.0
    assert topk_violations(torch.tensor([[1, 3, -1]]), scores, pos, 4, 3, rtol=1e-6)  # missing id
    assert topk_violations(torch.tensor([[1, 1, 2]]), scores, pos, 4, 3, rtol=1e-6)  # repeated id


def test_interpreter_rounds_like_the_gpu():
    from redknot.kernels.triton._common import interpreting
    if not interpreting():
        pytest.skip("the interpreter is not in use on this machine")
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, b_ptr, f_ptr, N: tl.constexpr):
        o = tl.arange(0, N)
        x = tl.load(x_ptr + o)
        tl.store(b_ptr + o, x.to(tl.bfloat16))
        tl.store(f_ptr + o, x.to(tl.float8e4nv))

    x = torch.randn(1024) * 50
    b, f = torch.empty(1024, dtype=torch.bfloat16), torch.empty(1024, dtype=torch.float8_e4m3fn)
    cast[(1,)](x, b, f, N=1024)
    assert torch.equal(b, x.bfloat16())
    assert torch.equal(f.float(), x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
