"""The V4.1 DSpark draft through the backbone's registry ops: attached to a model with kernel ops, the
stages' kept FP8 linears run ``linear_mx`` (their MXFP4 experts ``moe_mx``) and the block forward equals
the draft's PyTorch math. On a CPU the ops resolve to the registry's reference implementations (fp32
arithmetic), so the draft runs in fp64 with FP8 activation rounding (``reference`` numerics) and the
comparison tolerates fp32 rounding. At bf16 the Triton ops (interpreted on a CPU, compiled on a GPU) are
held against the reference implementations of the same ops."""
import sys
from pathlib import Path

import pytest
import torch

from redknot.kernels import KernelSet
from redknot.models.deepseek_v41.dspark_draft import V41DSparkDraft
from redknot.models.deepseek_v41.kernel_ops import OPS, V41Ops
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from v41_forward.v41util import random_weights, token_map_for  # noqa: E402
from v41_forward.v41util import test_config as v41_config  # noqa: E402


def _routed_ops(routed):
    ops = V41Ops(KernelSet(default="reference"), route_all=True)
    for op in OPS:
        if op not in routed:
            setattr(ops, op, None)
    return ops


def _draft(cfg, tensors, ops, dtype, device="cpu"):
    num = Numerics("reference", dtype)
    backbone = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    draft = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    tmap = token_map_for(cfg)
    model = DeepseekV41(cfg, Weights(backbone, dtype, keep=True), tmap, int(tmap[cfg.engram_pad_id]), num,
                        device=device, ops=ops)
    return model, V41DSparkDraft(cfg, Weights(draft, dtype, keep=True), num, device=device).attach(model)


def _block(draft, cfg, dtype):
    gen = torch.Generator().manual_seed(4)
    win = cfg.window_size
    rings = [torch.randn(3, win, cfg.head_dim, generator=gen, dtype=torch.float64).to(dtype)
             for _ in range(cfg.n_mtp_layers)]
    anchors, positions, slots = torch.tensor([17, 905, 33]), torch.tensor([3, 40, 9]), torch.tensor([2, 0, 1])
    return draft.forward_block(anchors, positions, rings, slots)


def test_draft_linears_route_through_the_backbone_ops_and_match():
    cfg = v41_config(n_mtp_layers=2, dspark_block_size=3, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0))
    tensors = random_weights(cfg, 0, include_draft=True)
    ops = _routed_ops({"linear_mx"})
    calls = []
    linear_mx = ops.linear_mx
    ops.linear_mx = lambda *a, **k: (calls.append(a[1].shape), linear_mx(*a, **k))[1]
    model, routed = _draft(cfg, tensors, ops, torch.float64)   # the draft holds its model weakly
    model_plain, plain = _draft(cfg, tensors, None, torch.float64)
    assert routed.w.ops is ops and getattr(plain.w, "ops", None) is None
    h, logits = _block(routed, cfg, torch.float64)
    n_stage_linears = 4 + 3 + 3 * cfg.dspark_n_activated_experts   # wq_a wq_b wkv wo_b, shared + routed experts
    assert len(calls) >= cfg.n_mtp_layers * 4 and len(calls) <= cfg.n_mtp_layers * n_stage_linears * 3
    want_h, want_logits = _block(plain, cfg, torch.float64)
    scale = want_h.abs().max()
    assert (h - want_h).abs().max() <= 1e-5 * scale
    assert (logits - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()


def _triton_and_reference_ops():
    """The Triton ops a target gets, and the registry's reference implementations of the same ops."""
    fast = V41Ops.create(KernelSet(default="triton"))
    assert fast is not None and fast.linear_mx is not None and fast.moe_mx is not None
    return fast, _routed_ops({op for op in OPS if getattr(fast, op) is not None})


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])])
def test_draft_through_triton_ops_matches_the_reference_ops(device):
    """bf16, three stages: the draft through the Triton ``linear_mx`` / ``moe_mx`` (the interpreter on a
    CPU) against the same draft through the ops' reference implementations. The reference is the op
    contract, not the draft's PyTorch math: ``moe_mx`` rounds W1/W3 outputs and the weighted SwiGLU to bf16
    where the PyTorch experts keep the accumulation dtype, and this random-weight draft amplifies rounding
    (its bf16 PyTorch math is ~0.18 away from its own fp64 evaluation), so only op against op is a kernel
    check. CPU: equal to 1e-3; GPU: another summation order, relative error of the block <= 2e-2."""
    pytest.importorskip("triton")
    cfg = v41_config(n_mtp_layers=3, dspark_block_size=5, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0, 0))
    tensors = {k: v.to(device) for k, v in random_weights(cfg, 0, include_draft=True).items()}
    fast, ref = _triton_and_reference_ops()
    model, routed = _draft(cfg, tensors, fast, torch.bfloat16, device)     # the draft holds its model weakly
    model_ref, want_draft = _draft(cfg, tensors, ref, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(4)
    rings = [torch.randn(3, cfg.window_size, cfg.head_dim, generator=gen, device=device).to(torch.bfloat16)
             for _ in range(cfg.n_mtp_layers)]
    args = (torch.tensor([17, 905, 33], device=device), torch.tensor([3, 40, 9], device=device), rings,
            torch.tensor([2, 0, 1], device=device))
    h, logits = routed.forward_block(*args)
    want_h, want_logits = want_draft.forward_block(*args)
    tol = 1e-3 if device == "cpu" else 2e-2
    for got, want in ((h, want_h), (logits, want_logits)):
        assert float((got.float() - want.float()).norm() / want.float().norm()) <= tol
