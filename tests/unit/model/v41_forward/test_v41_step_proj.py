"""The tensor step's q / kv projections in four launches (``fused_rows.q_kv_rows``, the index sources'
indexer query in the same launches), ``wo_b`` with the mHC post mix in two (``fused_rows.linear_post_rows``),
the Engram ``wkv`` in two (``fused_rows.linear_rows``) and the MoE's last launch with the post mix, against the
per-linear path (``linear_mx`` + row kernels + ``site_post``) on the e2e_v41 toy cut with every V4.1 op on its
Triton kernel (interpreter): the step's output rows and every cache byte equal bit for bit (off the GPU the
linear tuner takes the ``fp8`` decode, whose bits the fused launches reproduce), and the fused paths ran."""
import copy
import os

import pytest
import torch

pytest.importorskip("triton")
os.environ.setdefault("TRITON_INTERPRET", "1")

from redknot.models.deepseek_v41 import fused_rows  # noqa: E402
from .v41util import toy_cut  # noqa: E402


@pytest.mark.slow  # two toy steps through every kernel interpreted (~70 s); each fused kernel is held bit for bit
# against what it replaces in tests/unit/kernels/test_step_proj_v41.py (default run) and on the GPU
def test_q_kv_rows_equal_the_per_linear_step(monkeypatch):
    import redknot.models.deepseek_v41.tensor_step as ts

    cfg, model, b, step = toy_cut(monkeypatch)
    twin = copy.deepcopy(b.state)
    calls = {"q_kv_rows": [], "linear_rows": [], "linear_post_rows": []}
    for name in calls:
        def counted(*a, _real=getattr(fused_rows, name), _name=name, **k):
            got = _real(*a, **k)
            calls[_name].append(got is not None)
            return got
        monkeypatch.setattr(fused_rows, name, counted)
    real_moe, moe_mixed = ts.moe_step_kernels, []

    def moe_counted(*a, **k):
        got = real_moe(*a, **k)
        moe_mixed.append(got is not None and got[1])
        return got

    def moe_unmixed(u, w, prefix, cfg, num, mix=None):
        got = real_moe(u, w, prefix, cfg, num)
        return got if got is None or mix is None else (got, False)
    monkeypatch.setattr(ts, "moe_step_kernels", moe_counted)
    got = ts.tensor_forward(model, step, b.state)
    assert len(moe_mixed) == cfg.n_layers and all(moe_mixed), moe_mixed   # the MoE's last launch ran the post mix
    engram = sum(cfg.is_engram(i) for i in range(cfg.n_layers))          # wkv per Engram layer
    assert len(calls["q_kv_rows"]) == len(calls["linear_post_rows"]) == cfg.n_layers, calls   # wo_b + post mix
    assert len(calls["linear_rows"]) == engram > 0, calls
    assert all(all(c) for c in calls.values()), calls
    for name in calls:
        monkeypatch.setattr(fused_rows, name, lambda *a, **k: None)
    monkeypatch.setattr(ts, "moe_step_kernels", moe_unmixed)
    want = ts.tensor_forward(model, step, twin)
    assert torch.equal(got, want)
    for x, y in zip(b.state.tensors(), twin.tensors()):
        assert torch.equal(x, y)
