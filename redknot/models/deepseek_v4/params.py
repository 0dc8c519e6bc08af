"""The native checkpoint layout of V4 (reference §8) and how model parameters store it.

:func:`checkpoint_spec` lists every tensor a checkpoint of a given config must
hold, with its logical shape, its storage format and the model parameter it
loads into. It is the single source of truth shared by the loader, the writer
and the parameter factory the modules are built with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn

from redknot.kernels.ref_quant import FP4_GROUP, FP8_BLOCK
from redknot.models.deepseek_v4.config import V4Config

FP8, FP4, FLOAT, FP32, INT = "fp8", "fp4", "float", "fp32", "int"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored_shapes(fmt: str, shape: Tuple[int, ...]) -> Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]:
    """(weight shape, scale shape or None) of a logical tensor stored in ``fmt``."""
    if fmt == FP8:
        n, k = shape
        return (n, k), (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))
    if fmt == FP4:
        n, k = shape
        return (n, k // 2), (n, k // FP4_GROUP)
    return tuple(shape), None


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint weight: native ``name`` (``….weight``; quantised ones have a ``….scale``
    partner), logical ``shape``, storage ``fmt`` and the model parameter it fills
    (``expert`` = index into a stacked [E, ...] parameter)."""
    name: str
    shape: Tuple[int, ...]
    fmt: str
    param: str
    expert: Optional[int] = None

    @property
    def scale_name(self) -> Optional[str]:
        if self.fmt not in (FP8, FP4):
            return None
        return self.name[:-len("weight")] + "scale"


def _linear_formats(cfg: V4Config) -> Tuple[str, str]:
    """(format of quantisable dense linears, format of routed experts) in the checkpoint."""
    if cfg.quant is None:
        return FLOAT, FLOAT
    return FP8, (FP4 if cfg.quant.expert_dtype == "fp4" else FP8)


def _block_spec(cfg: V4Config, p: str, ratio: int, hash_layer: bool) -> List[TensorSpec]:
    lin, exp = _linear_formats(cfg)
    d, hd, n = cfg.hidden_size, cfg.head_dim, cfg.hc_mult
    out: List[TensorSpec] = []

    def add(name: str, shape, fmt: str, param: Optional[str] = None, expert: Optional[int] = None):
        out.append(TensorSpec(f"{p}.{name}", tuple(shape), fmt, param or f"{p}.{name}", expert))

    add("attn_norm.weight", (d,), FP32)
    add("ffn_norm.weight", (d,), FP32)
    for site in ("attn", "ffn"):
        add(f"hc_{site}_fn", ((2 + n) * n, n * d), FP32)
        add(f"hc_{site}_base", ((2 + n) * n,), FP32)
        add(f"hc_{site}_scale", (3,), FP32)
    add("attn.wq_a.weight", (cfg.q_lora_rank, d), lin)
    add("attn.q_norm.weight", (cfg.q_lora_rank,), FP32)
    add("attn.wq_b.weight", (cfg.num_heads * hd, cfg.q_lora_rank), lin)
    add("attn.wkv.weight", (hd, d), lin)
    add("attn.kv_norm.weight", (hd,), FP32)
    add("attn.wo_a.weight", (cfg.o_groups * cfg.o_lora_rank, cfg.num_heads * hd // cfg.o_groups), lin)
    add("attn.wo_b.weight", (d, cfg.o_groups * cfg.o_lora_rank), lin)
    add("attn.attn_sink", (cfg.num_heads,), FP32)
    if ratio:
        width = 2 * hd if ratio == cfg.csa_ratio else hd
        add("attn.compressor.wkv.weight", (width, d), FLOAT)
        add("attn.compressor.wgate.weight", (width, d), FLOAT)
        add("attn.compressor.ape", (ratio, width), FP32)
        add("attn.compressor.norm.weight", (hd,), FP32)
    if ratio == cfg.csa_ratio:
        ihd = cfg.index_head_dim
        add("attn.indexer.wq_b.weight", (cfg.index_n_heads * ihd, cfg.q_lora_rank), lin)
        add("attn.indexer.weights_proj.weight", (cfg.index_n_heads, d), FLOAT)
        add("attn.indexer.compressor.wkv.weight", (2 * ihd, d), FLOAT)
        add("attn.indexer.compressor.wgate.weight", (2 * ihd, d), FLOAT)
        add("attn.indexer.compressor.ape", (ratio, 2 * ihd), FP32)
        add("attn.indexer.compressor.norm.weight", (ihd,), FP32)
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    add("ffn.gate.weight", (e, d), FLOAT)
    if hash_layer:
        add("ffn.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), INT)
    else:
        add("ffn.gate.bias", (e,), FP32)
    for j in range(e):
        for w, shape in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            add(f"ffn.experts.{j}.{w}.weight", shape, exp, param=f"{p}.ffn.experts.{w}", expert=j)
    for w, shape in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
        add(f"ffn.shared_experts.{w}.weight", shape, lin)
    return out


def checkpoint_spec(cfg: V4Config, include_mtp: bool = True) -> List[TensorSpec]:
    """Every tensor of a native checkpoint for ``cfg`` (layers past a cut are not listed)."""
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    lin, _ = _linear_formats(cfg)
    top = [TensorSpec("embed.weight", (v, d), FLOAT, "embed.weight"),
           TensorSpec("head.weight", (v, d), FLOAT, "head.weight"),
           TensorSpec("norm.weight", (d,), FP32, "norm.weight")]
    head = [("hc_head_fn", (n, n * d)), ("hc_head_base", (n,)), ("hc_head_scale", (1,))]
    top += [TensorSpec(name, shape, FP32, name) for name, shape in head]
    for i in range(cfg.num_layers):
        top += _block_spec(cfg, f"layers.{i}", cfg.compress_ratio(i), cfg.is_hash_layer(i))
    if include_mtp:
        for j in range(cfg.num_mtp_layers):
            p = f"mtp.{j}"
            top += _block_spec(cfg, p, 0, False)
            top += [TensorSpec(f"{p}.e_proj.weight", (d, d), lin, f"{p}.e_proj.weight"),
                    TensorSpec(f"{p}.h_proj.weight", (d, d), lin, f"{p}.h_proj.weight")]
            top += [TensorSpec(f"{p}.{x}.weight", (d,), FP32, f"{p}.{x}.weight") for x in ("enorm", "hnorm", "norm")]
            top += [TensorSpec(f"{p}.{name}", shape, FP32, f"{p}.{name}") for name, shape in head]
    return top


class ParamFactory:
    """Makes parameters in the storage the hardware config asks for: float weights in
    ``dtype``; with ``keep_quantized`` FP8/FP4 checkpoint formats stay quantised (fp32 scales)."""

    def __init__(self, cfg: V4Config, dtype: torch.dtype, keep_quantized: bool = False, device="meta"):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.keep = keep_quantized and cfg.quant is not None
        self.linear_fmt, self.expert_fmt = _linear_formats(cfg)

    def _param(self, shape, dtype) -> nn.Parameter:
        return nn.Parameter(torch.empty(*shape, dtype=dtype, device=self.device), requires_grad=False)

    def fp32(self, *shape: int) -> nn.Parameter:
        return self._param(shape, torch.float32)

    def plain(self, *shape: int) -> nn.Parameter:
        return self._param(shape, self.dtype)

    def weight(self, shape: Tuple[int, ...], fmt: str, lead: Tuple[int, ...] = ()
               ) -> Tuple[nn.Parameter, Optional[nn.Parameter]]:
        """(weight, scale or None) for a logical [*lead, N, K] matrix stored as ``fmt``."""
        if not self.keep or fmt not in (FP8, FP4):
            return self._param(lead + tuple(shape), self.dtype), None
        w_shape, s_shape = stored_shapes(fmt, shape)
        w_dtype = torch.float8_e4m3fn if fmt == FP8 else torch.int8
        return self._param(lead + w_shape, w_dtype), self._param(lead + s_shape, torch.float32)
