"""Pointwise math of DeepSeek-V4.1 shared by the reference oracle and the engine path
(reference §3.0, §3.9): RMSNorm with the weight multiplied before the cast, the
per-layer RoPE tables (θ 10000 on ratio-0 layers, θ 160000 with YaRN elsewhere),
the numerics policy (activation quantise-dequantise before FP8/FP4 linears, cache
grids) and dense views of the stored weights.

Nothing here knows about positions in a cache or about steps: the reference
(:mod:`reference`) and the incremental path (:mod:`model`) differ in how they
arrange rows, not in these formulas. "Compute dtype" ``dt`` is where the document
says bf16 (float64 in tight tests); reductions run in ``acc(dt)`` (at least fp32).
The byte formats and quantisers come from :mod:`redknot.kernels.mx_formats`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Dict, Mapping, Optional, Tuple

import torch

from redknot.kernels import mx_formats as mx

NUMERICS = ("reference", "bf16")
INDEX_KEYS = ("owner", "shipped")


def check_choice(key: str, value: str, allowed: Tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{key}={value!r}: allowed values are {list(allowed)}")
    return value


@dataclass(frozen=True)
class Numerics:
    """``model.numerics`` (reference | bf16) and the compute dtype.

    reference: every FP8/FP4 linear quantises its input per 32 (FP8 e4m3, power-of-two
    scale) and indexer scores are rounded to bf16, as DeepSeek's reference does.
    bf16: neither. In both, the caches hold their trained grids (the state stores the
    trained byte formats) and the indexer query is snapped to FP4 like its keys.
    """
    mode: str = "reference"
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        check_choice("model.numerics", self.mode, NUMERICS)

    @property
    def act_quant(self) -> bool:
        return self.mode == "reference"

    @property
    def acc(self) -> torch.dtype:
        return acc_dtype(self.dtype)


def acc_dtype(dt: torch.dtype) -> torch.dtype:
    """fp32, or fp64 when the compute dtype is fp64."""
    return torch.float64 if dt == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(w · (x · rsqrt(mean(x²) + eps))) in fp32, then cast to x.dtype (§3.0)."""
    a = acc_dtype(x.dtype)
    xf = x.to(a)
    return (weight.to(a) * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(rope_dim: int, base: float, yarn: Optional[Tuple[float, int, float, float]]) -> torch.Tensor:
    """θ_i, i < rope_dim/2, fp64 (§3.9). ``yarn`` = (factor, original_seq_len, beta_fast, beta_slow)."""
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    theta = base ** (-2.0 * i / rope_dim)
    if yarn is not None:
        factor, orig, beta_fast, beta_slow = yarn

        def corrected(rho: float) -> float:
            return rope_dim * math.log(orig / (2 * math.pi * rho)) / (2 * math.log(base))

        low = max(math.floor(corrected(beta_fast)), 0)
        high = min(math.ceil(corrected(beta_slow)), rope_dim - 1)
        ramp = ((i - low) / max(high - low, 1e-3)).clamp(0, 1)
        theta = theta / factor * ramp + theta * (1 - ramp)
    return theta


def layer_rope(cfg, ratio: int) -> torch.Tensor:
    """The inverse frequencies a layer uses for all of its rotations (§3.5 RoPE table)."""
    if ratio == 0:
        return rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)
    return rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta,
                         (cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow))


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the last ``2·len(inv_freq)`` dims of x [N, ..., D] by pos [N]."""
    half = inv_freq.shape[0]
    a = acc_dtype(x.dtype)
    ang = pos.to(torch.float64)[:, None] * inv_freq.to(pos.device)[None, :]   # [N, half]
    cos, sin = ang.cos().to(a), ang.sin().to(a)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -2 * half:].to(a).unflatten(-1, (half, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-2 * half], rot.to(x.dtype)], dim=-1)


# ----------------------------------------------------------------------------- numerics


def act_qdq(x: torch.Tensor) -> torch.Tensor:
    """Per-32 FP8 e4m3 activation quantise-dequantise (power-of-two scale), in x.dtype."""
    return mx.act_quant_ref(x, "fp8")


def window_qdq(kv: torch.Tensor) -> torch.Tensor:
    """Window KV grid: FP8 e4m3 with an E8M0 scale per 32 (all 512 dims)."""
    return mx.act_quant_ref(kv, "fp8")


def compressed_qdq(x: torch.Tensor) -> torch.Tensor:
    """Compressed main KV grid: FP4 e2m1 with an E4M3 scale per 16."""
    return mx.act_quant_ref(x, "fp4", mx.COMPRESSED_GROUP, "e4m3")


def index_qdq(x: torch.Tensor) -> torch.Tensor:
    """Index key / indexer query grid: FP4 e2m1 with an E8M0 scale per 32."""
    return mx.act_quant_ref(x, "fp4", mx.MX_GROUP, "ue8m0")


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Values rounded to bf16, kept in x.dtype (the reference's bf16 indexer arithmetic)."""
    return x.to(torch.bfloat16).to(x.dtype)


# ----------------------------------------------------------------------------- weights


class Weights:
    """Checkpoint tensors by native name (a quantised ``x.weight`` has an ``x.scale`` sibling).

    ``dense(name)`` is the float matrix in the compute dtype, dequantised once and cached
    unless ``keep`` (``hardware.weight_format=keep``: quantised weights are dequantised per use,
    plain ones still converted once).
    ``quantized(name)`` tells whether a linear is an FP8/FP4 GEMM (input quantised per 32).
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, keep: bool = False,
                 quantized: Optional[AbstractSet[str]] = None):
        self.tensors = dict(tensors)
        self.dtype = dtype
        self.keep = keep
        # Names of the checkpoint's FP8/FP4 linears; a loader that dequantised them says so here
        # (they lost their scales). None: a weight is quantised iff it has a scale.
        self._quantized = quantized
        self._dense: Dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def raw(self, name: str) -> torch.Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"checkpoint tensor {name!r} is missing") from None

    @staticmethod
    def scale_name(name: str) -> str:
        """``x.weight`` -> ``x.scale`` (the native sibling of a quantised weight)."""
        return name[:-len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"

    def quantized(self, name: str) -> bool:
        if self._quantized is not None:
            return name in self._quantized
        return self.scale_name(name) in self.tensors

    def _dequant(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        w = self.raw(name)
        scale = self.tensors.get(self.scale_name(name))
        if scale is None:
            return w.to(dtype)
        if w.dtype == torch.float8_e4m3fn:
            return mx.dequant_fp8_blocks(w, scale, mx.V41_WEIGHT_BLOCK, dtype)
        return mx.dequant_mxfp4(w, scale, dtype)

    def dense(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.keep and self.scale_name(name) in self.tensors:  # kept quantised: dequantised per use
            return self._dequant(name, dtype)
        # Plain tensors (norms, mHC, router, compressor, ...) are converted once, kept weights or not
        # (a conversion per use is a copy kernel per use in every decode step).
        key = f"{name}@{dtype}"
        if key not in self._dense:
            self._dense[key] = self._dequant(name, dtype)
        return self._dense[key]

    def float(self, name: str) -> torch.Tensor:
        """A small float tensor (norm weights, hc_*, sinks, biases) in the accumulation dtype."""
        return self.dense(name, acc_dtype(self.dtype))


def linear(x: torch.Tensor, w: Weights, name: str, num: Numerics) -> torch.Tensor:
    """x [..., K] · Wᵀ in the compute dtype; FP8/FP4 weights quantise x per 32 first (reference mode).
    Weights carrying registry ops (``w.ops``, the engine path on a kernel target) run kept FP8 weights
    through ``linear_mx``."""
    ops = getattr(w, "ops", None)
    if ops is not None:
        y = ops.linear(x, w, name, num)
        if y is not None:
            return y
    if num.act_quant and w.quantized(name):
        x = act_qdq(x)
    return torch.nn.functional.linear(x.to(num.dtype), w.dense(name, num.dtype))


def plain_linear(x: torch.Tensor, w: Weights, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A linear the reference runs without activation quantisation, in ``dtype``."""
    return torch.nn.functional.linear(x.to(dtype), w.dense(name, dtype))


def acc_linear(x: torch.Tensor, w: Weights, name: str, acc: torch.dtype) -> torch.Tensor:
    """``plain_linear(x, w, name, acc)`` (a bf16-stored weight the reference applies in fp32: the router, the
    ratio-2 compressor). On CUDA with bf16 rows, a bf16-stored weight and fp32 accumulation: one bf16 GEMM that
    writes fp32 (bf16 products are exact in fp32 and the GEMM sums in fp32, so the fp32 GEMM's arithmetic up to
    summation order) on the tensor cores instead of an fp32 copy of the rows and an fp32 GEMM (at 8192 rows the
    router's is 32 GFLOP). Elsewhere, and with a torch without that overload, ``plain_linear``."""
    wt = w.tensors.get(name)
    if (x.is_cuda and acc == torch.float32 and x.dtype == torch.bfloat16 and wt is not None
            and wt.dtype == torch.bfloat16 and wt.dim() == 2 and x.shape[-1] == wt.shape[1]):
        try:
            return torch.mm(x.reshape(-1, x.shape[-1]), wt.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
        except (TypeError, RuntimeError):   # a torch without the out_dtype overload
            pass
    return plain_linear(x, w, name, acc)


def topk_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[..., n] -> the k indices of the largest scores, ties to the lower index, ascending."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values
