"""Inputs and the per-linear reference shared by the ``step_proj_v41`` tests (``test_step_proj_v41.py``,
``test_step_proj_gemv_v41.py``)."""
import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton import gemm_mx
from redknot.kernels.triton.step_rope_v41 import rope_rows


def fp8_weight(n, k, g, device):
    """A random [n, k] weight as FP8 with per-32 x 32 tile scales (the first 32 columns of another scale)."""
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :32] *= 16                                        # tiles of other scales
    q, s = mx.quant_fp8_blocks(w, 32)
    return q.to(device), s.to(device)


def reference(x, spec, cos, sin, decode="fp8"):
    """The launches a fused projection stands for: ``linear_mx`` with the ``decode`` weight stream, then
    ``rope_rows`` (norm, RoPE where ``spec.rope``, FP4 grid where ``spec.qdq``)."""
    y = gemm_mx.linear_mx(x, spec.weight, spec.scale, 32, decode=decode, path="splitk")
    c, s = (cos, sin) if spec.rope else (cos[:, :0], sin[:, :0])
    return rope_rows(y.view(x.shape[0], spec.heads, spec.dim), c, s, norm_w=spec.norm_w, eps=spec.eps,
                     qdq=spec.qdq)
