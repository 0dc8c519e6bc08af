"""The V4.1 DSpark draft through the backbone's registry ops: attached to a model with kernel ops, the
stages' kept FP8 linears run ``linear_mx`` (their MXFP4 experts ``moe_mx``) and the block forward equals
the draft's PyTorch math. On a CPU the ops resolve to the registry's reference implementations (fp32
arithmetic), so the draft runs in fp64 with FP8 activation rounding (``reference`` numerics) and the
comparison tolerates fp32 rounding.

At bf16 the Triton ops (interpreted on a CPU, compiled on a GPU) are checked call by call: every
``linear_mx`` / ``moe_mx`` call the draft's block forward makes through them is recorded (its inputs
and output) and the reference implementation of the same op is run on exactly those inputs. A
whole-block comparison is no kernel check with random weights: the random draft amplifies rounding
(its bf16 math is ~0.18 from its own fp64 evaluation), so a summation order that differs in the last
bit of one GEMM moves the block by ~0.1 on the GPU. Call by call nothing propagates: the bound is the
op's own output rounding, and the negative controls show a wrong kernel is far outside it."""
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

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


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (FP8 tensors compared as bytes: no comparison kernels for them everywhere)."""
    if a.element_size() == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


class Recorder:
    """An op that records every call: its arguments (tensors cloned before the call: the draft may reuse
    its buffers) and its output; a call that changed any of its inputs (a kernel writing where it
    should only read) is counted in ``wrote_inputs``."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.calls: List[Tuple[tuple, torch.Tensor]] = []
        self.wrote_inputs = 0

    def __call__(self, *args):
        before = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        out = self.fn(*args)
        self.wrote_inputs += any(isinstance(a, torch.Tensor) and not _same(a, b) for a, b in zip(args, before))
        self.calls.append((before, out.clone()))
        return out


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative L2 error in fp32 (inf where ``got`` is not finite)."""
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-30))


def call_errors(device: str, linear_mx: Callable, moe_mx: Callable) -> Dict[str, List[float]]:
    """Three-stage bf16 draft block through ``linear_mx`` / ``moe_mx`` (both recorded) -> per op, the
    relative error of every call's output against the reference implementation on the same inputs."""
    cfg = v41_config(n_mtp_layers=3, dspark_block_size=5, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0, 0))
    tensors = {k: v.to(device) for k, v in random_weights(cfg, 0, include_draft=True).items()}
    ops = _routed_ops({"linear_mx", "moe_mx"})
    ops.linear_mx, ops.moe_mx = Recorder(linear_mx), Recorder(moe_mx)
    model, draft = _draft(cfg, tensors, ops, torch.bfloat16, device)   # the draft holds its model weakly
    gen = torch.Generator(device=device).manual_seed(4)
    rings = [torch.randn(3, cfg.window_size, cfg.head_dim, generator=gen, device=device).to(torch.bfloat16)
             for _ in range(cfg.n_mtp_layers)]
    h, logits = draft.forward_block(torch.tensor([17, 905, 33], device=device), torch.tensor([3, 40, 9], device=device),
                                    rings, torch.tensor([2, 0, 1], device=device))
    assert torch.isfinite(h).all() and torch.isfinite(logits).all()
    ref = KernelSet(default="reference")
    n_linears = cfg.n_mtp_layers * 4   # wq_a wq_b wkv wo_b of every stage, at least (and the shared experts)
    assert len(ops.linear_mx.calls) >= n_linears and len(ops.moe_mx.calls) == cfg.n_mtp_layers
    assert ops.linear_mx.wrote_inputs == 0 and ops.moe_mx.wrote_inputs == 0
    out: Dict[str, List[float]] = {}
    for name, rec in (("linear_mx", ops.linear_mx), ("moe_mx", ops.moe_mx)):
        errs = []
        for args, got in rec.calls:
            want = getattr(ref, name)(*args)
            assert got.shape == want.shape and got.dtype == want.dtype and want.float().norm() > 0
            errs.append(rel_error(got, want))
        out[name] = errs
    return out


# Per call: the outputs are bf16 (a unit in the last place is 2^-8 relative) from fp32 sums in another
# order; an element rounds differently only near a rounding boundary, and ``moe_mx`` re-quantises its bf16
# SwiGLU rows to FP8 (a rare flip moves one element by an FP8 step). The interpreter reproduces the
# reference (CPU bound: fp32 noise). A wrong kernel (a K tile or a routed slot lost, see the negative
# controls) is off by 0.1-1.
CALL_TOL = {"cpu": 1e-3, "cuda": 1e-2}


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA device")])])
def test_draft_through_triton_ops_matches_the_reference_ops_call_by_call(device):
    """bf16, three stages: every ``linear_mx`` / ``moe_mx`` call of the draft's block forward through the
    Triton ops (the interpreter on a CPU) against the reference implementation on the same inputs."""
    pytest.importorskip("triton")
    fast = V41Ops.create(KernelSet(default="triton"))
    assert fast is not None and fast.linear_mx is not None and fast.moe_mx is not None
    errs = call_errors(device, fast.linear_mx, fast.moe_mx)
    print({op: {"calls": len(e), "max": max(e), "median": sorted(e)[len(e) // 2]} for op, e in errs.items()})
    for op, e in errs.items():
        assert max(e) <= CALL_TOL[device], (op, e)


def _lost_last_k_tile(x, weight, scale, *rest):
    """A GEMM whose K loop stops one 32-wide tile early."""
    return KernelSet(default="reference").linear_mx(torch.cat([x[..., :-32], torch.zeros_like(x[..., -32:])], -1),
                                                    weight, scale, *rest)


def _lost_last_slot(x, idx, wts, *rest):
    """A routed-expert kernel whose slot loop stops one slot early."""
    return KernelSet(default="reference").moe_mx(x, idx, torch.cat([wts[:, :-1], torch.zeros_like(wts[:, -1:])], 1),
                                                 *rest)


@pytest.mark.parametrize("broken", ["linear_mx", "moe_mx"])
def test_call_by_call_check_rejects_a_wrong_kernel(broken):
    """Negative controls: the same check with one op replaced by a plausibly wrong kernel (the reference
    implementation with an off-by-one loop bound) fails by far, on every call of that op."""
    ref = KernelSet(default="reference")
    linear = _lost_last_k_tile if broken == "linear_mx" else ref.linear_mx
    moe = _lost_last_slot if broken == "moe_mx" else ref.moe_mx
    errs = call_errors("cpu", linear, moe)
    other = "moe_mx" if broken == "linear_mx" else "linear_mx"
    assert max(errs[other]) == 0.0
    assert min(errs[broken]) > 10 * CALL_TOL["cuda"], errs[broken]
