"""Guard for the fast weight decodes of the split-K streams (``splitk_mx`` ``scaled`` / ``fp8``).

Those decodes lean on compiler lowerings (``tl.dot_scaled`` on SM90, FP8 MMA per 32-wide group) whose
build or numerics could differ on another Triton or device. On the first call per decode on a CUDA
device (outside CUDA-graph capture), ``with_fallback`` computes a small MXFP4 grouped W1 | W3 problem and
an FP8 dense one with that decode and with ``registers`` (an independent implementation: hand decode in
registers) on fresh random operands, and compares the fp32 sums. A build failure or a mismatch is
recorded in ``DECODE_ERRORS``, warned once, and the stream runs ``registers`` from then on; the
benchmarks print ``DECODE_ERRORS`` and the GPU tests fail on it. Off the GPU errors propagate, so the
interpreter tests exercise the kernels themselves. The fused MoE streams (``moe_stream.StreamPlan``) are
guarded the same way (``stream_check``: their fp32 W1 | W3 sums and their whole MoE output against the
split-K ``registers`` stream).
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, Hashable, Optional, Set, TypeVar

import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels.triton import splitk_mx
from redknot.kernels.triton.dequant_mx import qdq_bf16

R = TypeVar("R")
# Dense-stream decodes that are a ``splitk_mx`` decode with another launch shape (``gemm_mx``'s tuner).
LINEAR_ALIASES = {"fp8_n32": ("fp8", {"block_n": 32})}
DECODE_ERRORS: Dict[Hashable, str] = {}  # decode (name or ``StreamPlan``) -> why it is not used on this device
_CHECKED: Set[Hashable] = set()
# Same exact products, another summation order: ~1e-6 relative in fp32, up to ~1e-4 where FP8 MMAs add a
# 32-wide group at the tensor cores' reduced accumulation precision; a wrong decode is off by O(1).
CHECK_TOL = 1e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def self_check(decode: str, device: torch.device, seed: int = 1234) -> Optional[str]:
    """None when ``decode`` computes what ``registers`` computes on ``device``, else what differs
    (``registers`` itself is the comparison: None; ``registers_wide`` is that kernel with wider row tiles,
    the same products in the same order). A ``moe_stream.StreamPlan``: ``stream_check``; a ``gemv*``
    or ``moe_gemv*`` name: ``gemv_mx.self_check``."""
    from redknot.kernels.triton.moe_stream import StreamPlan
    if isinstance(decode, StreamPlan):
        return stream_check(decode, device, seed)
    if isinstance(decode, str) and decode.startswith(("gemv", "moe_gemv")):
        from redknot.kernels.triton.gemv_mx import self_check as gemv_check
        return gemv_check(decode, device, seed)
    if decode in ("registers", "registers_wide"):
        return None
    from redknot.kernels.triton.gemm_mx import FUSED_DECODES, fused_check
    if decode in FUSED_DECODES:   # the slice sum in the launch (``*_f``, ``*_f16``): the base decode's bits
        return fused_check(decode, device, seed)
    launch = dict(LINEAR_ALIASES.get(decode, (decode, {}))[1])
    decode = LINEAR_ALIASES.get(decode, (decode, {}))[0]
    g = torch.Generator(device=device).manual_seed(seed)
    E, N, K, T = 3, 128, 512, 5
    dense, packed = [], []
    for _ in range(2):  # W1 and W3
        packed.append(torch.randint(0, 256, (E, N, K // 2), generator=g, device=device, dtype=torch.uint8))
        packed.append(torch.randint(117, 124, (E, N, K // 32), generator=g, device=device, dtype=torch.uint8))
    x = torch.randn(T, K, generator=g, device=device).to(torch.bfloat16)
    rowid = (torch.arange(8, device=device) % T).to(torch.int32)
    offs = torch.tensor([3, 5, 8], dtype=torch.int32, device=device)  # experts 0 / 1 / 2: 3, 2, 3 rows
    w1, s1, w3, s3 = packed
    got = splitk_mx.splitk_mm(qdq_bf16(x), w1, s1, 8, w_fp4=True, rowid=rowid, offs=offs, w3=w3, ws3=s3,
                              decode=decode, **launch)
    want = splitk_mx.splitk_mm(qdq_bf16(x, split=True), w1, s1, 8, w_fp4=True, rowid=rowid, offs=offs, w3=w3,
                               ws3=s3, decode="registers")
    errs = [_rel(got[i].sum(0), want[i].sum(0)) for i in range(2)]
    # one dense shape (each launch shape is a compile; a decode-step linear of V4.1: 32 x 32 tiles, 1 row)
    block, rows = 32, 1
    w, ws = mx.quant_fp8_blocks(torch.randn(N, K, generator=g, device=device) * 0.02, block)
    xd = torch.randn(rows, K, generator=g, device=device).to(torch.bfloat16)
    a = xd if decode == "fp8" else qdq_bf16(xd)
    got = splitk_mx.splitk_mm(a, w, ws, rows, w_fp4=False, wb=block, raw=decode == "fp8", decode=decode, **launch,
                              block_m=splitk_mx.dense_row_tile(rows))
    want = splitk_mx.splitk_mm(qdq_bf16(xd), w, ws, rows, w_fp4=False, wb=block, decode="registers")
    dense.append(_rel(got.sum(0), want.sum(0)))
    worst = max(errs + dense)
    return None if worst <= CHECK_TOL else f"differs from decode='registers' by {worst:.3g} (tolerance {CHECK_TOL:g})"


# The fused MoE stream's full output (bf16 slots, then bf16 tokens) against the split-K ``registers`` one:
# bf16 roundings of differently ordered fp32 sums differ by an ulp here and there (~1e-3 relative in
# norm); a wrong decode or epilogue is off by O(1).
STREAM_OUT_TOL = 2e-2


def random_moe(g: torch.Generator, device: torch.device, E: int, D: int, inter: int, T: int):
    """Random MXFP4 experts for the first-use checks, drawn from ``g``: ([W1, its scales, W3, its scales, W2,
    its scales] with bytes uniform and E8M0 scales in 118..123) and bf16 tokens x [T, D]."""
    packed = []
    for n, kk in ((inter, D), (inter, D), (D, inter)):  # W1, W3, W2
        packed.append(torch.randint(0, 256, (E, n, kk // 2), generator=g, device=device, dtype=torch.uint8))
        packed.append(torch.randint(118, 124, (E, n, kk // 32), generator=g, device=device, dtype=torch.uint8))
    x = torch.randn(T, D, generator=g, device=device).to(torch.bfloat16)
    return packed, x


def stream_check(plan, device: torch.device, seed: int = 1234) -> Optional[str]:
    """None when the fused MoE stream ``plan`` computes what the split-K ``registers`` stream computes:
    the W1 | W3 fp32 sums (one K slice of partials) within ``CHECK_TOL`` and the whole MoE output within
    ``STREAM_OUT_TOL``, on fresh random MXFP4 experts."""
    from redknot.kernels.triton import moe_mx, moe_stream
    g = torch.Generator(device=device).manual_seed(seed)
    E, D, inter, T, k = 3, 256, 128, 5, 2
    packed, x = random_moe(g, device, E, D, inter, T)
    idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    wt = torch.rand(T, k, generator=g, device=device) + 0.1
    rowid = (torch.arange(8, device=device) % T).to(torch.int32)
    offs = torch.tensor([3, 5, 8], dtype=torch.int32, device=device)
    w1, s1, w3, s3, w2, s2 = packed
    tiles = splitk_mx.tile_map(offs, moe_stream.ROW_TILE, 8)
    if plan.decode in moe_stream.FP8_DECODES:
        from redknot.kernels.triton import moe_stream_fp8h as halves
        from redknot.kernels.triton.moe_stream_fp8 import stream_gemm_fp8
        from redknot.kernels.triton.quant_mx import act_quant_mx
        xq, xs = act_quant_mx(x)
        if plan.decode != "fp8":  # D is a multiple of 128: the halves kernels themselves
            if plan.decode in halves.DIAG_ROWS:
                tiles = splitk_mx.tile_map(offs, halves.DIAG_ROWS[plan.decode], 8)
            got = halves.stream_gemm_fp8h(halves.halves_order(xq), halves.scales_f32(xs), w1, s1, 8, plan,
                                          offs=offs, tiles=tiles, rowid=rowid, w3=w3, ws3=s3)
        else:
            got = stream_gemm_fp8(xq, xs, w1, s1, 8, plan, offs=offs, tiles=tiles, rowid=rowid, w3=w3, ws3=s3)
    else:
        got = moe_stream.stream_gemm(qdq_bf16(x), w1, s1, 8, plan, offs=offs, tiles=tiles, rowid=rowid, w3=w3,
                                     ws3=s3)
    want = splitk_mx.splitk_mm(qdq_bf16(x, split=True), w1, s1, 8, w_fp4=True, rowid=rowid, offs=offs, w3=w3,
                               ws3=s3, decode="registers")
    errs = [_rel(got[i].sum(0), want[i].sum(0)) for i in range(2)]
    if max(errs) > CHECK_TOL:
        return f"W1 | W3 sums differ from decode='registers' by {max(errs):.3g} (tolerance {CHECK_TOL:g})"
    out = moe_stream.moe_stream(x, idx, wt, *packed, 10.0, plan)
    ref = moe_mx.moe_splitk(x, idx, wt, *packed, 10.0, decode="registers")
    err = _rel(out, ref)
    if not err <= STREAM_OUT_TOL:
        return f"MoE output differs from decode='registers' by {err:.3g} (tolerance {STREAM_OUT_TOL:g})"
    return None


def first_use(key: Hashable, checked: Set[Hashable], errors: Dict, check: Callable[[], Optional[str]],
              fast: Callable[[], R], fallback: Callable[[], R], fail: Callable[[Hashable, str], None]) -> R:
    """``fast()`` unless ``key`` failed on this process: ``check()`` runs once per key, outside a CUDA-graph
    capture (a message, or an exception such as a Triton build failure, is a failure); a failure is
    recorded through ``fail`` (which fills ``errors``) and ``fallback()`` runs from then on, as it does when
    ``fast()`` itself raises (a launch shape the check did not cover)."""
    if key not in checked and key not in errors and not torch.cuda.is_current_stream_capturing():
        checked.add(key)
        try:
            err = check()
        except Exception as exc:  # a Triton build failure on this toolchain
            err = f"{type(exc).__name__}: {str(exc)[:300]}"
        if err:
            fail(key, err)
    if key not in errors:
        try:
            return fast()
        except Exception as exc:  # a build failure of a launch shape the check did not cover
            fail(key, f"{type(exc).__name__}: {str(exc)[:300]}")
    return fallback()


def with_fallback(device: torch.device, decode, fast: Callable[[], R], registers: Callable[[], R]) -> R:
    """``fast()`` (a ``scaled`` / ``fp8`` stream) unless that decode failed its build or self-check on this
    CUDA device (then ``registers()``; see the module docstring)."""
    if device.type != "cuda":
        return fast()
    return first_use(decode, _CHECKED, DECODE_ERRORS, lambda: self_check(decode, device), fast, registers, _fail)


def _fail(decode: str, err: str) -> None:
    DECODE_ERRORS[decode] = err
    warnings.warn(f"splitk_mx: decode={decode!r} is not used on this device ({err}); running 'registers'",
                  stacklevel=2)
