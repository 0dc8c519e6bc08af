"""The eager prefill forward with the prefill row fusions (``prefill_rows_v41`` through ``fused_rows.PREFILL_ROWS``: q
and attention-output RoPE in place, the shared expert's SwiGLU, the MoE combine with the ffn site's post mix, the
final collapse, the router's tail in one launch, the selected entries' page rows in one launch, the mHC sites'
collapse in their mixing pass, the Engram hashes in two launches; and the attention output taken without a copy)
against the same forward without them, on the e2e_v41 toy cut: attention, cache inserts and indexer on their Triton
kernels (interpreter), the FP8 linears and MXFP4 experts on the registry's reference ops (fast on a CPU; the fusions
do not depend on them). A 20-row chunk, above the step kernels' 16, so the prefill paths run. The exact fusions
(RoPE, combine + post, page rows, hashes, no copy) give the same output rows and cache bytes bit for bit; with the
SwiGLU, the final collapse and the router too (another ``exp`` and summation orders) the rows stay within a bf16 ulp
of their scale; the one-pass sites' ulps are amplified by the toy model (see ``_check_all``)."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import redknot.kernels.triton.prefill_rows_v41 as pr
from redknot.models.deepseek_v41 import fused_rows

# Four interpreted toy prefill forwards (~170 s on 2 cores): -m slow; on a GPU the same at 200 rows, -m gpu. Each
# kernel is held against its PyTorch math in tests/unit/kernels/test_prefill_rows_v41.py (default run) and on the GPU.
EXACT = ("rope_cols", "add_post", "page_entries", "hashes")


def _model(dev: torch.device):
    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))
    import e2e_v41

    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    cfg = e2e_v41.cut_config(True, 100)
    ops = V41Ops(KernelSet(default="triton"))
    ref = V41Ops(KernelSet(default="reference"), route_all=True)
    for op in ("linear_mx", "moe_mx"):                 # GEMMs on the reference ops: the row fusions are the subject
        setattr(ops, op, getattr(ref, op))
        ops.choice[op] = "reference"
    return e2e_v41, cfg, e2e_v41.build(cfg, e2e_v41.random_tensors(cfg, dev), "reference", ops, dev)


def _runs(dev: torch.device, rows: int):
    e2e_v41, cfg, model = _model(dev)
    ids = e2e_v41.tokens(rows, cfg.vocab_size, 1)
    out, calls = {}, {}
    saved = dict(fused_rows.PREFILL_ROWS)
    import redknot.kernels.triton.prefill_hash_v41 as ph
    import redknot.kernels.triton.step_mhc_v41 as mh
    import redknot.kernels.triton.step_moe_v41 as sm

    mods = {"rope_cols_": pr, "swiglu_rows": pr, "add_post": pr, "collapse_rows": pr, "route_topk": sm,
            "page_entries": pr, "_site_pre_one_pass": mh, "prefill_hashes": ph}
    real = {n: getattr(m, n) for n, m in mods.items()}
    try:
        for name, on in (("off", ()), ("exact", EXACT), ("ulp", tuple(k for k in saved if k != "mhc_one_pass")),
                         ("all", tuple(saved))):
            for k in fused_rows.PREFILL_ROWS:
                fused_rows.PREFILL_ROWS[k] = k in on
            count = calls[name] = {n: 0 for n in real}
            for n, fn in real.items():
                def counted(*a, _fn=fn, _n=n, _c=count, **k):
                    _c[_n] += 1
                    return _fn(*a, **k)
                setattr(mods[n], n, counted)
            b = e2e_v41.Batch(model, 1, rows + 16, block_size=16)
            x = b.step([ids], seqs=[0])
            assert not fused_rows._FAILED, fused_rows._FAILED   # no fused launch fell back to the PyTorch math
            out[name] = (x, [t.clone() for t in b.state.tensors()])
    finally:
        fused_rows.PREFILL_ROWS.update(saved)
        for n, fn in real.items():
            setattr(mods[n], n, fn)
    return cfg, out, calls


@pytest.fixture(scope="module")
def runs():
    return _runs(torch.device("cpu"), 20)


def _check_exact(runs):
    cfg, out, calls = runs
    assert sum(calls["off"].values()) == 0, calls["off"]
    n = cfg.n_layers
    c = calls["exact"]
    assert c["rope_cols_"] == 2 * n and c["add_post"] == c["page_entries"] == n, c   # every toy layer reads entries
    assert c["prefill_hashes"] == 1, c                                               # the step's Engram hashes
    (x, sx), (y, sy) = out["exact"], out["off"]
    assert torch.equal(x, y)
    for a, b in zip(sx, sy):
        assert torch.equal(a, b)


def _check_ulp(runs, worst: float = 2 ** -7):
    """Every fusion but the one-pass mHC sites: ``worst`` is the largest row error allowed (relative to the row's
    max); most rows stay within a bf16 ulp."""
    cfg, out, calls = runs
    n = cfg.n_layers
    c = calls["ulp"]
    assert c["rope_cols_"] == 2 * n and c["add_post"] == n and c["collapse_rows"] == 1, c
    assert c["swiglu_rows"] == n and c["route_topk"] == n, c         # the shared expert's, the router: per layer
    assert c["_site_pre_one_pass"] == 0, c
    (x, _), (y, _) = out["ulp"], out["off"]
    err = (x.float() - y.float()).abs().amax(1) / y.float().abs().amax(1)
    assert err.max().item() <= worst, err.max().item()
    assert err.median().item() <= 2 ** -7, err.median().item()


def _check_all(runs, median: float = 0.05, worst: float = 0.25):
    """With the one-pass sites too. Their collapse differs from the two-pass one by an ulp in a few values (held
    tightly in test_step_mhc_v41.py), which the toy model's indexer selections and FP8 roundings amplify from the
    first row with more visible entries than it keeps (measured here: up to 7 % of a row's max under reference
    numerics, 8 % under bf16): this run checks that every site took the one-pass path and the rows stay near."""
    cfg, out, calls = runs
    assert calls["all"]["_site_pre_one_pass"] == 2 * cfg.n_layers, calls["all"]
    (x, _), (y, _) = out["all"], out["off"]
    assert torch.isfinite(x).all()
    err = (x.float() - y.float()).abs().amax(1) / y.float().abs().amax(1)
    assert err.median().item() <= median and err.max().item() <= worst, err


@pytest.mark.slow
def test_exact_fusions_equal_the_forward_without_them(runs):
    _check_exact(runs)


@pytest.mark.slow
def test_fusions_but_one_pass_sites_within_a_bf16_ulp(runs):
    _check_ulp(runs)


@pytest.mark.slow
def test_all_fusions_near_the_forward_without_them(runs):
    _check_all(runs)


@pytest.mark.gpu
def test_gpu_prefill_rows_forward():
    """The same on the GPU (compiled kernels, libdevice ``exp``) with a 200-row chunk. The router's weight sum in
    another order can flip an FP8 rounding downstream, so a few rows may move by more than an ulp there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    got = _runs(torch.device("cuda"), 200)
    _check_exact(got)
    _check_ulp(got, worst=6e-2)   # an FP8 / expert choice flip after an ulp (the e2e parity bound under reference)
    # 200 rows carry the amplified ulps further than 20: an H100 (2026-12-06) measured a row-error median of 0.053
    # and a worst row of 0.56; the interpreter at 64 rows 0.025 / 0.20, with rows 35-44 exact (the differences
    # start in the sites' own rows, not in a state gone astray). The one-pass collapse's bits are held tightly in
    # test_step_mhc_v41; this bound only catches a site far off.
    _check_all(got, median=0.08, worst=0.75)
