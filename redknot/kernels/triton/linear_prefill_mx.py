"""``linear_mx`` above the split-K rows (prefill): a choice, measured per weight shape and row class, between the
bf16 library GEMM on exactly decoded operands (``dequant``: ``gemm_mx._linear_dequant``) and an FP8 library GEMM
with one scale per row and per weight column (``fp8_rowwise``: ``torch._scaled_mm``).

Why: at 8192 rows the V4.1 cut's 39 prefill linears do 13.4 TFLOP; the H100 ran them in 19.6 ms (~680 TFLOP/s,
86 % of the bf16 peak of 796 and 47 % of the FP8 peak of 1451), so only the FP8 tensor cores can take them lower.
Hopper's FP8 GEMMs scale per row / per column (or per 128-block), not per 32 along K as the V4.1 formats do, so
the operands are re-expressed on one power-of-two scale per row:

* ``act_rowwise``: each row's per-32 FP8 quantisation (the reference's ``QDQ``: e4m3 ``q`` times ``2^e_g``), then
  ``q · 2^(e_g - E)`` in e4m3 with ``E = max_g e_g`` and the row scale ``2^E`` (fp32);
* ``weight_rowwise``: each weight row's e4m3 values times ``2^(s_t - S)`` in e4m3, ``s_t`` the E8M0 scale of its
  32 x 32 tile and ``S`` the largest tile scale of the row's 32-row block, column scale ``2^(S - 127)``.

Both are exact wherever the shifted value stays an e4m3 number (a value of a group ``d`` steps below the row's
largest keeps its 3 mantissa bits while its exponent minus ``d`` stays >= -6, else rounds to the nearest
multiple of 2^-9): only the values far below a row's largest move, each by at most 2^-10 of the row scale (under
2^-17.8 of the row's largest value, which is above 224 times the scale), so the products are the reference's but
for those, and the sums are fp32 (no fast accumulation). The weight form is computed per call (N·K bytes read and
written; kept nowhere, so no second copy of the weights stays in memory).

The first use of a class checks ``fp8_rowwise`` against ``dequant`` on the call's own rows (norm-wise relative
error at most ``GATE_TOL``, the GEMM tolerance of ``checks_mx``); a larger error makes the candidate fail, and the
tuner keeps ``dequant``. Speed: not measured on the H200 (``benchmarks/linear_prefill_v41.py`` times both
on the cut's prefill shapes).
"""
from __future__ import annotations

from collections.abc import Hashable

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2
from redknot.kernels.triton.quant_mx import e8m0_decode, e8m0_exponent, pow2

PREFILL_TUNER = ConfigTuner("linear_mx_prefill", ["dequant", "fp8_rowwise"])
GATE_TOL = 1e-2
ONE_PASS_K = 8192   # rows up to this K (padded to a power of two) are quantised from registers, read once
MIN_SHIFT = -30   # shifts below this flush every e4m3 value (|q| < 2^9) to zero already: pow2 stays in range
_GATED: dict[Hashable, float] = {}   # class -> the first use's relative error of fp8_rowwise against dequant


@triton.jit
def _act_rowwise(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    r64 = rows.to(tl.int64)
    big = tl.full([BLOCK_M], -127, tl.int32)
    for k0 in range(0, K, BLOCK_K):               # pass 1: the row's largest group exponent
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=rm[:, None] & (cols[None, :] < K),
                    other=0.0).to(tl.float32)
        e = e8m0_exponent(tl.max(tl.abs(tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))), 2), 448.0, 1e-4)
        big = tl.maximum(big, tl.max(e, 1))
    for k0 in range(0, K, BLOCK_K):               # pass 2: QDQ per 32, then the values on the row's scale
        cols = k0 + tl.arange(0, BLOCK_K)
        m = rm[:, None] & (cols[None, :] < K)
        x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        xg = tl.reshape(x, (BLOCK_M, BLOCK_K // 32, 32))
        e = e8m0_exponent(tl.max(tl.abs(xg), 2), 448.0, 1e-4)
        q = tl.minimum(tl.maximum(xg * pow2(-e)[:, :, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
        shift = tl.maximum(e - big[:, None], -30)
        v = tl.reshape(q * pow2(shift)[:, :, None], (BLOCK_M, BLOCK_K)).to(tl.float8e4nv)
        tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], v, mask=m)
    tl.store(s_ptr + rows, pow2(big), mask=rm)


@triton.jit
def _act_rowwise_1p(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, BLOCK_M: tl.constexpr, ROW_P: tl.constexpr):
    """``_act_rowwise`` with whole rows in registers (K <= ``ONE_PASS_K``): x read once."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rm = rows < M
    r64 = rows.to(tl.int64)
    cols = tl.arange(0, ROW_P)
    m = rm[:, None] & (cols[None, :] < K)
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    xg = tl.reshape(x, (BLOCK_M, ROW_P // 32, 32))
    e = e8m0_exponent(tl.max(tl.abs(xg), 2), 448.0, 1e-4)
    gm = (tl.arange(0, ROW_P // 32) * 32 < K)[None, :]
    big = tl.max(tl.where(gm, e, -127), 1)
    q = tl.minimum(tl.maximum(xg * pow2(-e)[:, :, None], -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
    shift = tl.maximum(e - big[:, None], -30)
    v = tl.reshape(q * pow2(shift)[:, :, None], (BLOCK_M, ROW_P)).to(tl.float8e4nv)
    tl.store(q_ptr + r64[:, None] * stride_q + cols[None, :], v, mask=m)
    tl.store(s_ptr + rows, pow2(big), mask=rm)


@triton.jit
def _weight_rowwise(w_ptr, ws_ptr, o_ptr, s_ptr, N, K, KB, stride_w, stride_s, stride_o, WB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KB_P: tl.constexpr):
    """One [BLOCK_N, BLOCK_K] tile per program (a 2-D grid: enough programs for skinny weights); each reads its
    rows' tile scales (KB bytes a row block, from L2) for the row block's largest."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    r64 = rows.to(tl.int64)
    rb = (rows // WB).to(tl.int64)
    kb = tl.arange(0, KB_P)
    tiles = tl.load(ws_ptr + rb[:, None] * stride_s + kb[None, :], mask=rm[:, None] & (kb[None, :] < KB),
                    other=0).to(tl.int32)
    big = tl.max(tiles, 1)                        # the row block's largest tile scale (E8M0 byte)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = rm[:, None] & (cols[None, :] < K)
    w = tl.load(w_ptr + r64[:, None] * stride_w + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(ws_ptr + rb[:, None] * stride_s + (cols // WB)[None, :], mask=m, other=0).to(tl.int32)
    v = (w * pow2(tl.maximum(s - big[:, None], -30))).to(tl.float8e4nv)
    tl.store(o_ptr + r64[:, None] * stride_o + cols[None, :], v, mask=m)
    if tl.program_id(1) == 0:
        tl.store(s_ptr + rows, e8m0_decode(big), mask=rm)


def act_rowwise(x: torch.Tensor):
    """x [M, K] 16-bit (K % 32 == 0) -> (e4m3 [M, K], fp32 [M]): the per-32 QDQ values on one scale per row."""
    M, K = x.shape
    if K % 32:
        raise ValueError(f"act_rowwise: K={K} must be a multiple of 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    if M and next_pow2(K) <= ONE_PASS_K:
        row_p = next_pow2(K)
        bm = max(1, 2048 // row_p)
        _act_rowwise_1p[(cdiv(M, bm),)](x, q, s, M, K, x.stride(0), q.stride(0), BLOCK_M=bm, ROW_P=row_p,
                                        num_warps=8 if row_p >= 4096 else 4)
    elif M:
        bk = 256 if K % 256 == 0 else (128 if K % 128 == 0 else 32)
        _act_rowwise[(cdiv(M, 16),)](x, q, s, M, K, x.stride(0), q.stride(0), BLOCK_M=16, BLOCK_K=bk, num_warps=4)
    return q, s


def weight_rowwise(w: torch.Tensor, ws: torch.Tensor, block: int):
    """e4m3 [N, K] with E8M0 tiles [ceil(N/b), ceil(K/b)] -> (e4m3 [N, K], fp32 [N]): each row on one scale."""
    N, K = w.shape
    ws = ws if ws.dtype == torch.uint8 else ws.view(torch.uint8)
    kb = ws.shape[1]
    if kb != cdiv(K, block) or ws.shape[0] != cdiv(N, block):
        raise ValueError(f"weight_rowwise: scales {tuple(ws.shape)} for a [{N}, {K}] weight with block {block}")
    o = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=w.device)
    s = torch.empty(N, dtype=torch.float32, device=w.device)
    if N:
        bn, bk = 16, 256
        _weight_rowwise[(cdiv(N, bn), cdiv(K, bk))](w, ws, o, s, N, K, kb, w.stride(0), ws.stride(0), o.stride(0),
                                                    WB=block, BLOCK_N=bn, BLOCK_K=bk, KB_P=next_pow2(kb),
                                                    num_warps=4)
    return o, s


def linear_fp8_rowwise(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int,
                       out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[M, N] ``out_dtype``: the rowwise FP8 GEMM of :func:`act_rowwise` (x2) and :func:`weight_rowwise` (the
    library writes a tensor of its own: copying it into a given one would move 2·M·N bytes twice more)."""
    a, sa = act_rowwise(x2)
    b, sb = weight_rowwise(weight, ws, block)
    return torch._scaled_mm(a, b.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=out_dtype,
                            use_fast_accum=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def row_class(rows: int) -> int:
    """The tuner's row class: the next power of two, at most 16384."""
    return min(next_pow2(max(rows, 1)), 16384)


def linear_prefill(x2: torch.Tensor, weight: torch.Tensor, ws: torch.Tensor, block: int,
                   out: torch.Tensor | None = None, choice: str = "") -> torch.Tensor:
    """``linear_mx`` of x2 [M, K] bf16 (M above the split-K rows) -> [M, N]: ``out`` (allocated when None) for
    ``dequant``, a tensor of the library's for ``fp8_rowwise``. ``choice``: a ``PREFILL_TUNER`` name, else the
    tuner's choice for (weight shape, block, row class)."""
    from redknot.kernels.triton.gemm_mx import _linear_dequant

    N, K = weight.shape

    def buffer() -> torch.Tensor:
        return out if out is not None else torch.empty(x2.shape[0], N, dtype=x2.dtype, device=x2.device)

    def run(c: str) -> torch.Tensor:
        if c == "dequant":
            return _linear_dequant(x2, weight, ws, block, buffer())
        if c != "fp8_rowwise":
            raise ValueError(f"linear_prefill: {c!r} is not one of {PREFILL_TUNER.candidates}")
        if K % 16 or N % 16:
            raise ValueError(f"linear_prefill: fp8_rowwise needs N and K multiples of 16, got [{N}, {K}]")
        return linear_fp8_rowwise(x2, weight, ws, block, x2.dtype)

    if choice:
        return run(choice)
    key = ((N, K), block, row_class(x2.shape[0]))

    def tuning_run(c: str) -> torch.Tensor:
        if c == "fp8_rowwise" and key not in _GATED:   # the first use's gate, on this call's rows
            want = run("dequant")                      # out (or a new tensor); fp8_rowwise writes its own
            got = run(c)
            err = _GATED[key] = _rel(got, want)
            if not err <= GATE_TOL:
                raise RuntimeError(f"fp8_rowwise: relative error {err:.3g} against dequant above {GATE_TOL}")
            return got
        if c == "fp8_rowwise" and not _GATED[key] <= GATE_TOL:
            raise RuntimeError(f"fp8_rowwise: relative error {_GATED[key]:.3g} against dequant above {GATE_TOL}")
        return run(c)

    return run(PREFILL_TUNER.pick(key, tuning_run, x2.device))


# The attention's grouped output projection at prefill rows (``attention.grouped_output``: o [T, g, k] bf16 times
# each group's bf16 ``wo_a`` [r, k], the reference's bf16 GEMM): ``einsum`` (one batched GEMM over the groups, its
# [g, T, r] result copied to [T, g·r]: 134 MB written and read again at 8192 rows of the cut), ``bmm_out`` (the
# same batched GEMM written into the [T, g·r] layout: ldc g·r, batch stride r, where the library takes it), and
# ``mm_cols`` (one GEMM per group into its columns). Products and fp32 sums of one bf16 GEMM each; the library's
# kernel (and so the summation order) may differ between them. Measured per shape and row class on the first use;
# not measured on the H200 (the H100 ran the einsum at ~0.84 ms a call at 8192 rows, ~650 TFLOP/s).
GROUPED_TUNER = ConfigTuner("v41_grouped_wo_a", ["einsum", "bmm_out", "mm_cols"])


def grouped_wo_a(o3: torch.Tensor, wo_a: torch.Tensor, choice: str = "") -> torch.Tensor:
    """o3 [T, g, k] · wo_a [g, r, k]ᵀ per group -> [T, g·r] (``torch.einsum("ngk,grk->ngr")`` reshaped);
    ``choice`` a ``GROUPED_TUNER`` name, else the tuner's for (shape, row class)."""
    t, g, k = o3.shape
    r = wo_a.shape[1]

    def run(c: str) -> torch.Tensor:
        if c == "einsum":
            return torch.einsum("ngk,grk->ngr", o3, wo_a).reshape(t, g * r)
        z = torch.empty(t, g * r, dtype=o3.dtype, device=o3.device)
        if c == "bmm_out":
            torch.bmm(o3.transpose(0, 1), wo_a.transpose(1, 2), out=z.view(t, g, r).transpose(0, 1))
        elif c == "mm_cols":
            for j in range(g):
                torch.mm(o3[:, j], wo_a[j].t(), out=z[:, j * r:(j + 1) * r])
        else:
            raise ValueError(f"grouped_wo_a: {c!r} is not one of {GROUPED_TUNER.candidates}")
        return z

    if choice:
        return run(choice)
    return run(GROUPED_TUNER.pick(((g, r, k), o3.dtype, row_class(t)), run, o3.device))
