"""The radix-select top-k (:mod:`redknot.kernels.triton.radix_select`) against ``select_topk``, the PyTorch
statement of the indexer's rule (best ids ascending then -1, exact ties to the lower id, -inf never), with
fresh random rows: Triton's CPU interpreter here at small sizes, the GPU with ``-m gpu`` at real sizes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.radix_select import radix_topk, segment_size  # noqa: E402
from redknot.kernels.triton.step_indexer_mx import (  # noqa: E402
    page_rows, page_rows_reference, select_topk, topk_select)


def _rows(t: int, n: int, seed: int, device) -> torch.Tensor:
    """Rows of several kinds: continuous scores; a few distinct values (heavy exact ties); signed zeros and
    relu-like zeros; an -inf tail; nothing selectable; +inf entries."""
    g = torch.Generator().manual_seed(seed)
    sc = torch.randn(t, n, generator=g)
    kinds = torch.arange(t) % 6
    for r in range(t):
        k = int(kinds[r])
        if k == 1:
            sc[r] = torch.randint(-3, 4, (n,), generator=g).float() * 0.25
        elif k == 2:
            sc[r] = torch.where(torch.rand(n, generator=g) < 0.5, torch.zeros(n), -torch.zeros(n))
            sc[r, torch.randint(0, n, (max(n // 10, 1),), generator=g)] = 1.5
        elif k == 3:
            sc[r, int(torch.randint(0, n + 1, (1,), generator=g)):] = float("-inf")
        elif k == 4:
            sc[r] = float("-inf")
        elif k == 5:
            sc[r] = sc[r].to(torch.bfloat16).float()
            sc[r, torch.randint(0, n, (3,), generator=g)] = float("inf")
    return sc.to(device)


CASES = [
    # rows, entries, k, entries per first-launch program (None: one launch)
    (6, 40, 8, None),
    (6, 7, 16, None),          # fewer entries than k
    (12, 300, 40, None),
    (6, 1500, 64, None),       # several tiles, n not a power of two
    (6, 2500, 48, 600),        # two launches: segments, then a select over their lists
    (6, 1000, 300, 256),       # k above the segment size: every segment keeps all it has
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_radix_topk_is_select_topk(case, kernel_device):
    t, n, k, seg = CASES[case]
    for seed in (case, case + 50):
        sc = _rows(t, n, seed, kernel_device)
        got = radix_topk(sc, k, seg=seg)
        assert got.dtype == torch.long and got.shape == (t, k)
        assert torch.equal(got.cpu(), select_topk(sc.cpu(), k)), seed


def test_radix_topk_over_entry_lists(kernel_device):
    """With an entry list the ids are the listed entries at the selected columns (-1 entries unselectable)."""
    g = torch.Generator().manual_seed(11)
    t, n, k = 6, 700, 50
    sc = _rows(t, n, 12, "cpu")
    ids = torch.sort(torch.randint(0, 5000, (t, n), generator=g), dim=1).values
    ids[:, 600:] = -1
    sc[:, 600:] = float("-inf")
    at = select_topk(sc, k)
    want = torch.where(at >= 0, ids.gather(1, at.clamp(min=0)), -1)
    for seg in (None, 200):
        got = radix_topk(sc.to(kernel_device), k, ids=ids.to(kernel_device), seg=seg).cpu()
        assert torch.equal(got, want), seg
    got = topk_select(sc.to(kernel_device), k, ids=ids.to(kernel_device)).cpu()
    assert torch.equal(got, want)


def test_radix_topk_edges(kernel_device):
    sc = _rows(4, 30, 3, kernel_device)
    assert radix_topk(sc, 0).shape == (4, 0)
    assert (radix_topk(sc[:, :0], 5) == -1).all()
    strided = _rows(5, 64, 4, kernel_device)[:, ::2]                # a non-contiguous row
    assert torch.equal(radix_topk(strided, 9).cpu(), select_topk(strided.cpu(), 9))
    with pytest.raises(ValueError, match="scores must be"):
        radix_topk(sc[0], 4)


def test_segment_size_balances_the_two_launches():
    assert segment_size(4096, 512, 32768) == 4096
    s = segment_size(1 << 19, 512, 32768)
    assert s == 1 << 14 and s >= 4 * 512
    assert segment_size(40000, 2048, 32768) >= 4 * 2048


def test_page_rows_is_the_tables_rows(kernel_device):
    g = torch.Generator().manual_seed(5)
    t, w, bs, r = 5, 7, 16, 2
    per = bs // r
    table = torch.randint(0, 50, (t, w), generator=g)
    sel = torch.randint(-1, w * bs // r + 3, (t, 33), generator=g)        # -1, and ids past the table
    want = page_rows_reference(sel, table, r, bs, per)
    got = page_rows(sel.to(kernel_device), table.to(kernel_device), r, bs, per).cpu()
    assert torch.equal(got, want)
    assert (got[sel < 0] == -1).all()


# ---------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 65536, 262144])
@pytest.mark.parametrize("t", [1, 32, 128])
def test_gpu_radix_topk_real_sizes(n, t):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.kernels.triton.step_indexer_mx import SELECT_ERRORS

    sc = _rows(t, n, n + t, "cuda")
    want = select_topk(sc, 512)
    assert torch.equal(radix_topk(sc, 512), want)
    assert torch.equal(topk_select(sc, 512), want)
    assert not SELECT_ERRORS, SELECT_ERRORS
    bf = (torch.randn(t, n, device="cuda") * 0.1).to(torch.bfloat16).float()   # bf16 scores: exact ties
    bf[:, n - n // 5:] = float("-inf")
    assert torch.equal(radix_topk(bf, 512), select_topk(bf, 512))
