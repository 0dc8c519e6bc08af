"""The radix-select top-k (:mod:`redknot.kernels.triton.radix_select`) against ``select_topk``, the PyTorch
statement of the indexer's rule (best ids ascending then -1, exact ties to the lower id, -inf never), with
fresh random rows: Triton's CPU interpreter here at small sizes, the GPU with ``-m gpu`` at real sizes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton.radix_select import (  # noqa: E402
    RadixSelectConfig, launch_shape, radix_candidates, radix_topk, segment_size)
from redknot.kernels.triton.step_indexer_mx import (  # noqa: E402
    candidate_entries, page_rows, page_rows_reference, select_topk)
from redknot.kernels.triton.step_select import candidate_select, topk_reference, topk_select  # noqa: E402
from slow_grid import rotated_grid  # noqa: E402


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


SMALL_TILES = RadixSelectConfig(resident_max=256, block=256, per_thread=1)   # segments re-read per pass


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["resident", "tiled"])
def test_radix_topk_is_select_topk(case, config, kernel_device):
    t, n, k, seg = CASES[case]
    for seed in (case, case + 50)[:1 if config is not None else 2]:
        sc = _rows(t, n, seed, kernel_device)
        got = radix_topk(sc, k, seg=seg, config=config)
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


def test_radix_topk_inside_candidate_blocks(kernel_device):
    """With a block map only the entries of set blocks are selectable (blocks past the map: none)."""
    g = torch.Generator().manual_seed(21)
    t, n, k, bs = 6, 900, 40, 8
    sc = _rows(t, n, 22, "cpu")
    bm = (torch.rand(t, 100, generator=g) < 0.3).to(torch.uint8)          # 100 blocks of 8 < 900 entries
    bm[2] = 0
    bm[3] = 1
    want = topk_reference(sc, k, block_mask=bm, mask_block=bs)
    keep = torch.zeros(t, n, dtype=torch.bool)
    keep[:, :800] = bm.bool().repeat_interleave(bs, 1)
    assert torch.equal(want, select_topk(sc.masked_fill(~keep, float("-inf")), k))   # the reference's own check
    for seg in (None, 256):
        got = radix_topk(sc.to(kernel_device), k, block_mask=bm.to(kernel_device), mask_block=bs, seg=seg).cpu()
        assert torch.equal(got, want), seg
    got = topk_select(sc.to(kernel_device), k, block_mask=bm.bool().to(kernel_device), mask_block=bs).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("seg,config", [(None, None), (12, None), (None, SMALL_TILES), (30, SMALL_TILES)])
def test_radix_candidates_are_the_models_candidate_blocks(seg, config, kernel_device):
    """Block maxima, the newest visible entry's block pinned, the best blocks by the lower-id rule, as
    entry lists (``candidate_entries``) and as the map of the model's candidate mask."""
    from redknot.models.deepseek_v41.attention import candidate_blocks

    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        n, bs, nb = (203, 4, 9) if config is None else (1203, 4, 70)   # tiled: more blocks than a tile
        vis = torch.tensor([n, 140, 9, 1, 0, 57, n])
        sc = torch.randint(-4, 5, (7, n), generator=g).float() * 0.5          # ties between blocks too
        sc[6] = torch.randn(n, generator=g)
        sc = sc.masked_fill(torch.arange(n)[None, :] >= vis[:, None], float("-inf"))
        ent, bmap = radix_candidates(sc.to(kernel_device), vis.to(kernel_device), nb, bs, seg=seg, config=config)
        assert torch.equal(ent.cpu(), candidate_entries(sc, vis, nb, bs)), seed
        mask = candidate_blocks(sc, vis, nb, bs)                               # [T, n] bool, the PyTorch path
        nblk = -(-n // bs)
        assert bmap.shape == (7, nblk)
        assert torch.equal(bmap.cpu().bool().repeat_interleave(bs, 1)[:, :n], mask), seed
        got = candidate_select(sc.to(kernel_device), vis.to(kernel_device), nb, bs)
        assert torch.equal(got[0].cpu(), ent.cpu()) and torch.equal(got[1].cpu(), bmap.cpu())


@pytest.mark.parametrize("how,seg", [("radix", None), ("radix", 300), ("torch", None)],
                         ids=["radix", "radix-segments", "torch"])
def test_candidate_source_block_selection_is_the_models(how, seg, kernel_device, monkeypatch):
    """The candidate source's block choice from its block maxima (``indexer_mx._pin_and_select``, both forms)
    is the model's candidate mask: the newest visible block pinned, ties between blocks to the lower block, -inf
    blocks never; more blocks than kept (the source's case) and fewer (every finite block kept). ``seg`` 300:
    rows of 1000 blocks in four tiled segments and a select over their lists (the form of a long context)."""
    from redknot.kernels.triton import indexer_mx
    from redknot.kernels.triton.indexer_mx import _pin_and_select
    from redknot.models.deepseek_v41.attention import candidate_blocks

    if seg is not None:
        monkeypatch.setattr(indexer_mx, "BLOCK_SELECT_SEG", seg)
    cases = [(203, 4, 9), (1203, 8, 40), (64, 8, 12)] if seg is None else [(8000, 8, 40)]
    for seed, (n, bs, nb) in enumerate(cases):
        g = torch.Generator().manual_seed(seed)
        t = 8
        vis = torch.tensor([n, n // 2, 9, 1, 0, 57 % n, n, (3 * n) // 4])
        sc = torch.randint(-4, 5, (t, n), generator=g).float() * 0.5          # ties between blocks
        sc[6] = torch.randn(n, generator=g)
        sc = sc.masked_fill(torch.arange(n)[None, :] >= vis[:, None], float("-inf"))
        nblk = -(-n // bs)
        bmax = torch.nn.functional.pad(sc, (0, nblk * bs - n), value=float("-inf")).view(t, nblk, bs).amax(-1)
        got = _pin_and_select(bmax.to(kernel_device), vis.to(kernel_device), nb, bs, how=how).cpu()
        assert got.dtype == torch.int32 and got.shape == (t, nb)
        mask = candidate_blocks(sc, vis, nb, bs)[:, ::bs]                      # [T, nblk] the model's blocks
        want = torch.full((t, nb), -1, dtype=torch.int32)
        for r in range(t):
            ids = mask[r].nonzero().flatten()
            want[r, :len(ids)] = ids.int()
        assert torch.equal(got, want), (seed, how)
    with pytest.raises(ValueError, match="how='sort'"):
        _pin_and_select(bmax, vis, 4, 8, how="sort")


COUNTING = [RadixSelectConfig(step_bits=b) for b in (1, 2, 4)]


def _edge_rows(t: int, n: int, k: int, seed: int) -> torch.Tensor:
    """``_rows`` plus rows that stress the counting search: exactly k selectable, k + 1 with the last two tied,
    ties straddling the k-th place with extreme values (+-FLT_MAX, subnormals, +-0), one repeated value."""
    g = torch.Generator().manual_seed(seed)
    sc = _rows(t, n, seed, "cpu")
    big = torch.finfo(torch.float32).max
    extra = torch.full((5, n), float("-inf"))
    extra[0, torch.randperm(n, generator=g)[:k]] = torch.randn(min(k, n), generator=g)
    pick = torch.randperm(n, generator=g)[:k + 1]
    extra[1, pick] = torch.randn(len(pick), generator=g).abs() + 1.0
    extra[1, pick[-2:]] = 0.5
    vals = torch.tensor([big, -big, 1e-45, -1e-45, 0.0, -0.0, 1.0, -1.0])
    extra[2] = vals[torch.randint(0, len(vals), (n,), generator=g)]
    extra[3] = 0.75
    extra[4, : n // 2] = torch.randn(n // 2, generator=g) - 2.0
    extra[4, n // 2:] = torch.randn(n - n // 2, generator=g).to(torch.bfloat16).float()
    return torch.cat([sc, extra])


@pytest.mark.parametrize("case,config", rotated_grid([(c,) for c in range(len(CASES))], [(c,) for c in COUNTING],
                                                     second_ids=["1bit", "2bit", "4bit"]))
def test_counting_forms_are_select_topk(case, config, kernel_device):
    """The tuner's counting forms (thresholds by counts, one scan at the end) give select_topk's ids exactly,
    with fresh random rows, in one launch and in the two-launch split (keys, ids and lists handed on)."""
    t, n, k, seg = CASES[case]
    for seed in (case + 100, case + 200):
        sc = _edge_rows(t, n, k, seed)
        got = radix_topk(sc.to(kernel_device), k, seg=seg, config=config).cpu()
        assert torch.equal(got, select_topk(sc, k)), seed


@pytest.mark.parametrize("config", COUNTING[:2], ids=["1bit", "2bit"])
def test_counting_forms_over_lists_masks_and_candidates(config, kernel_device):
    """Entry lists with -1 holes, a block map, and the candidate blocks (block maxima, the pinned newest block,
    ids expanded per block, the selection map) under the counting forms, one launch and split."""
    from redknot.kernels.triton.step_select import candidates_reference

    g = torch.Generator().manual_seed(31)
    t, n, k = 7, 900, 40
    sc = _edge_rows(t - 5, n, k, 32)
    ids = torch.sort(torch.randint(0, 9000, (t, n), generator=g), dim=1).values
    ids[torch.rand(t, n, generator=g) < 0.2] = -1
    bm = (torch.rand(t, 100, generator=g) < 0.4).to(torch.uint8)
    dev = kernel_device
    for seg in (None, 256):
        got = radix_topk(sc.to(dev), k, ids=ids.to(dev), seg=seg, config=config).cpu()
        assert torch.equal(got, topk_reference(sc, k, ids=ids)), seg
        got = radix_topk(sc.to(dev), k, block_mask=bm.to(dev), mask_block=8, seg=seg, config=config).cpu()
        assert torch.equal(got, topk_reference(sc, k, block_mask=bm, mask_block=8)), seg
    vis = torch.randint(0, n + 1, (t,), generator=g)
    vis[0] = n
    cs = sc.masked_fill(torch.arange(n)[None, :] >= vis[:, None], float("-inf"))
    for nb, seg in ((9, None), (9, 40), (200, None)):      # 200 blocks > the 113 there are: keep all
        ent, bmap = radix_candidates(cs.to(dev), vis.to(dev), nb, 8, seg=seg, config=config)
        want = candidates_reference(cs, vis, nb, 8)
        assert torch.equal(ent.cpu(), want[0]) and torch.equal(bmap.cpu(), want[1]), (nb, seg)


def test_tuner_candidates_start_with_the_default():
    """Untimed (interpreter, graph capture) the tuner runs the histogram default; every candidate is distinct."""
    from redknot.kernels.triton.radix_select import CANDIDATES, DEFAULT_CONFIG, TUNER

    assert CANDIDATES[0] == DEFAULT_CONFIG and TUNER.candidates[0] == DEFAULT_CONFIG
    assert len(set(CANDIDATES)) == len(CANDIDATES)
    assert any(c.step_bits for c in CANDIDATES)
    with pytest.raises(ValueError, match="step_bits"):
        radix_topk(torch.zeros(1, 8), 2, config=RadixSelectConfig(step_bits=3))


def test_radix_topk_edges(kernel_device):
    sc = _rows(4, 30, 3, kernel_device)
    assert radix_topk(sc, 0).shape == (4, 0)
    assert (radix_topk(sc[:, :0], 5) == -1).all()
    strided = _rows(5, 64, 4, kernel_device)[:, ::2]                # a non-contiguous row
    assert torch.equal(radix_topk(strided, 9).cpu(), select_topk(strided.cpu(), 9))
    with pytest.raises(ValueError, match="scores must be"):
        radix_topk(sc[0], 4)


def test_segment_size_and_launch_shape():
    assert segment_size(4096, 512, 8192) == 4096
    assert segment_size(1 << 19, 512, 16384) == 1 << 14            # sqrt(n k), within the resident cap
    assert segment_size(1 << 20, 512, 8192) == 8192
    assert segment_size(40000, 2048, 2048) == 4 * 2048               # k-bound: a tiled segment
    assert launch_shape(4096, 1, RadixSelectConfig()) == (4096, 8, True)
    assert launch_shape(40, 1, RadixSelectConfig()) == (256, 4, True)
    assert launch_shape(20000, 8, RadixSelectConfig()) == (512, 8, False)


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
    from redknot.kernels.triton.step_select import SELECT_ERRORS

    sc = _rows(t, n, n + t, "cuda")
    want = select_topk(sc, 512)
    got = radix_topk(sc, 512)
    assert torch.equal(got, want), _differ(got, want)
    got = topk_select(sc, 512)
    assert torch.equal(got, want), _differ(got, want)
    assert not SELECT_ERRORS, SELECT_ERRORS
    bf = (torch.randn(t, n, device="cuda") * 0.1).to(torch.bfloat16).float()   # bf16 scores: exact ties
    bf[:, n - n // 5:] = float("-inf")
    got, want = radix_topk(bf, 512), select_topk(bf, 512)
    assert torch.equal(got, want), _differ(got, want)


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two selections differ: rows, slots, the first differing slot's values, set differences."""
    bad = (got != want).any(1).nonzero().flatten().tolist()
    r = bad[0]
    g, w = got[r], want[r]
    slot = int((g != w).nonzero()[0])
    gs, ws = set(g[g >= 0].tolist()), set(w[w >= 0].tolist())
    return (f"rows {bad[:8]} differ; row {r}: {int((g != w).sum())} slots, first {slot} got {int(g[slot])} want "
            f"{int(w[slot])}; {len(gs)} / {len(ws)} valid ids, {len(ws - gs)} missing, {len(gs - ws)} extra")


@pytest.mark.gpu
def test_gpu_select_self_check_and_candidates():
    """Every radix mode passes its first-use check on the GPU; the candidate blocks at V4.1's 2048 x 8."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from redknot.kernels.triton.step_select import candidates_reference, self_check

    assert self_check(torch.device("cuda")) is None
    for n, t in ((8192, 1), (131072, 32), (1 << 20, 1)):
        sc = (torch.randn(t, n, device="cuda") * 0.1).to(torch.bfloat16).float()
        vis = torch.full((t,), n - n // 7, device="cuda")
        sc[:, n - n // 7:] = float("-inf")
        got = radix_candidates(sc, vis, 2048, 8)
        want = candidates_reference(sc, vis, 2048, 8)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n


def test_select_benchmark_smoke(tmp_path):
    """The benchmark's CPU smoke run checks both selections equal and writes its table."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "select_topk_v41.py"), "--smoke", "--out",
                          str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = (tmp_path / "select_topk_v41.md").read_text()
    assert "| 700 | 2 |" in text and "NO" not in text


def test_select_benchmark_b1_smoke(tmp_path):
    """The b1 mode's CPU smoke run: the four decode-step selections under every tuner candidate, all equal."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "select_topk_v41.py"), "--b1", "--smoke",
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = (tmp_path / "select_topk_b1.md").read_text()
    assert "b1 step sum" in text and "topk in candidate blocks" in text and "NO" not in text
