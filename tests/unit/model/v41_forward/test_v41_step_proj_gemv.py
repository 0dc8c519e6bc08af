"""The tensor step with the fused linears' 1-4-row GEMV stream forced (``step_proj_v41.FORCE_SMALL``) on the e2e_v41
toy cut, every V4.1 op on its Triton kernel (interpreter), one decode row: the fused launches ran the GEMV
(``gemv_partials``), the step's output and every cache byte equal bit for bit the per-linear step whose
``linear_mx`` calls take the same GEMV decode (``linear_mx`` + row kernels + ``site_post``, the launches the fused
ones stand for), and the output is within 2 % of the step with the ``fp8`` stream (the same exact products summed in
another order; equal at the toy sizes when no bf16 rounding flips) and no further from the PyTorch step (every op
on its reference) than that step. The tensor step is the graph-free form of the graph step (the same functions
run under capture); with the small-row class off the fused launches take ``fp8`` again."""
import copy
import os

import pytest
import torch

pytest.importorskip("triton")
os.environ.setdefault("TRITON_INTERPRET", "1")

from redknot.kernels import tuning_cache
from redknot.kernels.triton import gemm_mx
from redknot.kernels.triton import step_proj_v41 as sp
from redknot.models.deepseek_v41 import fused_rows
from .v41util import toy_cut


@pytest.mark.slow  # three toy steps through every kernel interpreted (~75 s); each GEMV launch is held bit for bit
# against what it stands for in tests/unit/kernels/test_step_proj_gemv_v41.py (default run) and on the GPU
def test_step_with_gemv_equals_per_linear_gemv_step(monkeypatch):
    import redknot.models.deepseek_v41.tensor_step as ts

    cfg, model, b, step = toy_cut(monkeypatch)
    twin, fp8_state = copy.deepcopy(b.state), copy.deepcopy(b.state)
    monkeypatch.setattr(sp, "FORCE_SMALL", "gemv")
    monkeypatch.setattr(gemm_mx.LINEAR_SMALL_TUNER, "pick", lambda key, run, device: "gemv")  # the other linears
    ran = []
    real = sp.gemv_partials

    def counted(*a, **k):
        ran.append(a[3])
        return real(*a, **k)
    monkeypatch.setattr(sp, "gemv_partials", counted)
    got = ts.tensor_forward(model, step, b.state)
    assert len(ran) >= 3 * cfg.n_layers and set(ran) == {"gemv"}, ran   # q_kv (2), wo_b + post per layer

    # the per-linear step: linear_mx at 1-4 rows takes the same GEMV decode
    for name in ("q_kv_rows", "linear_rows", "linear_post_rows"):
        monkeypatch.setattr(fused_rows, name, lambda *a, **k: None)
    real_moe = ts.moe_step_kernels

    def moe_unmixed(u, w, prefix, cfg, num, mix=None):
        out = real_moe(u, w, prefix, cfg, num)
        return out if out is None or mix is None else (out, False)
    monkeypatch.setattr(ts, "moe_step_kernels", moe_unmixed)
    want = ts.tensor_forward(model, step, twin)
    assert torch.equal(got, want)
    for x, y in zip(b.state.tensors(), twin.tensors()):
        assert torch.equal(x, y)
    monkeypatch.undo()

    # the fp8 stream (the small-row class off): the same products in another order, within the op tolerance
    ran.clear()
    monkeypatch.setattr(sp, "FORCE_SMALL", "gemv")
    monkeypatch.setattr(sp, "gemv_partials", counted)
    before = tuning_cache.small_rows_class()
    tuning_cache.use_small_rows_class(False)
    try:
        fp8 = ts.tensor_forward(model, step, fp8_state)
    finally:
        tuning_cache.use_small_rows_class(before)
    assert not ran

    # the PyTorch step (every op on its reference): the GEMV step within the op tolerance, as close as the fp8 one
    _, ref_model, rb, _ = toy_cut(monkeypatch, "reference")
    ref = ts.tensor_forward(ref_model, step, rb.state).float()

    def rel(a):
        return ((a.float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"GEMV step vs PyTorch {rel(got):.3g}, fp8 step vs PyTorch {rel(fp8):.3g}")
    # the toy cut amplifies the kernels' roundings through its indexer selections (here ~0.19 for both steps): the
    # GEMV step is no further from the PyTorch step than the fp8 step (the op tolerance itself: the kernel tests)
    assert rel(got) <= 1.05 * rel(fp8) + 1e-3, (rel(got), rel(fp8))
    assert ((got.float() - fp8.float()).norm(dim=-1) / fp8.float().norm(dim=-1)).max().item() < 2e-2
