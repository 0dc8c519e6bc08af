"""``step_indexer_mx``'s strided launch (``StepIndexConfig.loop`` > 1: a row's column blocks over fewer programs, the
query loaded once per program): the bits of the one-block launch (same per-block code) over every entry, -inf past
``visible``, with candidate lists, fp32 and bf16 scores, and within tolerance of the PyTorch reference on fresh random
inputs. GPU when there is one, else the Triton interpreter."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton.step_indexer_mx import (
    STEP_INDEX_TUNER,
    StepIndexConfig,
    step_index_scores,
    step_index_scores_reference,
)
from slow_grid import rotated_grid

LOOPS = [c for c in STEP_INDEX_TUNER.candidates if c.loop > 1 or c.page]


def _case(device, seed, hi, di, ratio, bs, width, vis):
    g = torch.Generator().manual_seed(seed)
    t, per = len(vis), bs // ratio
    n_pages = t * width + 3
    keys = mx.pack_index_keys(torch.randn(n_pages * per, di, generator=g))
    table = torch.randperm(n_pages, generator=g)[:t * width].view(t, width).to(torch.int32)
    q = mx.act_quant_ref(torch.randn(t, hi, di, generator=g), "fp4", mx.MX_GROUP, "ue8m0")
    w = torch.randn(t, hi, generator=g) * (di ** -0.5 * hi ** -0.5)
    return q.to(device), w.to(device), keys.to(device), table.to(device), torch.tensor(vis).to(device), ratio, bs


# heads, dim, ratio, block size, table width, visible entries per row: rows with no, few, some and all blocks
# visible (16-entry blocks at the toy width: up to 10 blocks a row, so a program walks several)
CASES = [(4, 64, 1, 16, 10, [160, 17, 0, 1, 95]), (3, 32, 2, 16, 12, [96, 33, 2, 64])]


def test_the_new_shapes_are_strided_or_paged():
    assert LOOPS and any(c.loop > 1 for c in LOOPS) and any(c.page and c.loop == 1 for c in LOOPS)


def _grid(loops):
    """Each (case, loop) once by default, fp32 and bf16 scores in turn (each loop meets both cases and both score
    dtypes); the other half with ``-m slow``."""
    rows = [(c, loop) for c in range(len(CASES)) for loop in loops]
    return rotated_grid(rows, [(False,), (True,)], [f"case{c}-loop{loop}" for c, loop in rows], ["fp32", "bf16"])


@pytest.mark.parametrize("case,loop,bf16", _grid([2, 3, 8]))
def test_strided_launch_has_the_one_block_bits(loop, case, bf16, kernel_device):
    args = _case(kernel_device, 10 + case, *CASES[case])
    one = step_index_scores(*args, bf16_scores=bf16, config=StepIndexConfig(16, 4))
    got = step_index_scores(*args, bf16_scores=bf16, config=StepIndexConfig(16, 4, loop))
    assert torch.equal(got, one)
    want = step_index_scores_reference(*args, bf16_scores=bf16)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert fin.sum() == sum(CASES[case][-1])
    tol = 2 ** -7 if bf16 else 1e-5
    scale = want[fin].abs().max()
    assert ((got[fin] - want[fin]).abs() <= tol * (want[fin].abs() + 1e-3 * scale)).all()


@pytest.mark.parametrize("case,loop,bf16", _grid([1, 2, 8]))
def test_page_blocks_have_the_one_block_bits(loop, case, bf16, kernel_device):
    """``page``: a block's keys as one page's consecutive rows (16-entry blocks in pages of 16 / 8 entries: ratio 1
    takes it, ratio 2's 8-entry pages fall back to the per-entry lookup; 8-entry blocks in both)."""
    args = _case(kernel_device, 20 + case, *CASES[case])
    for bn in (16, 8):
        one = step_index_scores(*args, bf16_scores=bf16, config=StepIndexConfig(bn, 4))
        got = step_index_scores(*args, bf16_scores=bf16, config=StepIndexConfig(bn, 4, loop, True))
        assert torch.equal(got, one), bn


def test_page_blocks_read_each_rows_own_pages(kernel_device):
    """A wrong page (the next table entry) changes the scores: the page form's lookup is exercised."""
    args = _case(kernel_device, 31, *CASES[0])
    swapped = list(args)
    swapped[3] = args[3].roll(1, dims=1)
    a = step_index_scores(*args, config=StepIndexConfig(16, 4, 2, True))
    b = step_index_scores(*swapped, config=StepIndexConfig(16, 4, 2, True))
    fin = torch.isfinite(a)
    assert not torch.equal(a[fin], b[fin])


@pytest.mark.parametrize("loop", [2, 5])
def test_strided_launch_over_entry_lists(loop, kernel_device):
    """Candidate lists (every block scored): -1, invisible and out-of-table ids -inf, the listed entries' scores."""
    args = _case(kernel_device, 3, *CASES[0])
    t = args[0].shape[0]
    n_max = args[3].shape[1] * args[6] // args[5]
    g = torch.Generator().manual_seed(4)
    ent = torch.randint(-1, n_max + 5, (t, 70), generator=g).to(kernel_device)
    one = step_index_scores(*args, entries=ent, config=StepIndexConfig(16, 4))
    got = step_index_scores(*args, entries=ent, config=StepIndexConfig(16, 4, loop))
    assert torch.equal(got, one)
    assert torch.equal(step_index_scores(*args, entries=ent, config=StepIndexConfig(16, 4, loop, True)), one)
    want = step_index_scores_reference(*args, entries=ent)
    assert torch.equal(torch.isinf(got), torch.isinf(want))


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("bf16", [False, True])
def test_gpu_strided_shapes_at_real_width(ratio, bf16):
    """V4.1 width (32 heads of 128, 256-entry blocks, 8K context, 32 rows): every strided / page tuner shape gives the
    bits of the one-block launch of its block width."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import dataclasses
    args = _case("cuda", 6, 32, 128, ratio, 256, 34, [(8000 + 11 * i) // ratio for i in range(32)])
    for cfg in LOOPS:
        one = step_index_scores(*args, bf16_scores=bf16, config=dataclasses.replace(cfg, loop=1, page=False))
        assert torch.equal(step_index_scores(*args, bf16_scores=bf16, config=cfg), one), cfg
