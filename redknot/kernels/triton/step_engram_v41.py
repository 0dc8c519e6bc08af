"""V4.1's Engram gate in one launch: ``h + σ(signed-sqrt(normalised q·k dot)) · value`` per (token, stream).

The PyTorch math (``engram.engram_gate``) is ~25 small launches per Engram layer (the fp32 cast of the
projection, the q·k weight product, two RMS statistics, the dot, sign / sqrt / clamp / sigmoid, the
broadcast add and the cast back). :func:`engram_gate_rows` does it in one program per (token, stream): it
reads the stream's row of ``h``, the stream's key and the shared value straight from the projection's output
(keys first, then the value, as ``engram.engram_forward`` splits it) and the two gate weights, all in fp32.

Bits: the products, the normalisation and the gate follow the PyTorch order of operations; the two means and
the dot sum in another order, so the gate may differ by a few fp32 ulps and the output by one ulp of its
16-bit dtype where the sum lands near a rounding boundary (the tests bound both).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import next_pow2


@triton.jit
def _engram_gate(h_ptr, kv_ptr, qw_ptr, kw_ptr, mask_ptr, out_ptr, HC, D, stride_ht, stride_hs, stride_kv,
                 stride_ot, stride_os, eps, inv_sqrt_d, MASK: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    c = tl.arange(0, BLOCK_D)
    m = c < D
    hf = tl.load(h_ptr + t * stride_ht + s * stride_hs + c, mask=m, other=0.0).to(tl.float32)
    key = tl.load(kv_ptr + t * stride_kv + s * D + c, mask=m, other=0.0).to(tl.float32)
    value = tl.load(kv_ptr + t * stride_kv + HC * D + c, mask=m, other=0.0).to(tl.float32)
    qk = tl.load(qw_ptr + s * D + c, mask=m, other=0.0) * tl.load(kw_ptr + s * D + c, mask=m, other=0.0)
    dot = tl.sum(hf * qk * key, 0)
    h_ms = tl.sum(hf * hf, 0) / D
    k_ms = tl.sum(key * key, 0) / D
    dot = dot * tl.rsqrt(h_ms + eps) * tl.rsqrt(k_ms + eps) * inv_sqrt_d
    sgn = tl.where(dot > 0, 1.0, tl.where(dot < 0, -1.0, 0.0))
    z = sgn * tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = 1.0 / (1.0 + tl.exp(-z))
    if MASK:
        gate = gate * tl.load(mask_ptr + t).to(tl.float32)
    y = hf + gate * value
    tl.store(out_ptr + t * stride_ot + s * stride_os + c, y.to(out_ptr.dtype.element_ty), mask=m)


def engram_gate_rows(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h [T, hc, D] (16-bit) + gate · value -> [T, hc, D] in h's dtype. kv [T, (hc+1)·D]: the Engram
    projection's output (hc keys, then the value shared by the streams); q_weight / k_weight [hc, D] fp32;
    token_mask [T] (0: no Engram on that token) or None."""
    t, hc, d = h.shape
    if kv.shape != (t, (hc + 1) * d) or q_weight.shape != (hc, d) or k_weight.shape != (hc, d):
        raise ValueError(f"engram_gate_rows: h {tuple(h.shape)} needs kv [{t}, {(hc + 1) * d}] and gate weights "
                         f"[{hc}, {d}]; got kv {tuple(kv.shape)}, q {tuple(q_weight.shape)}, k {tuple(k_weight.shape)}")
    out = torch.empty_like(h)
    if t == 0:
        return out
    if h.stride(-1) != 1:
        h = h.contiguous()
    kv = kv if kv.stride(-1) == 1 else kv.contiguous()
    qw, kw = q_weight.float().contiguous(), k_weight.float().contiguous()
    mask = token_mask if token_mask is not None else qw
    _engram_gate[(t, hc)](h, kv, qw, kw, mask, out, hc, d, h.stride(0), h.stride(1), kv.stride(0), out.stride(0),
                          out.stride(1), eps, d ** -0.5, MASK=token_mask is not None, BLOCK_D=next_pow2(d),
                          num_warps=4 if d <= 2048 else 8)
    return out
