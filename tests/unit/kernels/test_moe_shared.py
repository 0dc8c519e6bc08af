"""``moe_shared`` (the routed experts plus the shared expert as one op): at 1-4 bf16 rows the Triton backend runs the
shared expert inside the routed experts' two GEMV launches (``gemv_bf16.moe_gemv(shared=...)``). Checked on
fresh random experts: bit for bit the two GEMV calls of the same plan added as bf16 rows (the model's former
path), within bf16 rounding of the reference op, a token alone gives its bits among the others, the clamp acts
on the shared expert, the op's choice of path, and the V4 MoE layer's output through the op against its two
calls."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import KernelSet, ref_moe
from redknot.kernels.triton import gemv_bf16, moe
from redknot.kernels.triton import ops as triton_ops


def _experts(e, inter, d, tokens, k, seed, device):
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s, scale: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16).to(device)  # noqa: E731
    w1, w3, w2 = bf(e, inter, d, scale=d ** -0.5), bf(e, inter, d, scale=d ** -0.5), bf(e, d, inter, scale=inter ** -0.5)
    s1, s3, s2 = bf(inter, d, scale=d ** -0.5), bf(inter, d, scale=d ** -0.5), bf(d, inter, scale=inter ** -0.5)
    x = bf(tokens, d, scale=1.0)
    ids = torch.rand(tokens, e, generator=g).topk(k, -1).indices.to(device)
    wts = (torch.rand(tokens, k, generator=g) + 0.1).to(device)
    return x, ids, wts, (w1, w2, w3), (s1, s2, s3)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _ones(t, device):
    return torch.zeros(t, 1, dtype=torch.long, device=device), torch.ones(t, 1, device=device)


@pytest.mark.parametrize("plan", ["bgemv", "bgemv_n2"])
@pytest.mark.parametrize("tokens,k,limit", [(1, 3, None), (3, 2, 0.6), (4, 4, 8.0)])
def test_shared_in_the_routed_launches_equals_two_calls(plan, tokens, k, limit, kernel_device):
    x, ids, wts, (w1, w2, w3), (s1, s2, s3) = _experts(7, 48, 96, tokens, k, tokens * 10 + k, kernel_device)
    p = gemv_bf16.PLANS[plan]
    got = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, limit, plan=p, shared=(s1, s2, s3))
    routed = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, limit, plan=p)
    zi, ow = _ones(tokens, kernel_device)
    shared = gemv_bf16.moe_gemv(x, zi, ow, s1[None], s2[None], s3[None], limit, plan=p)
    assert torch.equal(got, routed + shared)
    if limit is not None:  # the reference op clamps: compare where it does
        want = ref_moe.moe_shared(x, ids, wts, w1, w2, w3, limit, None, None, None, s1, s2, s3, None, None, None,
                                  zi, ow)
        assert _rel(got, want) <= 8e-3
    for t in range(tokens):
        alone = gemv_bf16.moe_gemv(x[t:t + 1], ids[t:t + 1], wts[t:t + 1], w1, w2, w3, limit, plan=p,
                                   shared=(s1, s2, s3))
        assert torch.equal(alone, got[t:t + 1])


def test_the_shared_expert_is_clamped(kernel_device):
    """Large rows: a fused shared expert without the clamp differs by O(1) from the reference."""
    x, ids, wts, (w1, w2, w3), (s1, s2, s3) = _experts(4, 32, 64, 2, 2, 5, kernel_device)
    x = x * 64
    zi, ow = _ones(2, kernel_device)
    got = gemv_bf16.moe_gemv(x, ids, wts, w1, w2, w3, 1.0, shared=(s1, s2, s3))
    want = ref_moe.moe_shared(x, ids, wts, w1, w2, w3, 1.0, None, None, None, s1, s2, s3, None, None, None, zi, ow)
    assert _rel(got, want) <= 8e-3


def test_the_op_fuses_only_where_the_routed_experts_take_the_gemv(kernel_device, monkeypatch):
    x, ids, wts, (w1, w2, w3), (s1, s2, s3) = _experts(5, 32, 64, 2, 2, 9, kernel_device)
    zi, ow = _ones(2, kernel_device)
    args = (x, ids, wts, w1, w2, w3, 4.0, None, None, None, s1, s2, s3, None, None, None, zi, ow)
    want = ref_moe.moe_shared(*args)
    calls = []
    real = gemv_bf16.moe_gemv
    monkeypatch.setattr(gemv_bf16, "moe_gemv", lambda *a, **kw: calls.append(kw.get("shared") is not None)
                        or real(*a, **kw))
    monkeypatch.setattr(moe, "gemv_plan", lambda *a: gemv_bf16.PLANS["bgemv"])
    fused = triton_ops.moe_shared(*args)
    assert calls == [True] and _rel(fused, want) <= 8e-3
    calls.clear()
    monkeypatch.setattr(moe, "gemv_plan", lambda *a: None)  # the library GEMMs won: two calls of the moe op
    two = triton_ops.moe_shared(*args)
    assert calls == [] and _rel(two, want) <= 8e-3


def test_the_v4_moe_layer_runs_one_op_with_the_same_rows(monkeypatch):
    """The layer's output through ``moe_shared`` (reference kernels) is its two calls added, bit for bit; a kernel
    set whose ``moe`` and ``moe_shared`` resolve to different backends keeps the two calls."""
    from redknot.models.deepseek_v4.moe import MoE
    from redknot.models.deepseek_v4.params import ParamFactory
    from redknot.models.deepseek_v4.synthetic import TINY_ARCHITECTURE, synthetic_config

    cfg = synthetic_config(TINY_ARCHITECTURE, quantize_fp8=False)
    layer = MoE(ParamFactory(cfg, torch.float32, device="cpu"), cfg, hash_layer=False)
    g = torch.Generator().manual_seed(4)
    for t in list(layer.parameters()) + list(layer.buffers()):
        t.data.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    ks = KernelSet()
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.zeros(5, dtype=torch.long)
    seen = []
    real = ref_moe.moe_shared
    monkeypatch.setitem(ks._impl, "moe_shared", lambda *a: seen.append(1) or real(*a))
    got = layer(ks, x, ids)
    assert seen == [1]
    two = layer._routed(ks, x, ids) + layer._shared(ks, x)
    assert torch.equal(got, two)
    ks.choice["moe_shared"] = "elsewhere"
    seen.clear()
    assert torch.equal(layer(ks, x, ids), two) and seen == []

    class Wrapped:  # a stand-in that wraps every attribute as a call (a profiler's): no ``choice`` table to read
        def __getattr__(self, name):
            fn = getattr(ks, name)
            return lambda *a, **k: fn(*a, **k)
    assert torch.equal(layer(Wrapped(), x, ids), two)


@pytest.mark.parametrize("tokens,k,limit,dtype", [(5, 2, None, torch.bfloat16), (9, 3, 0.6, torch.bfloat16),
                                                  (33, 4, 8.0, torch.bfloat16), (6, 2, 1.5, torch.float32)])
def test_shared_rows_in_the_routed_combine_equal_the_composition(tokens, k, limit, dtype, kernel_device):
    """Past the GEMV streams' 4 rows the op runs the shared expert's three GEMMs and adds its weighted rows in the
    routed experts' combine: bit for bit the backend's ``moe`` of each, added as rows of x's dtype (the shared
    weights here not all one, so the weighting is exercised too)."""
    x, ids, wts, (w1, w2, w3), (s1, s2, s3) = _experts(7, 48, 96, tokens, k, 3 * tokens + k, kernel_device)
    x, w1, w2, w3, s1, s2, s3 = (t.to(dtype) for t in (x, w1, w2, w3, s1, s2, s3))
    zi = torch.zeros(tokens, 1, dtype=torch.long, device=kernel_device)
    sw = torch.rand(tokens, 1, generator=torch.Generator().manual_seed(tokens)).to(kernel_device) + 0.5
    args = (x, ids, wts, w1, w2, w3, limit, None, None, None, s1, s2, s3, None, None, None, zi, sw)
    seen = []
    real = moe.moe_shared_rows
    got = triton_ops.moe_shared(*args)
    want = ref_moe.moe_shared_with(triton_ops.moe_op, *args)
    assert torch.equal(got, want)
    import unittest.mock as um
    with um.patch.object(moe, "moe_shared_rows", lambda *a: seen.append(1) or real(*a)):
        triton_ops.moe_shared(*args)
    assert seen == [1]   # this path, not the composition
    if limit is not None:  # the reference op clamps: compare where it does
        assert _rel(got, ref_moe.moe_shared(*args)) <= (8e-3 if dtype == torch.bfloat16 else 1e-5)
