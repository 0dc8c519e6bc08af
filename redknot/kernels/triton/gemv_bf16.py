"""bf16 weight streams for 1-4 activation rows (DeepSeek-V4 decode at batch 1-4) on CUDA cores.

At one to four rows a bf16 linear or expert GEMM reads every weight once per row: its floor is the weight's
bytes over HBM bandwidth. cuBLAS runs such a GEMM as a split-K tensor-core GEMM plus a reduction launch
(H100, V4 cut, batch 1: ``nvjet ... splitK`` + ``splitKreduce``), and the grouped MoE path
(``moe.moe_experts``: sort the pairs by expert, ``torch._grouped_mm`` three times, a SwiGLU and a combine launch)
spends about a dozen launches on routing a handful of pairs. Here:

* ``gemv`` (dense): each program streams ``block_n`` weight rows over one K slice (16 bytes per thread and row
  per load) for every activation row at once, into elementwise fp32 accumulators added over K once at the end;
  the next K step's weights load before the current step's arithmetic (one step of register prefetch). K
  slices (``gemv_plan.slices``: enough programs to cover the device several times) store fp32 partials, and the
  program that stores a column block's last one adds them in slice order in the same launch (``slice_sum``'s
  counter pattern, ``reduce_rows``' arithmetic); one slice when it fills the device.
* ``moe_gemv`` (experts, two launches): one program per (token, slot) pair and column block of the
  intermediate width streams the pair's expert rows of W1 and W3 against its token's row; the two sums are
  rounded to bf16 (what ``torch._grouped_mm`` stores) and the clamped SwiGLU (``moe.swiglu``'s arithmetic) is
  applied before the bf16 store. Then one program per token and column block of the hidden size streams W2 of
  each of the token's slots in slot order, rounds each expert's sum to bf16 and adds ``weight · y`` in fp32 in
  slot order (``moe._combine``'s order), so a token's result does not depend on the other tokens of the call.

Every product is a bf16 x bf16 product in fp32; only the fp32 summation order differs from cuBLAS / CUTLASS.
The callers take these streams only for calls of at most ``MAX_ROWS`` rows, per weight shape where the tuners
(``SMALL_TUNER`` here) time them faster, and only while ``tuning_cache.small_rows_class()`` holds (off with
batch invariance or determinism): a row's bits at 1-4 rows then differ from its bits among 5+ rows by
summation order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from redknot.kernels import tuning_cache
from redknot.kernels.triton import slice_sum
from redknot.kernels.triton._common import (
    ConfigTuner,
    cdiv,
    check_last_dim_contiguous,
    interpreting,
)
from redknot.kernels.triton.gemv_plan import MAX_ROWS, GemvPlan, _block_k, slices


@dataclass(frozen=True)
class Bf16Plan:
    """Launch shape: ``block_n`` weight rows per program (``up_block_n`` for the experts' W1 | W3 launch),
    ``block_k`` weight elements per row and K step, ``num_warps``."""
    block_n: int = 4
    block_k: int = 512
    up_block_n: int = 4
    num_warps: int = 4
    min_steps: int = 2


# The tuners' GEMV candidates by name (the tuning store keeps names).
PLANS = {"bgemv": Bf16Plan(4, 512, 4), "bgemv_n8": Bf16Plan(8, 256, 8), "bgemv_n2": Bf16Plan(2, 1024, 2),
         "bgemv_n16": Bf16Plan(16, 256, 8, num_warps=8)}

# ``gemv``'s epilogues on the fp32 sums (the router's affinities: ``router_scores``).
EPILOGUES = {"": 0, "softplus_sqrt": 1}
# The router's affinities at 1-4 rows (``router_scores``, [256, 4096] for V4-Flash): the plan H100 run 13's tuner
# chose for the bf16 linears of that shape (0.009 ms a call, cuBLAS 0.011).
ROUTER_PLAN = PLANS["bgemv_n2"]

# Per weight shape, calls of at most ``MAX_ROWS`` rows: the library path first (``cublas`` / ``grouped``: what
# runs untimed off the GPU and under capture before a choice exists), then the GEMV plans, timed on one row.
LINEAR_SMALL_TUNER = ConfigTuner("linear_bf16_small", ["cublas", *PLANS])
MOE_SMALL_TUNER = ConfigTuner("moe_bf16_small", ["grouped", *PLANS])
GROUPED_SMALL_TUNER = ConfigTuner("grouped_linear_bf16_small", ["bmm", *PLANS])
SMALL_ROWS_CLASS = True


def small_rows(t: torch.Tensor, rows: int) -> bool:
    """Whether a call of ``rows`` rows of ``t`` may take a GEMV stream: the small-row class is on, the rows fit
    and the kernels can run (a CUDA tensor, or Triton's CPU interpreter)."""
    return (SMALL_ROWS_CLASS and tuning_cache.small_rows_class() and 0 < rows <= MAX_ROWS
            and (t.is_cuda or interpreting()))


@triton.jit
def _fma_rows(acc0, acc1, acc2, acc3, w, x_ptr, kk, stride_x, ROWS: tl.constexpr):
    """acc_r [BN, BK] + w [BN, BK] * x[r, kk] for each activation row r (elementwise: no reduction)."""
    acc0 += w * tl.load(x_ptr + kk).to(tl.float32)[None, :]
    if ROWS > 1:
        acc1 += w * tl.load(x_ptr + stride_x + kk).to(tl.float32)[None, :]
    if ROWS > 2:
        acc2 += w * tl.load(x_ptr + 2 * stride_x + kk).to(tl.float32)[None, :]
    if ROWS > 3:
        acc3 += w * tl.load(x_ptr + 3 * stride_x + kk).to(tl.float32)[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit
def _epilogue(y, EPI: tl.constexpr):
    """EPI 0: y; 1: sqrt(softplus(y)) (the router's affinity: softplus as torch's, threshold 20, log1p exact)."""
    if EPI == 1:
        e = tl.exp(tl.minimum(y, 20.0))
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))   # log1p(e) to a few ulps
        y = tl.sqrt(tl.where(y > 20.0, y, lp))
    return y


@triton.jit
def _store_row(base, acc, cmask, EPI: tl.constexpr):
    tl.store(base, _epilogue(tl.sum(acc, 1), EPI).to(base.dtype.element_ty), mask=cmask)


@triton.jit
def _gemv(x_ptr, w_ptr, p_ptr, out_ptr, cnt_ptr, N, K, KSPLIT, stride_x, stride_w, stride_ps, stride_pm, stride_om,
          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUM: tl.constexpr,
          EPI: tl.constexpr):
    """One program: BLOCK_N weight rows over one K slice of KSPLIT (a multiple of BLOCK_K, which divides K) for
    ROWS activation rows -> p[slice, row, cols] (fp32 partials, or the output itself with one slice). ``SUM``:
    the program that stores a column block's last partial adds the block's partials in slice order into
    ``out`` (``slice_sum``'s acquire-release counter per column block; ``reduce_rows``' arithmetic)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    kq = tl.max_contiguous(tl.arange(0, BLOCK_K), BLOCK_K)
    wrow = w_ptr + cols.to(tl.int64)[:, None] * stride_w + kq[None, :]
    k_lo = tl.program_id(1) * KSPLIT
    k_hi = tl.minimum(K, k_lo + KSPLIT)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = tl.load(wrow + k_lo, mask=cmask[:, None], other=0.0)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # the next step's weights first (the last step again at the slice's end: an L2 hit, no K mask)
        k1 = tl.multiple_of(tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K), BLOCK_K)
        w_n = tl.load(wrow + k1, mask=cmask[:, None], other=0.0)
        acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, w.to(tl.float32), x_ptr, k0 + kq, stride_x,
                                           ROWS)
        w = w_n
    base = p_ptr + tl.program_id(1).to(tl.int64) * stride_ps + cols
    PE: tl.constexpr = 0 if SUM else EPI   # partials take no epilogue; one slice stores the output itself
    _store_row(base, acc0, cmask, PE)
    if ROWS > 1:
        _store_row(base + stride_pm, acc1, cmask, PE)
    if ROWS > 2:
        _store_row(base + 2 * stride_pm, acc2, cmask, PE)
    if ROWS > 3:
        _store_row(base + 3 * stride_pm, acc3, cmask, PE)
    if SUM:
        S = tl.num_programs(1)
        tl.debug_barrier()   # every thread's partial stored before the release
        done = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")  # zero for the next launch
            for r in tl.static_range(ROWS):
                y = tl.zeros([BLOCK_N], tl.float32)
                for s in range(S):   # slice order 0..S-1, as reduce_rows
                    y += tl.load(p_ptr + s * stride_ps + r * stride_pm + cols, mask=cmask, other=0.0,
                                 cache_modifier=".cg")
                tl.store(out_ptr + r * stride_om + cols, _epilogue(y, EPI).to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _row_sum(wrow, x_row, K, cmask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_k w[n, k] x[k] over the whole K for BLOCK_N weight rows (elementwise accumulators, one step of
    register prefetch, added over K once at the end) -> fp32 [BLOCK_N]."""
    kq = tl.max_contiguous(tl.arange(0, BLOCK_K), BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w = tl.load(wrow + kq[None, :], mask=cmask[:, None], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        k1 = tl.multiple_of(tl.minimum(k0 + BLOCK_K, K - BLOCK_K), BLOCK_K)
        w_n = tl.load(wrow + k1 + kq[None, :], mask=cmask[:, None], other=0.0)
        acc += w.to(tl.float32) * tl.load(x_row + k0 + kq).to(tl.float32)[None, :]
        w = w_n
    return tl.sum(acc, 1)


@triton.jit
def _moe_up(x_ptr, ids_ptr, w1_ptr, w3_ptr, act_ptr, I, K, stride_x, stride_we, stride_wn, stride_a, limit,
            sw1_ptr, sw3_ptr, stride_swn, n_pairs,
            TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            SHARED: tl.constexpr = False):
    """Program (column block, pair): act[pair, cols] = swiglu(bf16(W1_e x_t), bf16(W3_e x_t)) for the pair's
    expert e and token t = pair // TOPK. ``SHARED``: pairs n_pairs + t are token t's shared expert (sw1, sw3)."""
    pair = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    if SHARED and pair >= n_pairs:
        x_row = x_ptr + (pair - n_pairs).to(tl.int64) * stride_x
        p1 = sw1_ptr + cols.to(tl.int64)[:, None] * stride_swn
        p3 = sw3_ptr + cols.to(tl.int64)[:, None] * stride_swn
    else:
        e = tl.load(ids_ptr + pair).to(tl.int64)
        off = e * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_x
        p1 = w1_ptr + off
        p3 = w3_ptr + off
    g = _row_sum(p1, x_row, K, cmask, BLOCK_N, BLOCK_K).to(tl.bfloat16).to(tl.float32)
    u = _row_sum(p3, x_row, K, cmask, BLOCK_N, BLOCK_K).to(tl.bfloat16).to(tl.float32)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    a = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + pair.to(tl.int64) * stride_a + cols, a.to(act_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _moe_down(act_ptr, ids_ptr, wt_ptr, w2_ptr, out_ptr, D, I, stride_a, stride_we, stride_wn, stride_o,
              sw2_ptr, stride_swn, n_pairs,
              TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SHARED: tl.constexpr = False):
    """Program (column block, token): out[t, cols] = Σ_j wt[t, j] · bf16(W2_e act[t·TOPK + j]) over the
    token's slots in slot order (fp32, one rounding at the store). ``SHARED``: + the shared expert's
    bf16(W2_s act[n_pairs + t]), added as two bf16 rows are (the routed sum rounded first)."""
    t = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < D
    rows = cols.to(tl.int64)[:, None] * stride_wn
    res = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOPK):
        pair = t * TOPK + j
        e = tl.load(ids_ptr + pair).to(tl.int64)
        wt = tl.load(wt_ptr + pair).to(tl.float32)
        y = _row_sum(w2_ptr + e * stride_we + rows, act_ptr + pair.to(tl.int64) * stride_a, I, cmask, BLOCK_N,
                     BLOCK_K)
        res += wt * y.to(tl.bfloat16).to(tl.float32)
    if SHARED:
        ys = _row_sum(sw2_ptr + cols.to(tl.int64)[:, None] * stride_swn,
                      act_ptr + (n_pairs + t).to(tl.int64) * stride_a, I, cmask, BLOCK_N, BLOCK_K)
        res = (res.to(out_ptr.dtype.element_ty).to(tl.float32)
               + ys.to(tl.bfloat16).to(out_ptr.dtype.element_ty).to(tl.float32))
    tl.store(out_ptr + t.to(tl.int64) * stride_o + cols, res.to(out_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _group_gemv(x_ptr, w_ptr, out_ptr, R, K, stride_xt, stride_xg, stride_wn, stride_ot, stride_og,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (column block, group g, row t): out[t, g, cols] = W[g·R + cols] · x[t, g] (fp32 sums, one rounding at
    the store)."""
    g = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < R
    wrow = w_ptr + (g * R + cols).to(tl.int64)[:, None] * stride_wn
    y = _row_sum(wrow, x_ptr + t * stride_xt + g * stride_xg, K, cmask, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + t * stride_ot + g * stride_og + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


def group_gemv(x: torch.Tensor, weight: torch.Tensor, plan: Bf16Plan = PLANS["bgemv"]) -> torch.Tensor:
    """``reference.grouped_linear`` (x [T, G, K], W [G·R, K] bf16 -> [T, G, R]) for at most ``MAX_ROWS`` rows: one
    launch of G GEMV streams, each group's weight rows read once."""
    T, G, K = x.shape
    if T > MAX_ROWS:
        raise ValueError(f"gemv_bf16.group_gemv: {T} rows; at most {MAX_ROWS}")
    if weight.shape[0] % G or weight.shape[1] != K:
        raise ValueError(f"gemv_bf16.group_gemv: weight {tuple(weight.shape)} for {G} groups of {K} columns")
    check_last_dim_contiguous("gemv_bf16.group_gemv weight", weight)
    R = weight.shape[0] // G
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(T, G, R, dtype=x.dtype, device=x.device)
    if T:
        _group_gemv[(cdiv(R, plan.block_n), G, T)](
            x, weight, out, R, K, x.stride(0), x.stride(1), weight.stride(0), out.stride(0), out.stride(1),
            BLOCK_N=plan.block_n, BLOCK_K=_block_k(K, plan.block_k, least=8), num_warps=plan.num_warps)
    return out


def grouped_choice(x: torch.Tensor, weight: torch.Tensor, library: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """``GROUPED_SMALL_TUNER``'s choice for this weight shape and group count (timed on one row on the class's
    first call): ``bmm`` (the library) or a plan of :func:`group_gemv`."""
    G, K = x.shape[1], x.shape[2]
    made = {}

    def run(choice: str) -> torch.Tensor:
        if "x" not in made:
            made["x"] = _tuning_input(x.device, G, K, x.dtype).view(1, G, K)
        return library(made["x"]) if choice == "bmm" else group_gemv(made["x"], weight, PLANS[choice])
    return GROUPED_SMALL_TUNER.pick((G, tuple(weight.shape), str(weight.dtype)), run, x.device)


def gemv(x2: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None,
         plan: Bf16Plan = PLANS["bgemv"], epilogue: str = "") -> torch.Tensor:
    """out [M, N] = x2 [M, K] · weightᵀ for M <= ``MAX_ROWS`` rows; x2 (bf16 or fp32) and weight [N, K] bf16 (K
    contiguous). ``epilogue`` "softplus_sqrt": sqrt(softplus(·)) of each fp32 sum before the store."""
    M, K = x2.shape
    N = weight.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"gemv_bf16.gemv: {M} rows; at most {MAX_ROWS}")
    check_last_dim_contiguous("gemv_bf16.gemv weight", weight)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(M, N, dtype=x2.dtype, device=x2.device) if out is None else out
    if M == 0:
        return out
    bk = _block_k(K, plan.block_k, least=8)
    S, ksplit = slices(N, K, GemvPlan(plan.block_n, bk, plan.min_steps), least=8)
    p = out if S == 1 else torch.empty(S, M, N, dtype=torch.float32, device=x2.device)
    nb = cdiv(N, plan.block_n)
    cnt = slice_sum.counters(x2.device, nb) if S > 1 else p
    _gemv[(nb, S)](x2, weight, p, out, cnt, N, K, ksplit, x2.stride(0), weight.stride(0), p.stride(0) if S > 1 else 0,
                   p.stride(-2), out.stride(0), ROWS=M, BLOCK_N=plan.block_n, BLOCK_K=bk, SUM=S > 1,
                   EPI=EPILOGUES[epilogue], num_warps=plan.num_warps)
    return out


def moe_gemv(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
             w2: torch.Tensor, w3: torch.Tensor, swiglu_limit: Optional[float], out: Optional[torch.Tensor] = None,
             plan: Bf16Plan = PLANS["bgemv"], shared=None) -> torch.Tensor:
    """``moe.moe_experts`` for at most ``MAX_ROWS`` tokens with bf16 experts w1 / w3 [E, I, D], w2 [E, D, I]:
    two launches, no routing (see the module docstring). ``shared`` = (w1, w2, w3) [I, D] / [D, I] / [I, D]: every
    token's shared expert too, in the same two launches, added to the routed rows as ``ref_moe.moe_shared`` adds
    them (the routed rows rounded to bf16 first)."""
    T, D = x.shape
    k = topk_ids.shape[1]
    E, inter = w1.shape[0], w1.shape[1]
    if T > MAX_ROWS:
        raise ValueError(f"gemv_bf16.moe_gemv: {T} tokens; at most {MAX_ROWS}")
    if w3.stride() != w1.stride():
        raise ValueError(f"gemv_bf16.moe_gemv: w1 and w3 must share strides, got {w1.stride()} and {w3.stride()}")
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        check_last_dim_contiguous(f"gemv_bf16.moe_gemv {name}", w)
    out = torch.empty(T, D, dtype=x.dtype, device=x.device) if out is None else out
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.to(torch.float32).contiguous()
    sh = shared is not None
    if sh:
        s1, s2, s3 = shared
        if s1.shape != w1.shape[1:] or s3.shape != w1.shape[1:] or s2.shape != w2.shape[1:]:
            raise ValueError(f"gemv_bf16.moe_gemv: shared expert {tuple(s1.shape)} / {tuple(s2.shape)} / "
                             f"{tuple(s3.shape)} against routed experts {tuple(w1.shape)} / {tuple(w2.shape)}")
        if s3.stride() != s1.stride():
            raise ValueError("gemv_bf16.moe_gemv: the shared w1 and w3 must share strides")
        for name, w in (("shared w1", s1), ("shared w2", s2), ("shared w3", s3)):
            check_last_dim_contiguous(f"gemv_bf16.moe_gemv {name}", w)
    else:
        s1 = s2 = s3 = w1
    act = torch.empty(T * (k + sh), inter, dtype=x.dtype, device=x.device)
    _moe_up[(cdiv(inter, plan.up_block_n), T * (k + sh))](
        x, ids, w1, w3, act, inter, D, x.stride(0), w1.stride(0) if E > 1 else 0, w1.stride(1), act.stride(0),
        float(swiglu_limit or 0.0), s1, s3, s1.stride(-2), T * k, TOPK=k, HAS_LIMIT=swiglu_limit is not None,
        BLOCK_N=plan.up_block_n, BLOCK_K=_block_k(D, plan.block_k, least=8), SHARED=sh, num_warps=plan.num_warps)
    _moe_down[(cdiv(D, plan.block_n), T)](
        act, ids, wts, w2, out, D, inter, act.stride(0), w2.stride(0) if E > 1 else 0, w2.stride(1), out.stride(0),
        s2, s2.stride(-2), T * k, TOPK=k, BLOCK_N=plan.block_n, BLOCK_K=_block_k(inter, plan.block_k, least=8),
        SHARED=sh, num_warps=plan.num_warps)
    return out


def _tuning_input(device: torch.device, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    return torch.randn(rows, cols, generator=g, device=device).to(dtype)


def linear_choice(x2: torch.Tensor, weight: torch.Tensor, library: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """``LINEAR_SMALL_TUNER``'s choice for this weight shape (timed on one row on the class's first call)."""
    made = {}

    def run(choice: str) -> torch.Tensor:
        if "x" not in made:
            made["x"] = _tuning_input(x2.device, 1, x2.shape[1], x2.dtype)
        return library(made["x"]) if choice == "cublas" else gemv(made["x"], weight, plan=PLANS[choice])
    return LINEAR_SMALL_TUNER.pick((tuple(weight.shape), str(weight.dtype)), run, x2.device)


def moe_choice(x: torch.Tensor, k: int, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
               limit: Optional[float], grouped: Callable[..., torch.Tensor]) -> str:
    """``MOE_SMALL_TUNER``'s choice for these expert shapes and slots (timed on one token routed at random with
    a fixed seed, on the class's first call). ``grouped(x, ids, weights)``: the library path."""
    made = {}

    def run(choice: str) -> torch.Tensor:
        if not made:
            E = w1.shape[0]
            g = torch.Generator(device=x.device).manual_seed(0)
            made["x"] = _tuning_input(x.device, 1, x.shape[1], x.dtype)
            made["ids"] = torch.rand(1, E, generator=g, device=x.device).topk(min(k, E), -1).indices
            made["wt"] = torch.rand(1, min(k, E), generator=g, device=x.device) + 0.1
        if choice == "grouped":
            return grouped(made["x"], made["ids"], made["wt"])
        return moe_gemv(made["x"], made["ids"], made["wt"], w1, w2, w3, limit, plan=PLANS[choice])
    key = (tuple(w1.shape), tuple(w2.shape), k, str(w1.dtype))
    return MOE_SMALL_TUNER.pick(key, run, x.device)
