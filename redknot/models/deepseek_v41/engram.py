"""Engram of V4.1 (reference §3.2): table lookup of hashed n-grams and the signed-sqrt gate.

Runs on the full hc stream before the layer's block. Row ids come from
:class:`redknot.models.deepseek_v41.engram_hash.EngramHasher` (exact int64); the
table rows are FP8 e4m3 with one E8M0 scale per 32 columns of a row; ``wkv``'s
output is split keys first (one key per stream) and one value shared by the streams.
"""
from __future__ import annotations

import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.kernel_ops import ops_of
from redknot.models.deepseek_v41.ref_math import Numerics, Weights, acc_dtype, linear


def table_rows(w: Weights, prefix: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantised table rows ids [T, n] -> [T, n, head_dim] (e4m3 · 2^(e8m0 - 127) per 32 columns).
    A placed table (``w.engram_lookup``, :mod:`parallel`: sharded over ranks or in host memory)
    gives the stored bytes of the rows wherever they live."""
    lookup = getattr(w, "engram_lookup", None)
    if lookup is not None:
        q, s = lookup(prefix, ids.reshape(-1))
        return mx.dequant_fp8_groups(q, s, mx.MX_GROUP, dtype).view(*ids.shape, -1)
    ops = ops_of(w)
    rows = None if ops is None else ops.engram_rows(w, prefix, ids, dtype)
    if rows is not None:
        return rows
    table = w.raw(f"{prefix}.embed.weight")
    scale = w.raw(f"{prefix}.embed.scale")
    flat = ids.reshape(-1)
    rows = mx.dequant_fp8_groups(table.view(torch.uint8)[flat], scale.view(torch.uint8)[flat],
                                mx.MX_GROUP, dtype)                   # [T*n, hd]
    return rows.view(*ids.shape, -1)


def engram_gate(h: torch.Tensor, key: torch.Tensor, value: torch.Tensor, qk: torch.Tensor,
                eps: float, token_mask=None) -> torch.Tensor:
    """h [T, hc, D] + gate·value, gate per (token, stream) = σ(signed-sqrt(normalised dot))."""
    a = key.dtype
    hf = h.to(a)
    d = h.shape[-1]
    dot = (hf * qk.unsqueeze(0) * key).sum(-1)                              # [T, hc]
    dot = dot * torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps) * d ** -0.5
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
    if token_mask is not None:
        gate = gate * token_mask.to(a).unsqueeze(-1)
    return (hf + gate.unsqueeze(-1) * value.unsqueeze(1)).to(h.dtype)


def _fused_gate(w: Weights, h: torch.Tensor, kv: torch.Tensor) -> bool:
    """The gate runs :mod:`redknot.kernels.triton.step_engram_v41` where the row epilogues run Triton
    (``fused_rows.fused``: the attention ops on Triton, 16-bit rows) and the gate math is fp32."""
    return (fused_rows.fused(w, h) and kv.dtype == h.dtype and acc_dtype(h.dtype) == torch.float32)


def engram_forward(h: torch.Tensor, ids: torch.Tensor, w: Weights, layer: int, num: Numerics, eps: float,
                   token_mask=None) -> torch.Tensor:
    """Apply layer ``layer``'s Engram to h [T, hc, D] given its row ids [T, n_cols]."""
    prefix = f"layers.{layer}.engram"
    t, hc, d = h.shape
    rows = table_rows(w, prefix, ids, num.dtype).reshape(t, -1)             # [T, n_cols*hd]
    kv = fused_rows.linear_rows(rows, w, f"{prefix}.wkv.weight", num)       # few rows: two launches, same bits
    if kv is None:
        kv = linear(rows, w, f"{prefix}.wkv.weight", num)                   # [T, (hc+1)*D]
    if _fused_gate(w, h, kv):   # the gate in one launch (eager and tensor-only steps alike)
        from redknot.kernels.triton.step_engram_v41 import engram_gate_rows

        mask = None if token_mask is None else token_mask.to(torch.float32)
        got = fused_rows._guarded(engram_gate_rows, h, kv, w.float(f"{prefix}.q_weight"),
                                  w.float(f"{prefix}.k_weight"), eps, mask)
        if got is not None:
            return got
    kv = kv.to(num.acc)
    key = kv[:, :hc * d].view(t, hc, d)                                     # keys first
    value = kv[:, hc * d:]
    qk = w.float(f"{prefix}.q_weight") * w.float(f"{prefix}.k_weight")      # [hc, D]
    return engram_gate(h, key, value, qk, eps, token_mask)
