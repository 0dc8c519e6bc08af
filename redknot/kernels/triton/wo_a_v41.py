"""V4.1's ``wo_a`` (the attention output's per-group projection) at decode batches as a stream of its stored FP8 bytes.

The model computes ``z = einsum("ngk,grk->ngr", o, wo_a)`` with ``wo_a`` decoded once to bf16 (the reference holds it
dequantised and applies it without activation quantisation): G = 8 groups of [1024, 4096], 67 MB of bf16 a layer
that a cuBLAS GEMM reads per step (H100 run 3: ``nvjet_sm90_tst_64x32`` 33 us a layer at 32 rows, ~60 % of the bf16
bytes' floor). Stored, the weight is e4m3 with E8M0 32 x 32 tiles: 33.5 MB. :func:`grouped_stream` reads those bytes
with ``splitk_mx``'s ``registers`` stream (weight tiles decoded in registers to bf16: exact, ``e4m3 · 2^s``), each
output column tile against its group's own 4096 columns of the rows (``GROUP_N``), the activations as they are (no
QDQ: the einsum's exact bf16 products), fp32 sums, the slice sum in the stream launch (``slice_sum``), bf16 out.
Same products as the einsum, another fp32 summation order (one bf16 rounding apart at most per output).

``WO_A_TUNER`` chooses per (weight shape, groups, row class: the rows' power of two) between the einsum (first: what
runs untimed, under capture or with tuning off) and four stream shapes, timed on the call's own inputs; the streams
run behind a first-use check against the einsum (``stream_guard.first_use``; a failure keeps the einsum for the
process). A class first met under CUDA-graph capture keeps the einsum for the process, so eager and replayed steps
compute the same bits. Used for ``MIN_ROWS``..``MAX_ROWS`` rows (``attention.grouped_output``: decode batches; 1-4
rows run ``step_wo_a_v41``'s GEMVs, prefill rows ``linear_prefill_mx``). Not measured on the H200.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from redknot.kernels.triton._common import ConfigTuner, next_pow2

MIN_ROWS, MAX_ROWS = 5, 128   # 1-4 rows: ``step_wo_a_v41``'s GEMVs; above 128: ``linear_prefill_mx``
# Stream shapes are ``gemm_mx.FUSED_DECODES`` names of the registers kernel (row tile, K slices; see there).
WO_A_TUNER = ConfigTuner("wo_a_grouped", ["einsum", "registers_wide_f", "registers_w64_f", "registers_wide_f16",
                                          "registers_w64_f16"])
CHECK_TOL = 1e-2   # relative (norm) difference to the einsum: bf16 roundings of differently ordered fp32 sums
_CHECKED: set = set()
ERRORS: dict = {}


def grouped_stream(o2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int, name: str,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """z [T, G·R] = per group g: o2[:, g·K:(g+1)·K] · dequant(weight[g·R:(g+1)·R])ᵀ, bf16 rows o2 [T, G·K] (unit
    column stride), e4m3 weight [G·R, K] with E8M0 32 x 32 tiles; ``name`` a ``WO_A_TUNER`` stream shape."""
    from redknot.kernels.triton import gemm_mx, splitk_mx
    from redknot.kernels.triton.dequant_mx import as_bytes

    base, fused, steps = gemm_mx.fused_name(name)
    if not fused or base not in ("registers_wide", "registers_w64"):
        raise ValueError(f"wo_a grouped_stream: {name!r} is no stream shape of {WO_A_TUNER.candidates[1:]}")
    rows = o2.shape[0]
    n, k = weight.shape
    if base == "registers_wide":
        bm = splitk_mx.dense_row_tile(rows)
        warps = 8 if bm >= 64 else 4
    else:
        bm, warps = 64, 4
    splits = splitk_mx.split_count(n, k, 64, splitk_mx.block_k_for(k, False, 0), steps) if steps else None
    out = out if out is not None else torch.empty(rows, n, dtype=o2.dtype, device=o2.device)
    return splitk_mx.splitk_mm(o2, weight, as_bytes(scale), rows, w_fp4=False, wb=32, decode="registers",
                               block_m=bm, num_warps=warps, swap=True, splits=splits, group_n=n // groups, out=out)


def einsum(o2: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    """The model's bf16 product: o2 [T, G·K], wb bf16 [G, R, K] -> [T, G·R]."""
    t, (g, _, k) = o2.shape[0], wb.shape
    return torch.einsum("ngk,grk->ngr", o2.view(t, g, k), wb).reshape(t, -1)


def self_check(name: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when the stream shape ``name`` computes the einsum's result (within ``CHECK_TOL``) on fresh random
    operands (3 groups of 64 x 256, 20 and 70 rows), else what differs."""
    from redknot.kernels import mx_formats as mx

    g = torch.Generator(device=device).manual_seed(seed)
    groups, r, k = 3, 64, 256
    w, s = mx.quant_fp8_blocks(torch.randn(groups * r, k, generator=g, device=device) * 0.05, 32)
    wb = mx.dequant_fp8_blocks(w, s, 32).to(torch.bfloat16).view(groups, r, k)
    for rows in (20, 70):
        o2 = torch.randn(rows, groups * k, generator=g, device=device).to(torch.bfloat16)
        want = einsum(o2, wb).double()
        got = grouped_stream(o2, w, s, groups, name).double()
        err = float((got - want).norm() / want.norm().clamp_min(1e-30))
        if not err <= CHECK_TOL:
            return f"differs from the bf16 einsum by {err:.3g} at {rows} rows (tolerance {CHECK_TOL:g})"
    return None


def wo_a(o2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
         bf16_weight: Callable[[], torch.Tensor]) -> torch.Tensor:
    """z [T, G·R] for ``MIN_ROWS``..``MAX_ROWS`` bf16 rows o2 [T, G·K]: ``WO_A_TUNER``'s choice between the einsum on
    ``bf16_weight()`` ([G, R, K], built by the caller once) and the FP8 streams (module docstring)."""
    from redknot.kernels.triton import stream_guard

    rows = o2.shape[0]
    key = (tuple(weight.shape), groups, min(next_pow2(rows), MAX_ROWS))
    if key not in WO_A_TUNER.choices and o2.is_cuda and torch.cuda.is_current_stream_capturing():
        WO_A_TUNER.choices[key] = WO_A_TUNER.candidates[0]   # first met under capture: the einsum for the process

    def run(name: str) -> torch.Tensor:
        if name == "einsum":
            return einsum(o2, bf16_weight())
        return stream_guard.first_use(name, _CHECKED, ERRORS, lambda: self_check(name, o2.device),
                                      lambda: grouped_stream(o2, weight, scale, groups, name),
                                      lambda: einsum(o2, bf16_weight()), _fail)
    return run(WO_A_TUNER.pick(key, run, o2.device))


def _fail(name: str, err: str) -> None:
    import warnings
    ERRORS[name] = err
    warnings.warn(f"wo_a_v41: stream {name!r} is not used on this device ({err}); running the bf16 einsum",
                  stacklevel=2)
