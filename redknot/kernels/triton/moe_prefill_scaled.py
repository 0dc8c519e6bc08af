"""MoE prefill through a library FP8 grouped GEMM (``MoePlan("scaled", decode="e4m3_c<C>")``, a
``moe_mx.PREFILL_TUNER`` candidate).

The Triton FP8 plans (``moe_prefill_fp8``, ``moe_prefill_fold``) keep the MXFP4 weights packed and decode them in
registers inside a hand-written K loop; their loop steps are issue-bound by the per-32 scaling. Here the weights
are expanded once per call to e4m3 with one fp32 scale per (expert, output column) and the GEMMs are
``torch._scaled_grouped_mm`` (CUTLASS, SM90, FP8 operands with rowwise fp32 scales applied in the epilogue):

* **Weights** (``expand_e4m3``, one Triton kernel per matrix and expert chunk): a column's base ``b`` is the
  largest E8M0 byte of the column over all of K (at least 7, so the column scale ``2^(b - 133)`` is a normal fp32);
  group g's codes are written as ``e2m1 · 2^d`` with ``d = s(g) - b + 6``, rounded to e4m3 (round to nearest even).
  For d in [-8, 6] that value is an e4m3 number exactly (0.5 · 2^-8 = 2^-9 is the smallest e4m3 subnormal,
  6 · 2^6 = 384 <= 448; the fold of ``moe_prefill_fold``), so ``e4m3 · 2^(b - 133)`` is the stored weight exactly
  whenever every group of the column lies within ``EXACT_SPAN`` = 14 bytes of the base. A group further below
  rounds to the nearest e4m3 (it may lose bits or become zero: its values are at least 2^14 below the column's
  largest scale). The kernel counts such columns in a device counter (``inexact_columns``, no host sync); expert
  scratch of an expert with no rows is not written (the per-expert ends are read on the device).
* **Rows**: each (token, slot) pair's token row, gathered in expert order, quantised to e4m3 with one power-of-two
  scale per row, ``2^e`` with e the exponent rule of the reference's per-32 scales applied to the row's amax (the
  largest of the row's per-32 exponents). An element whose scaled value is a normal e4m3 number (>= 2^-6) gets
  the reference's per-32 QDQ value exactly (power-of-two scaling commutes with round-to-nearest on normals);
  an element more than ~2^14.8 below the row's amax becomes an e4m3 subnormal of the row scale (fewer bits than
  the reference's per-32 value, or zero). The same for the W2 input (the clamped SwiGLU times the routing weight,
  rounded to bf16, then one scale per row).
* W1 | W3 as one grouped GEMM (N = 2I; bf16 out, ``bf16(acc · s_row · s_col)``), SwiGLU + row quantisation (one
  kernel), W2, then ``splitk_mx.reduce_combine`` (a token's k slots in slot order).

So the products differ from the reference's only through the two roundings above (none at V4.1 weight statistics
where a column's scale bytes span < 15, and only for activation elements ~2^15 below their row's largest); the
plan is tolerance-gated like the other FP8 plans: on first use per plan on a CUDA device ``self_check`` compares it
with the ``grouped`` plan (``CHECK_TOL``) and the tuner falls back to ``grouped`` if it fails.

Memory: experts go through in chunks of C (``decode="e4m3_c<C>"``; ``e4m3_all``: every expert in one chunk). The
scratch is one [C, 2I, D] e4m3 buffer (W1 | W3, then reused for W2 [C, D, I] after the W1 | W3 GEMM) with its
column scales: C · 2 · I · D bytes, at V4.1 sizes (I = 2304, D = 5120) 23.6 MB an expert: 1.51 GB at C = 64,
3.02 GB at 128, 9.06 GB for all 384 (the e4m3 copy of all three matrices would be 13.6 GB). Row buffers, sized
for all T·k pairs (the per-chunk counts stay on the device): e4m3 rows [T·k, D], the W1 | W3 output [T·k, 2I] bf16,
the W2 input [T·k, I] e4m3, the W2 output [T·k, D] bf16 (and, with more than one chunk, the sorted slot results
[T·k, D] bf16 that each chunk's rows are scattered into): at T = 8192 (49152 pairs) 0.25 + 0.45 + 0.11 + 0.5
(+ 0.5) GB. The scratch is allocated per call (PyTorch's caching allocator hands the same blocks back to the next
layer's call), not kept between calls.

Traffic: the expansion reads the packed experts once (7.2 GB for 384 V4.1 experts with scales) and writes 13.6 GB of
e4m3 per call: ~5 ms at 4.17 TB/s whatever the token count; the GEMMs then read the e4m3 copy (compute-bound at
prefill sizes). Speed: not measured on the H200 (``benchmarks/kernels_v41.py --only prefill --prefill-decodes scaled``
times the plans, their parts and the grouped plan at 8192 and 32768 tokens).

``torch._scaled_grouped_mm`` (torch 2.8+; SM90 / SM100): A 2-D [M, K] e4m3 row-major, B 3-D [G, K, N] e4m3 column-
major (our [G, N, K] contiguous, transposed), K and N multiples of 16, ``scale_a`` fp32 [M] contiguous,
``scale_b`` fp32 [G, N], ``offs`` int32 [G] cumulative row ends (groups of zero rows allowed in the 2-D x 3-D form;
rows past ``offs[-1]`` are not written), bf16 out [M, N]; fewer than 1024 groups. Off CUDA (the interpreter tests)
``scaled_grouped_mm`` runs ``scaled_grouped_mm_ref``, the same math in PyTorch (fp32 products and sums, then
``acc · s_a · s_b`` rounded to bf16, the CUTLASS epilogue's order).
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2, sm_count
from redknot.kernels.triton.dequant_mx import (
    as_bytes,
    chunk_bounds,
    chunk_rows,
    e2m1_scaled,
)
from redknot.kernels.triton.quant_mx import e8m0_exponent, pow2

# A column's groups whose E8M0 byte is at most this far below the column's base expand to e4m3 exactly.
EXACT_SPAN = 14
# The smallest base byte (the column scale 2^(base - 133) stays a normal fp32).
MIN_BASE = 7
E4M3_MAX = 448.0
ACT_FLOOR = 1e-4  # the reference's amax floor of FP8 activation scales (``mx_formats.FP8_ACT_AMAX_FLOOR``)
# The expansion's launch shape: weight columns per program, K per loop step, warps (the benchmark times neighbours).
# H100 run 5, the 384 experts' W1 + W3 + W2 at V4.1 shapes: 16 x 512 w4 8.55 ms, 32 x 256 w4 9.06, 32 x 512 w8 9.39,
# 64 x 256 w8 10.33.
EXPAND_BLOCK_N = 16
EXPAND_BLOCK_K = 512
EXPAND_WARPS = 4
# Programs per SM of the row kernels (each walks rows with a stride of the grid: the chunk's count stays on the device).
ROW_PROGRAMS_PER_SM = 16


def chunk_experts(plan, experts: int) -> int:
    """Experts per chunk of ``plan`` (``decode`` ``e4m3_c<C>`` or ``e4m3_all``), at most ``experts``."""
    tail = plan.decode.split("_")[-1]
    if tail == "all":
        return experts
    if not tail.startswith("c") or not tail[1:].isdigit() or int(tail[1:]) < 1:
        raise ValueError(f"moe_prefill_scaled: decode {plan.decode!r}: expected 'e4m3_c<experts>' or 'e4m3_all'")
    return min(experts, int(tail[1:]))


def fast_accum(plan) -> bool:
    """``decode`` ``e4m3f_...``: the library's FP8 fast accumulation (no periodic promotion of the MMA sums)."""
    return plan.decode.startswith("e4m3f")


_INEXACT: dict[torch.device, torch.Tensor] = {}


def inexact_columns(device) -> torch.Tensor:
    """The device counter (int32 [1]) of expanded weight columns with a group more than ``EXACT_SPAN`` below the
    column's base, summed over every expansion on ``device`` since the last ``reset_inexact_columns``."""
    device = torch.device(device)
    if device not in _INEXACT:
        _INEXACT[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _INEXACT[device]


def reset_inexact_columns(device) -> None:
    inexact_columns(device).zero_()


@triton.jit
def _expand_e4m3(w_ptr, s_ptr, q_ptr, cs_ptr, bad_ptr, ends_ptr, e0, N, K, col0, stride_we, stride_wn, stride_se,
                 stride_sn, stride_qe, stride_qn, stride_ce, SKIP: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, KG_POW2: tl.constexpr, SPAN: tl.constexpr, BASE_MIN: tl.constexpr):
    """Program (column block, expert slot c): expert e0 + c's columns of packed MXFP4 w [E, N, K/2] (E8M0 s
    [E, N, K/32]) -> e4m3 q[c, col0 + n, :] and the column scales cs[c, col0 + n] (module docstring)."""
    c = tl.program_id(1)
    e = (e0 + c).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    live = True
    if SKIP:  # an expert without rows is not expanded (its scratch is never read: zero rows in the GEMM)
        end = tl.load(ends_ptr + e)
        start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
        live = end > start
    if live:
        KG = K // 32
        gs = tl.arange(0, KG_POW2)
        gmask = rmask[:, None] & (gs[None, :] < KG)
        s_row = s_ptr + e * stride_se + r64[:, None] * stride_sn
        sall = tl.load(s_row + gs[None, :], mask=gmask, other=0).to(tl.int32)
        base = tl.maximum(tl.max(sall, 1), BASE_MIN)
        low = tl.min(tl.where(gmask, sall, 255), 1)
        bad = (low < base - SPAN) & rmask
        tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32), 0))
        tl.store(cs_ptr + c.to(tl.int64) * stride_ce + col0 + rows, pow2(base - 133), mask=rmask)
        w_row = w_ptr + e * stride_we + r64[:, None] * stride_wn
        q_row = q_ptr + c.to(tl.int64) * stride_qe + (col0 + r64)[:, None] * stride_qn
        for k0 in range(0, K, BLOCK_K):
            hc = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            p = tl.load(w_row + hc[None, :], mask=rmask[:, None] & (hc[None, :] < K // 2), other=0).to(tl.int32)
            g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            sg = tl.load(s_row + g[None, :], mask=rmask[:, None] & (g[None, :] < KG), other=0).to(tl.int32)
            d = tl.maximum(sg - base[:, None] + 6, -20)  # below -20 every e2m1 value rounds to zero anyway
            codes = tl.reshape(tl.join(p & 0xF, (p >> 4) & 0xF), (BLOCK_N, BLOCK_K // 32, 32))
            v = tl.reshape(e2m1_scaled(codes, pow2(d)[:, :, None]), (BLOCK_N, BLOCK_K))
            cols = k0 + tl.arange(0, BLOCK_K)
            tl.store(q_row + cols[None, :], v.to(tl.float8e4nv), mask=rmask[:, None] & (cols[None, :] < K))


def expand_e4m3(w: torch.Tensor, ws: torch.Tensor, e0: int, e1: int, q: torch.Tensor, cs: torch.Tensor,
                col0: int = 0, ends: torch.Tensor | None = None, bad: torch.Tensor | None = None,
                block_n: int = 0, block_k: int = 0, num_warps: int = 0) -> None:
    """Experts e0..e1-1 of packed MXFP4 ``w`` [E, N, K/2] (E8M0 ``ws`` [E, N, K/32]) -> ``q[:e1-e0, col0:col0+N]``
    e4m3 [.., N, K] and ``cs[:e1-e0, col0:col0+N]`` fp32 column scales (``q · cs`` is the stored weight where the
    column is exact, module docstring). ``ends``: int32 per-expert row ends; experts without rows are skipped.
    ``bad``: int32 [1] counter of inexact columns (default ``inexact_columns(device)``). Launch shape: the
    ``EXPAND_*`` constants unless given."""
    _E, N, KH = w.shape
    K = 2 * KH
    if K % 32:
        raise ValueError(f"expand_e4m3: K={K} must be a multiple of 32")
    if e1 <= e0:
        return
    w, ws = as_bytes(w), as_bytes(ws)
    bad = bad if bad is not None else inexact_columns(w.device)
    block_n, block_k = block_n or EXPAND_BLOCK_N, block_k or EXPAND_BLOCK_K
    _expand_e4m3[(cdiv(N, block_n), e1 - e0)](
        w, ws, q, cs, bad, ends if ends is not None else bad, e0, N, K, col0, w.stride(0), w.stride(1), ws.stride(0),
        ws.stride(1), q.stride(0), q.stride(1), cs.stride(0), SKIP=ends is not None, BLOCK_N=block_n,
        BLOCK_K=min(block_k, next_pow2(K)), KG_POW2=next_pow2(K // 32), SPAN=EXACT_SPAN, BASE_MIN=MIN_BASE,
        num_warps=num_warps or EXPAND_WARPS)


def expand_e4m3_ref(w: torch.Tensor, ws: torch.Tensor):
    """PyTorch reference of ``expand_e4m3`` for all experts: (e4m3 [E, N, K], fp32 column scales [E, N], the count
    of inexact columns)."""
    from redknot.kernels import mx_formats as mx
    w, ws = as_bytes(w), as_bytes(ws)
    E, N, KH = w.shape
    codes = torch.stack([w & 0xF, w >> 4], -1).reshape(E, N, KH * 2)
    vals = mx.e2m1_decode(codes).float()
    s = ws.to(torch.int32)
    base = s.amax(-1).clamp_min(MIN_BASE)
    d = (s - base[..., None] + 6).clamp_min(-20)
    v = vals.view(E, N, -1, 32) * torch.exp2(d.float())[..., None]
    q = v.reshape(E, N, KH * 2).to(torch.float8_e4m3fn)
    cs = torch.exp2((base - 133).float())
    bad = int((s.amin(-1) < base - EXACT_SPAN).sum())
    return q, cs, bad


@triton.jit
def _rows_e4m3(x_ptr, rowid_ptr, bounds_ptr, q_ptr, s_ptr, e0, e1, D, stride_x, stride_q, GATHER: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """Rows of experts e0..e1-1 (sorted pairs ``start + r``; GATHER: token row ``rowid[start + r]`` of x) -> e4m3
    q[r] and the row's power-of-two scale s[r] (the reference's exponent rule on the row's amax)."""
    start, end = chunk_bounds(bounds_ptr, e0, e1)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    for r in range(tl.program_id(0), end - start, tl.num_programs(0)):
        if GATHER:
            src = tl.load(rowid_ptr + start + r).to(tl.int64)
        else:
            src = (start + r).to(tl.int64)
        v = tl.load(x_ptr + src * stride_x + cols, mask=cm, other=0.0).to(tl.float32)
        ex = e8m0_exponent(tl.max(tl.abs(v), 0), 448.0, 1e-4)
        q = tl.minimum(tl.maximum(v * pow2(-ex), -448.0), 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + tl.cast(r, tl.int64) * stride_q + cols, q, mask=cm)
        tl.store(s_ptr + r, pow2(ex))


def _row_grid(t: torch.Tensor, cap: int) -> int:
    return max(1, min(cap, sm_count(t) * ROW_PROGRAMS_PER_SM))


def rows_e4m3(x: torch.Tensor, rowid: torch.Tensor | None, bounds: torch.Tensor, e0: int, e1: int,
              q: torch.Tensor, s: torch.Tensor) -> None:
    """``q[r], s[r]`` = the e4m3 row and its scale of sorted pair ``start + r`` of experts e0..e1-1 (token row
    ``x[rowid[start + r]]``, or ``x[start + r]`` without ``rowid``), r < the chunk's count (on the device)."""
    D = x.shape[1]
    _rows_e4m3[(_row_grid(x, q.shape[0]),)](x, rowid if rowid is not None else bounds, bounds, q, s, e0, e1, D,
                                           x.stride(0), q.stride(0), GATHER=rowid is not None,
                                           BLOCK_D=next_pow2(D), num_warps=8)


@triton.jit
def _swiglu_e4m3(h_ptr, wt_ptr, bounds_ptr, q_ptr, s_ptr, e0, e1, I, stride_h, stride_q, limit,
                 BLOCK_I: tl.constexpr):
    """W1 | W3 rows h[r] = [g | u] (bf16) of experts e0..e1-1 -> a = bf16(w · silu(min(g, L)) · clamp(u, ±L)) as e4m3
    q[r] with its row scale s[r]."""
    start, end = chunk_bounds(bounds_ptr, e0, e1)
    cols = tl.arange(0, BLOCK_I)
    cm = cols < I
    for r in range(tl.program_id(0), end - start, tl.num_programs(0)):
        row = h_ptr + tl.cast(r, tl.int64) * stride_h
        g = tl.minimum(tl.load(row + cols, mask=cm, other=0.0).to(tl.float32), limit)
        u = tl.minimum(tl.maximum(tl.load(row + I + cols, mask=cm, other=0.0).to(tl.float32), -limit), limit)
        wt = tl.load(wt_ptr + start + r)
        a = (g / (1.0 + tl.exp(-g)) * u * wt).to(tl.bfloat16).to(tl.float32)
        ex = e8m0_exponent(tl.max(tl.abs(a), 0), 448.0, 1e-4)
        q = tl.minimum(tl.maximum(a * pow2(-ex), -448.0), 448.0).to(tl.float8e4nv)
        tl.store(q_ptr + tl.cast(r, tl.int64) * stride_q + cols, q, mask=cm)
        tl.store(s_ptr + r, pow2(ex))


def swiglu_e4m3(h: torch.Tensor, wt: torch.Tensor, bounds: torch.Tensor, e0: int, e1: int, limit: float,
                q: torch.Tensor, s: torch.Tensor) -> None:
    """The W2 input of chunk rows r: e4m3 ``q[r]`` and row scale ``s[r]`` from ``h[r]`` = [g | u] [.., 2I] bf16 and
    the routing weight ``wt[start + r]`` (fp32, per sorted pair)."""
    inter = q.shape[1]
    _swiglu_e4m3[(_row_grid(h, q.shape[0]),)](h, wt, bounds, q, s, e0, e1, inter, h.stride(0), q.stride(0),
                                             float(limit), BLOCK_I=next_pow2(inter), num_warps=8)


def row_quant_ref(v: torch.Tensor):
    """PyTorch reference of the row quantisation: (e4m3 rows, fp32 power-of-two scale per row)."""
    from redknot.kernels import mx_formats as mx
    v = v.float()
    sbyte = mx.pow2_scale_e8m0(v.abs().amax(-1), E4M3_MAX, ACT_FLOOR)
    s = mx.e8m0_decode(sbyte)
    return (v / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def scaled_grouped_mm_ref(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                          offs: torch.Tensor) -> torch.Tensor:
    """The rowwise-scaled grouped GEMM in PyTorch: rows [offs[g-1], offs[g]) of e4m3 ``a`` [M, K] times e4m3
    ``b[g]`` [N, K] transposed, fp32 sums, then ``acc · sa[row] · sb[g, col]`` rounded to bf16 [M, N] (rows past
    ``offs[-1]`` zero). Reads ``offs`` on the host."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            acc = a[start:end].float() @ b[g].float().t()
            out[start:end] = (acc * sa[start:end, None] * sb[g][None, :]).to(torch.bfloat16)
        start = end
    return out


def scaled_grouped_mm(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, offs: torch.Tensor,
                      fast: bool = False) -> torch.Tensor:
    """``scaled_grouped_mm_ref``'s result: on CUDA ``torch._scaled_grouped_mm`` (no host sync), elsewhere the
    reference. ``b`` [G, N, K] contiguous e4m3 (passed transposed: column-major [G, K, N]), ``sb`` [G, N]."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)
    return scaled_grouped_mm_ref(a, sa, b, sb, offs)


def moe_prefill_scaled(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
                       plan, parts: dict | None = None) -> torch.Tensor:
    """``moe_mx`` through e4m3 experts and ``torch._scaled_grouped_mm`` (module docstring). No host sync on CUDA.
    ``parts``: a dict that receives the last chunk's buffers (benchmarks time the parts from them)."""
    from redknot.kernels.triton.moe_mx import _sorted_pairs
    from redknot.kernels.triton.splitk_mx import reduce_combine
    T, k = topk_idx.shape
    E, inter, DH = w1.shape
    D = 2 * DH
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if D % 32 or inter % 32:
        raise ValueError(f"moe_prefill_scaled: hidden {D} and expert width {inter} must be multiples of 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, inv, offs, wt = _sorted_pairs(topk_idx, topk_weight, E)
    bounds = torch.cat([offs.new_zeros(1), offs])
    M = T * k
    C = chunk_experts(plan, E)
    dev = x.device
    w13 = torch.empty(C, 2 * inter, D, dtype=torch.float8_e4m3fn, device=dev)
    w2e = w13.view(-1)[:C * D * inter].view(C, D, inter)  # W2 reuses the W1 | W3 scratch after its GEMM
    cs13 = torch.empty(C, 2 * inter, dtype=torch.float32, device=dev)
    cs2 = torch.empty(C, D, dtype=torch.float32, device=dev)
    a = torch.empty(M, D, dtype=torch.float8_e4m3fn, device=dev)
    sa = torch.empty(M, dtype=torch.float32, device=dev)
    act = torch.empty(M, inter, dtype=torch.float8_e4m3fn, device=dev)
    sact = torch.empty(M, dtype=torch.float32, device=dev)
    y = torch.empty(M, D, dtype=torch.bfloat16, device=dev) if C < E else None
    fast = fast_accum(plan)
    for e0 in range(0, E, C):
        e1 = min(E, e0 + C)
        n = e1 - e0
        offs_c = offs[e0:e1] - bounds[e0] if e0 else offs[e0:e1]
        expand_e4m3(w1, w1_scale, e0, e1, w13, cs13, 0, offs)
        expand_e4m3(w3, w3_scale, e0, e1, w13, cs13, inter, offs)
        rows_e4m3(x, rows, bounds, e0, e1, a, sa)
        h = scaled_grouped_mm(a, sa, w13[:n], cs13[:n], offs_c, fast)
        swiglu_e4m3(h, wt, bounds, e0, e1, swiglu_limit, act, sact)
        del h
        expand_e4m3(w2, w2_scale, e0, e1, w2e, cs2, 0, offs)
        y_c = scaled_grouped_mm(act, sact, w2e[:n], cs2[:n], offs_c, fast)
        if y is None:
            y = y_c
        else:
            chunk_rows(y_c, y, bounds, e0, e1, gather=False)
        if parts is not None:
            parts.update({"a": a, "sa": sa, "act": act, "sact": sact, "w13": w13[:n], "cs13": cs13[:n],
                          "w2e": w2e[:n], "cs2": cs2[:n], "offs_c": offs_c, "bounds": bounds, "rows": rows, "wt": wt,
                          "e0": e0, "e1": e1, "inv": inv, "fast": fast})
    return reduce_combine(y[None], inv, k, out)


# First use per plan on a CUDA device: the plan against ``moe_mx.moe_grouped`` (bf16 experts, exact per-32 QDQ
# rows, ``torch._grouped_mm``) on fresh random experts. The plan's own roundings (row-scaled activations) move a
# bf16 slot by an ulp here and there (~1e-3 norm-wise); a wrong expansion, scale or epilogue is off by O(1).
CHECK_TOL = 2e-2
_CHECKED: set = set()


def self_check(plan, device: torch.device, seed: int = 4321) -> str | None:
    """None when ``plan`` computes what ``moe_mx.moe_grouped`` computes (within ``CHECK_TOL``) on fresh random
    MXFP4 experts with uneven rows per expert, an empty expert and more than one chunk where the plan chunks."""
    from redknot.kernels.triton.moe_mx import moe_grouped
    from redknot.kernels.triton.stream_guard import random_moe
    g = torch.Generator(device=device).manual_seed(seed)
    E, D, inter, T, k = 5, 256, 192, 40, 2
    packed, x = random_moe(g, device, E, D, inter, T)
    pick = torch.rand(T, E - 1, generator=g, device=device) * torch.arange(1, E, device=device)
    idx = pick.topk(k, -1).indices  # skewed counts; the last expert empty
    wt = torch.rand(T, k, generator=g, device=device) + 0.1
    got = moe_prefill_scaled(x, idx, wt, *packed, 10.0, plan)
    want = moe_grouped(x, idx, wt, *packed, 10.0)
    err = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    return None if err <= CHECK_TOL else f"differs from the grouped plan by {err:.3g} (tolerance {CHECK_TOL:g})"


def guarded(plan, device: torch.device, fast, fallback):
    """``fast()`` unless ``plan`` failed its first run or ``self_check`` on this CUDA device (recorded in
    ``stream_guard.DECODE_ERRORS``, which the benchmarks print; then ``fallback()``, the grouped plan)."""
    from redknot.kernels.triton import stream_guard
    if device.type != "cuda":
        return fast()
    errors = stream_guard.DECODE_ERRORS

    def fail(key, err):
        errors[key] = err
        warnings.warn(f"moe_prefill_scaled: plan {key} is not used on this device ({err}); running 'grouped'")
    return stream_guard.first_use(plan, _CHECKED, errors, lambda: self_check(plan, device), fast, fallback, fail)
