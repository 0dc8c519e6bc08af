"""The attention output's grouped ``wo_a`` at 1-4 decode rows as a CUDA-core GEMV over the stored FP8 weight.

``attention.grouped_output`` computes z [T, g·r] = einsum("ngk,grk->ngr", o [T, g, K], wo_a [g, r, K]) with
``wo_a`` dequantised once to bf16 (the reference applies it in bf16, without activation quantisation). At
V4.1 sizes (g 8, r 1024, K 4096) that bf16 copy is 64 MiB a layer, which the einsum (cuBLAS) reads whole at
one row; the stored weight is e4m3 [g·r, K] with E8M0 tiles (32 MiB + 32 KiB). Here each program streams
``BLOCK_N`` rows of the stored weight (inside one group: ``BLOCK_N`` divides r) over one K slice against its
group's slice of the raw bf16 rows (``step_proj_stream_v41._gemv_tile`` with the rows read as they are, QX 1):
the weight's tile scale times the activation is exact (a power of two), each product w · (x · 2^s) is the
reference's exact bf16 x bf16 product, so only the fp32 summation order differs from the einsum's. One K slice
writes z in bf16 directly (one launch); several write fp32 partials [S, T, g·r] added in slice order by
``splitk_mx.reduce_rows`` (two launches) or by the last program of each column block (one launch, the same bits).
A row's sums do not depend on the other rows.

``WO_A_TUNER`` (key: the weight's shape and the rows) chooses between ``einsum`` (first: what ran before; taken
untimed off the GPU and for a key first met under CUDA-graph capture) and the GEMV shapes ``WO_A_PLANS`` in the
``FORMS`` (K slices and how they are summed), each behind a first-use check against the exact products
(:func:`self_check`). Not measured on the H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, DeviceCounters, cdiv
from redknot.kernels.triton.dequant_mx import as_bytes
from redknot.kernels.triton.gemv_plan import (
    MAX_ROWS,
    GemvPlan,
    _block_k,
    _use_asm,
    slices,
)
from redknot.kernels.triton.step_proj_stream_v41 import _gemv_tile

# GEMV shapes by name (``gemv_plan.PLANS``' dense shapes and one of 16 x 256), each in four forms: the K slices
# ``gemv_plan.slices`` cuts, summed by ``splitk_mx.reduce_rows`` (a second launch); ``*_f``: the same slices summed
# by the last program of each column block (one launch, the same bits); ``*_1``: one K slice (one launch);
# ``*_wave_f``: the slices ``step_proj_stream_v41.wave_slices`` cuts against the programs resident on an SM,
# summed in the launch.
WO_A_PLANS = {"gemv": GemvPlan(32, 256), "gemv_n16": GemvPlan(16, 512), "gemv_k128": GemvPlan(32, 128),
              "gemv_n16k256": GemvPlan(16, 256)}
# The tuner takes the one-launch forms (``*_f`` has the bits of the two-launch form, which stays callable).
FORMS = ("", "_f", "_1", "_wave_f")
WO_A_TUNER = ConfigTuner("step_wo_a_small", ["einsum", *(n + f for f in FORMS[1:] for n in WO_A_PLANS)])


@triton.jit
def _wo_a_gemv(x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, R, XG, stride_x, stride_w, stride_s, stride_ps, stride_pm,
               WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_ASM: tl.constexpr, cnt_ptr=None, out_ptr=None, stride_o=0, FUSED: tl.constexpr = False):
    """Program (column block, K slice): ``_gemv_tile`` on the group's K columns of the raw bf16 rows (int32 words
    of bf16 pairs; group ``pid_n · BLOCK_N // R`` starts XG words into a row). FUSED: then a barrier and one
    acquire-release increment of the column block's counter; the program that takes it to the slice count resets
    it and adds the block's partials in slice order (from L2), cast to ``out`` (``reduce_rows``' arithmetic: the
    bits of the two launches)."""
    pid_n = tl.program_id(0)
    group = (pid_n * BLOCK_N) // R
    _gemv_tile(x_ptr + group * XG, w_ptr, s_ptr, p_ptr, pid_n, tl.program_id(1), N, KW, KSPLIT, stride_x, stride_w,
               stride_s, stride_ps, stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, 1)
    if FUSED:
        tl.debug_barrier()   # every thread's partials stored before the release
        S = tl.num_programs(1)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < N
            for t in tl.static_range(ROWS):
                acc = tl.zeros([BLOCK_N], tl.float32)
                for sl in range(S):   # slice order
                    acc += tl.load(p_ptr + sl * stride_ps + t * stride_pm + cols, mask=cmask, other=0.0,
                                   cache_modifier=".cg")
                tl.store(out_ptr + t * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)


# the column-block counters of the fused wo_a forms (see DeviceCounters)
_counters = DeviceCounters(1024)
_COUNTERS = _counters.sets


def plan_of(name: str) -> tuple:
    """(GemvPlan, form) of a ``WO_A_TUNER`` GEMV name (form one of ``FORMS``)."""
    form = next((f for f in sorted(FORMS[1:], key=len, reverse=True) if name.endswith(f)), "")
    return WO_A_PLANS[name[:len(name) - len(form)]], form


def cut(N: int, K: int, plan: GemvPlan, form: str) -> tuple:
    """(slice count, slice width) of the form's launch over an [N, K] weight: a function of the shapes only."""
    if form == "_1":
        return 1, K
    if form == "_wave_f":
        from redknot.kernels.triton.step_proj_stream_v41 import resident, wave_slices
        base = next(n for n, p in WO_A_PLANS.items() if p == plan)
        shape = base if base in ("gemv", "gemv_n16", "gemv_k128") else "gemv_n16"
        return wave_slices([N], K, plan, resident(shape, 1, _block_k(K, plan.block_k), 1))
    return slices(N, K, plan)


def wo_a_gemv(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int, name: str) -> torch.Tensor:
    """z [T, g·r] bf16 = Σ_k o[t, g, k] · dequant(W)[g·r + i, k] for T <= ``MAX_ROWS`` bf16 rows o [T, g, K] and
    the stored e4m3 weight W [g·r, K] with E8M0 tiles ``scale`` [ceil(g·r / block), ceil(K / block)]; ``name`` a
    GEMV name of ``WO_A_TUNER``."""
    T, g, K = o.shape
    N = weight.shape[0]
    plan, form = plan_of(name)
    R = N // g if g else 0
    if (T > MAX_ROWS or o.dtype != torch.bfloat16 or weight.dtype != torch.float8_e4m3fn or weight.shape[1] != K
            or N % g or R % plan.block_n or block % plan.block_n or block % 32 or K % 32
            or tuple(scale.shape) != (cdiv(N, block), cdiv(K, block))):
        raise ValueError(f"wo_a_gemv: o {tuple(o.shape)} {o.dtype}, weight {tuple(weight.shape)} {weight.dtype}, "
                         f"block {block}: need at most {MAX_ROWS} bf16 rows, an e4m3 [g·r, K] weight with [g·r / block, "
                         f"K / block] tiles, r and the tile multiples of {plan.block_n}, K a multiple of 32")
    out = torch.empty(T, N, dtype=torch.bfloat16, device=o.device)
    if T == 0:
        return out
    x = o.reshape(T, g * K)
    x = x if x.stride(-1) == 1 and x.stride(0) % 2 == 0 else x.contiguous()
    bk = _block_k(K, plan.block_k)
    S, ksplit = cut(N, K, plan, form)
    p = out if S == 1 else torch.empty(S, T, N, dtype=torch.float32, device=o.device)
    wb = as_bytes(weight)
    xw = x.view(torch.int32)
    nb = cdiv(N, plan.block_n)
    fused = S > 1 and form.endswith("_f")
    extra = {"cnt_ptr": _counters(o.device, nb), "out_ptr": out, "stride_o": out.stride(0), "FUSED": True} if fused \
        else {}
    _wo_a_gemv[(nb, S)](
        xw, wb.view(torch.int32), as_bytes(scale), p, N, K // 4, ksplit, R, K // 2, xw.stride(0), wb.stride(0) // 4,
        as_bytes(scale).stride(0), p.stride(0) if S > 1 else 0, p.stride(-2), WB=block, ROWS=T,
        BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=_use_asm(), num_warps=plan.num_warps, num_stages=plan.num_stages,
        **extra)
    if S > 1 and not fused:
        from redknot.kernels.triton.splitk_mx import reduce_rows
        reduce_rows(p, out)
    return out


def wo_a_reference(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The einsum on the dequantised weight in fp64 (the exact products' sums) -> [T, g·r] fp64."""
    from redknot.kernels import mx_formats as mx
    T, g, K = o.shape
    w = mx.dequant_fp8_blocks(weight, scale, block).double().view(g, -1, K)
    return torch.einsum("ngk,grk->ngr", o.double(), w).reshape(T, -1)


def self_check(name: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when :func:`wo_a_gemv` ``name`` gives, at one and three rows of random operands (4 groups of 64 rows
    over K 512), bf16 roundings of the exact products' sums (within ``stream_guard.STREAM_OUT_TOL``), else what
    differs: the first-use check of the GEMV on a GPU."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton.stream_guard import STREAM_OUT_TOL, _rel
    g = torch.Generator(device=device).manual_seed(seed)
    groups, r, K, block = 4, 64, 512, 32
    w, ws = mx.quant_fp8_blocks(torch.randn(groups * r, K, generator=g, device=device) * 0.02, block)
    worst = 0.0
    for rows in (1, 3):
        o = torch.randn(rows, groups, K, generator=g, device=device).to(torch.bfloat16)
        worst = max(worst, _rel(wo_a_gemv(o, w, ws, block, name).double(), wo_a_reference(o, w, ws, block)))
    return None if worst <= STREAM_OUT_TOL else (f"step wo_a GEMV {name} differs from the exact sums by {worst:.3g} "
                                                 f"(tolerance {STREAM_OUT_TOL:g})")


def wo_a_rows(o: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bf16_weight: torch.Tensor, block: int = 32,
              choice: str | None = None) -> torch.Tensor:
    """z [T, g·r] for the grouped ``wo_a`` at T <= ``MAX_ROWS`` bf16 rows o [T, g, K]: ``WO_A_TUNER``'s choice
    (``choice`` forces one) between the einsum on ``bf16_weight`` [g, r, K] (the dequantised weight) and
    :func:`wo_a_gemv` on the stored ``weight`` / ``scale`` (behind its first-use check on a GPU; the einsum where
    that fails)."""
    T = o.shape[0]
    einsum = lambda: torch.einsum("ngk,grk->ngr", o, bf16_weight).reshape(T, -1)

    def run(c):
        if c == "einsum":
            return einsum()
        if o.device.type != "cuda":
            return wo_a_gemv(o, weight, scale, block, c)
        from redknot.kernels.triton import stream_guard
        return stream_guard.first_use(("step_wo_a", c), stream_guard._CHECKED, stream_guard.DECODE_ERRORS,
                                      lambda: self_check(c, o.device), lambda: wo_a_gemv(o, weight, scale, block, c),
                                      einsum, stream_guard._fail)

    if choice is None:
        key = (tuple(weight.shape), block, T)
        if key not in WO_A_TUNER.choices and o.is_cuda and torch.cuda.is_current_stream_capturing():
            WO_A_TUNER.choices[key] = WO_A_TUNER.candidates[0]  # eager and graph steps: one choice
        choice = WO_A_TUNER.pick(key, run, o.device)
    return run(choice)
