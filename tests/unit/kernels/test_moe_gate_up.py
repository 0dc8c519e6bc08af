"""The routed experts' gate and up projections as one grouped GEMM (``moe.gate_up_stack``,
``Experts.fuse_gate_up``): where each expert's w3 rows follow its w1 rows in one storage, a prefill-sized MoE runs
one ``[T·k, 2I]`` grouped GEMM instead of two. Checked on fresh random experts: the same rows as the two GEMMs
(the path counted, so the test sees which one ran), the stack recognised only where the layout holds, and the
model's fused parameters keeping their names, values and loads."""
import copy

import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import KernelSet
from redknot.kernels.triton import moe
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.moe import Experts, SharedExpert
from redknot.models.deepseek_v4.synthetic import (
    TINY_ARCHITECTURE,
    randomize_,
    synthetic_config,
)


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _stacked(w1, w3):
    inter = w1.shape[1]
    stack = torch.cat([w1, w3], dim=1)
    return stack[:, :inter], stack[:, inter:]


def test_the_stack_is_recognised_only_where_w3_follows_w1_in_one_storage():
    g = torch.Generator().manual_seed(0)
    w1, w3 = torch.randn(3, 8, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    assert moe.gate_up_stack(w1, w3) is None                      # two storages
    f1, f3 = _stacked(w1, w3)
    stack = moe.gate_up_stack(f1, f3)
    assert stack is not None and stack.shape == (3, 16, 16)
    assert torch.equal(stack[:, :8], w1) and torch.equal(stack[:, 8:], w3)
    assert moe.gate_up_stack(f3, f1) is None                      # w3 first: the halves would swap
    other = torch.cat([w1, w3, w3], dim=1)                        # rows in between: strides differ
    assert moe.gate_up_stack(other[:, :8], other[:, 8:16]) is None
    assert moe.gate_up_stack(f1, f3.clone()) is None
    s1, s3 = _stacked(w1[:1], w3[:1])                             # one expert's [I, D] halves (the shared expert)
    assert torch.equal(moe.gate_up_stack(s1[0], s3[0]), torch.cat([w1[0], w3[0]]))
    assert moe.gate_up_stack(w1[0], w3[0]) is None and moe.gate_up_stack(s3[0], s1[0]) is None


@pytest.mark.parametrize("tokens,k,limit,dtype", [(9, 2, None, torch.bfloat16), (33, 3, 0.7, torch.bfloat16),
                                                  (20, 4, 6.0, torch.float32)])
def test_one_gate_up_gemm_gives_the_rows_of_two(tokens, k, limit, dtype, kernel_device, monkeypatch):
    seed = _fresh_seed()
    g = torch.Generator().manual_seed(seed)
    e, inter, d = 6, 40, 48
    w1 = (torch.randn(e, inter, d, generator=g) * d ** -0.5).to(dtype)
    w3 = (torch.randn(e, inter, d, generator=g) * d ** -0.5).to(dtype)
    w2 = (torch.randn(e, d, inter, generator=g) * inter ** -0.5).to(dtype)
    x = torch.randn(tokens, d, generator=g).to(dtype)
    ids = torch.rand(tokens, e, generator=g).topk(k, -1).indices
    wts = torch.rand(tokens, k, generator=g) + 0.1
    dev = kernel_device
    x, ids, wts, w1, w2, w3 = (t.to(dev) for t in (x, ids, wts, w1, w2, w3))
    calls = []
    real = moe.grouped_linear
    monkeypatch.setattr(moe, "grouped_linear", lambda a, w, *r: calls.append(w.shape[1]) or real(a, w, *r))
    two = moe.moe_experts(x, ids, wts, w1, w2, w3, limit)
    assert calls == [inter, inter, d]
    calls.clear()
    f1, f3 = _stacked(w1, w3)
    one = moe.moe_experts(x, ids, wts, f1, w2, f3, limit)
    assert calls == [2 * inter, d]
    # the same products; a library GEMM of twice the width may sum in another order: the rows agree to rounding
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(one, two, **tol)
    swapped = moe.moe_experts(x, ids, wts, f3, w2, f1, limit)   # the stack's halves are not interchangeable
    assert not torch.allclose(swapped.float(), two.float(), rtol=0.1, atol=0.1)
    # one expert (the shared expert's path): one GEMM for both halves, the same rows as two
    shared = moe.one_expert_rows(x, f1[2], w2[2], f3[2], limit)
    torch.testing.assert_close(shared, moe.one_expert_rows(x, w1[2], w2[2], w3[2], limit), **tol)


def test_the_model_fuses_its_float_experts_and_keeps_names_values_and_loads(kernel_device):
    """``fuse_projections`` stacks every routed and shared expert's gate and up weights: the state dict keeps its
    names and values, every layer's MoE gives the same rows through the kernels (80 rows: past the GEMV streams),
    an in-place load writes into the stack, and a restack (``keep_only``) makes the halves separate again."""
    cfg = synthetic_config(TINY_ARCHITECTURE, quantize_fp8=False)
    plain = DeepseekV4(cfg, torch.float32, device="cpu", kernels=KernelSet(), with_mtp=False)
    randomize_(plain, seed=_fresh_seed() % 1000)
    plain = plain.to(kernel_device)
    fused = copy.deepcopy(plain)
    fused.fuse_projections()
    experts = [m for m in fused.modules() if isinstance(m, Experts)]
    shared = [m for m in fused.modules() if isinstance(m, SharedExpert)]
    assert experts and all(moe.gate_up_stack(m.w1, m.w3) is not None for m in experts)
    assert shared and all(moe.gate_up_stack(m.w1.weight, m.w3.weight) is not None for m in shared)
    assert all(m.fuse_gate_up() == 0 for m in experts + shared)   # once only
    a, b = plain.state_dict(), fused.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    ks = KernelSet("triton")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(80, cfg.hidden_size, generator=g).to(kernel_device)
    ids = torch.randint(0, cfg.vocab_size, (80,), generator=g).to(kernel_device)
    for lp, lf in zip(plain.layers, fused.layers):
        torch.testing.assert_close(lf.ffn(ks, x, ids), lp.ffn(ks, x, ids), rtol=1e-5, atol=1e-5)
    ex = experts[0]
    fresh = torch.randn_like(ex.w3)
    ex.w3.data.copy_(fresh)                                      # an in-place load writes into the stack
    assert torch.equal(moe.gate_up_stack(ex.w1, ex.w3)[:, ex.w1.shape[1]:], fresh)
    ex.keep_only([1, 0])                                          # a restack: separate again, still right
    assert moe.gate_up_stack(ex.w1, ex.w3) is None and torch.equal(ex.w3[1], fresh[0])
