"""The second launch of ``step_proj_v41``'s fused linears: per output row the slice sum of the weight stream's
partials and ``rope_rows``'s per-row code (``_epilogue2``), or per (token, column block) the slice sum and the mHC
post mix (``_epilogue_post``, ``step_proj_v41.linear_post``); and the GEMV with that post epilogue in the stream
launch (``_gemv_post``, ``fpgemv*``: the last program of each column block, found by an acquire-release counter,
runs it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import DeviceCounters, cdiv
from redknot.kernels.triton.mhc import _post_mix
from redknot.kernels.triton.quant_mx import (
    e2m1_code,
    e2m1_value,
    e8m0_exponent,
    pow2,
)
from redknot.kernels.triton.step_proj_stream_v41 import _gemv_tile, plan_name
from redknot.kernels.triton.step_rope_v41 import _rotate_pairs


@triton.jit
def _reduce_row(p_ptr, raw_ptr, row, tok, head, S, stride_ps, stride_pm, D: tl.constexpr, DP: tl.constexpr,
                CG: tl.constexpr = False):
    """raw[row] = Σ_s p[s, tok, head·D : (head+1)·D] in slice order, cast (``reduce_rows``). CG: the partials
    load from L2 (written by other programs of the same launch)."""
    cols = tl.arange(0, DP)
    m = cols < D
    off = tok * stride_pm + head * D + cols
    acc = tl.zeros([DP], tl.float32)
    for s in range(S):  # slice order 0..S-1
        if CG:
            acc += tl.load(p_ptr + s * stride_ps + off, mask=m, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(p_ptr + s * stride_ps + off, mask=m, other=0.0)
    tl.store(raw_ptr + row * D + cols, acc.to(raw_ptr.dtype.element_ty), mask=m)


@triton.jit
def _row_epilogue(x_ptr, out_ptr, row, tok, cos_ptr, sin_ptr, w_ptr, pack_ptr, stride_c, eps, D: tl.constexpr,
                  D2P: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr, QDQ: tl.constexpr, PACK: tl.constexpr,
                  ASM: tl.constexpr):
    """``step_rope_v41._rope_rows``'s per-row code (not inverse) on row ``row`` of a contiguous [R, D] input;
    PACK: also the row's window-cache bytes (``quant_mx._insert_rows`` FMT 0: e4m3 + E8M0 per 32) at row
    ``row`` of ``pack_ptr`` [R, D + D/32], from the same values ``cache_insert_mx`` would load."""
    D2: tl.constexpr = D // 2
    FIRST: tl.constexpr = D2 - HALF
    i = tl.arange(0, D2P)
    two = tl.arange(0, 2)
    offs = i[:, None] * 2 + two[None, :]
    inside = (i < D2)[:, None] & (two[None, :] < 2)
    x = tl.load(x_ptr + row * D + offs, mask=inside, other=0.0).to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(tl.sum(x * x, 1), 0) / D + eps)
        w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        x = (w * (x * r)).to(out_ptr.dtype.element_ty).to(tl.float32)
    re, im = tl.split(x)
    new_re, new_im = _rotate_pairs(re, im, i, cos_ptr + tok * stride_c, sin_ptr + tok * stride_c, FIRST, D2,
                                   False, out_ptr.dtype.element_ty, ASM)
    y = tl.reshape(tl.join(new_re, new_im), (2 * D2P,))
    if QDQ:
        g = tl.reshape(y, (2 * D2P // 32, 32))
        e = e8m0_exponent(tl.max(tl.abs(g), 1), 6.0, 7.052966104933725e-38)
        code = e2m1_code(g * pow2(-e)[:, None])
        y = tl.reshape(e2m1_value(code) * pow2(e)[:, None], (2 * D2P,))
    cols = tl.arange(0, 2 * D2P)
    y = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * D + cols, y, mask=cols < D)
    if PACK:
        NG: tl.constexpr = 2 * D2P // 32
        xg = tl.reshape(y.to(tl.float32), (NG, 32))
        e = e8m0_exponent(tl.max(tl.abs(xg), 1), 448.0, 1e-4)
        qv = tl.reshape(xg * pow2(-e)[:, None], (2 * D2P,))
        qv = tl.minimum(tl.maximum(qv, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        pbase = pack_ptr + row * (D + D // 32)
        tl.store(pbase + cols, qv, mask=cols < D)
        gs = tl.arange(0, NG)
        tl.store(pbase + D + gs, (e + 127).to(tl.uint8), mask=gs < D // 32)


@triton.jit
def _epilogue2(cos_ptr, sin_ptr, stride_c, n0,
               p0_ptr, raw0_ptr, out0_ptr, w0_ptr, S0, stride_p0s, stride_p0m, eps0, H0,
               p1_ptr, raw1_ptr, out1_ptr, w1_ptr, S1, stride_p1s, stride_p1m, eps1, H1, pack_ptr,
               D0: tl.constexpr, D2P0: tl.constexpr, HALF0: tl.constexpr, NORM0: tl.constexpr, QDQ0: tl.constexpr,
               D1: tl.constexpr, D2P1: tl.constexpr, HALF1: tl.constexpr, NORM1: tl.constexpr, QDQ1: tl.constexpr,
               PACK1: tl.constexpr, ASM: tl.constexpr):
    """Programs [0, n0): rows (token, head) of output 0, the rest those of output 1."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < n0:
        tok = pid // H0
        _reduce_row(p0_ptr, raw0_ptr, pid, tok, pid - tok * H0, S0, stride_p0s, stride_p0m, D0, 2 * D2P0)
        tl.debug_barrier()   # the row's raw values, stored by every thread of the program, then read back
        _row_epilogue(raw0_ptr, out0_ptr, pid, tok, cos_ptr, sin_ptr, w0_ptr, pack_ptr, stride_c, eps0, D0, D2P0,
                      HALF0, NORM0, QDQ0, False, ASM)
    else:
        row = pid - n0
        tok = row // H1
        _reduce_row(p1_ptr, raw1_ptr, row, tok, row - tok * H1, S1, stride_p1s, stride_p1m, D1, 2 * D2P1)
        tl.debug_barrier()
        _row_epilogue(raw1_ptr, out1_ptr, row, tok, cos_ptr, sin_ptr, w1_ptr, pack_ptr, stride_c, eps1, D1, D2P1,
                      HALF1, NORM1, QDQ1, PACK1, ASM)


@triton.jit
def _post_block(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dblk, D, stride_y, stride_st, stride_sn, stride_ot,
                stride_on, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``mhc._mhc_post``'s code for one (token, column block): out[k] = post[k]·y + Σ_j C[j, k]·h[j]."""
    dd = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dd < D
    offs_n = tl.arange(0, N)
    y = tl.load(y_ptr + tok * stride_y + dd, mask=dmask, other=0.0).to(tl.float32)
    _post_mix(y, s_ptr, post_ptr, comb_ptr, out_ptr, tok, dd, dmask, offs_n, stride_st, stride_sn, stride_ot,
              stride_on, N)


@triton.jit
def _epilogue_post(p_ptr, y_ptr, S, stride_ps, stride_pm, H, s_ptr, post_ptr, comb_ptr, out_ptr, stride_st, stride_sn,
                   stride_ot, stride_on, D: tl.constexpr, N: tl.constexpr):
    """Row (token, block) of a linear without a row epilogue: the slice sum (``reduce_rows``) into ``y``, then the
    mHC post mix of that column block (``mhc_post`` with ``BLOCK_D`` = D)."""
    pid = tl.program_id(0).to(tl.int64)
    tok = pid // H
    blk = pid - tok * H
    _reduce_row(p_ptr, y_ptr, pid, tok, blk, S, stride_ps, stride_pm, D, D)
    tl.debug_barrier()   # the block's y, stored by every thread of the program, then read back
    _post_block(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, tok, blk, H * D, H * D, stride_st, stride_sn, stride_ot,
                stride_on, N, D)


@triton.jit
def _gemv_post(x_ptr, KW, stride_x, xs_ptr, stride_xs, w_ptr, s_ptr, p_ptr, N, KS, S, stride_w, stride_s, stride_ps,
               stride_pm, cnt_ptr, y_ptr, H, h_ptr, post_ptr, comb_ptr, out_ptr, stride_st, stride_sn, stride_ot,
               stride_on, WB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_ASM: tl.constexpr, D: tl.constexpr, NS: tl.constexpr):
    """``linear_post``'s two launches in one: each program streams its (column block, K slice) as ``_gemv2`` with
    QX 2 and stores its partials; then a barrier and one acquire-release increment of its D-wide block's counter
    (the partials released at GPU scope); the program that takes the count to the block's last value (every
    program of the block has stored its partials) resets it and runs ``_epilogue_post``'s code for the block and
    each row (the slice sum in slice order, from L2; the mHC post mix). The bits of the two launches."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    _gemv_tile(x_ptr, w_ptr, s_ptr, p_ptr, pid_n, pid_s, N, KW, KS, stride_x, stride_w, stride_s, stride_ps,
               stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, 2, xs_ptr, stride_xs)
    tl.debug_barrier()   # every thread's partials stored before the release
    blk = (pid_n * BLOCK_N) // D
    done = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
    if done == (D // BLOCK_N) * S - 1:
        tl.atomic_xchg(cnt_ptr + blk, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
        for t in tl.static_range(ROWS):
            _reduce_row(p_ptr, y_ptr, t * H + blk, t, blk, S, stride_ps, stride_pm, D, D, True)
            tl.debug_barrier()   # the block's y, stored by every thread of the program, then read back
            _post_block(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, t, blk, H * D, H * D, stride_st, stride_sn,
                        stride_ot, stride_on, NS, D)


# the block counters of _gemv_post (see DeviceCounters)
_counters = DeviceCounters(1024)
_COUNTERS = _counters.sets


def _post_fused(x, weight, scale, s, post, comb, out, block: int, bd: int, name: str) -> torch.Tensor:
    """``step_proj_v41.linear_post`` with ``fpgemv*``: one ``_gemv_post`` launch (at most ``gemv_mx.MAX_ROWS`` bf16
    rows)."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes
    plan = gemv_mx.PLANS[plan_name(name)]
    T, K = x.shape
    D = weight.shape[0]
    if (T > gemv_mx.MAX_ROWS or x.dtype != torch.bfloat16 or block % plan.block_n or bd % plan.block_n
            or x.stride(0) % 2):
        raise ValueError(f"linear_post: {name} takes at most {gemv_mx.MAX_ROWS} bf16 rows and a column block "
                         f"({bd}) and scale tile ({block}) that its {plan.block_n} columns divide")
    bk = gemv_mx._block_k(K, plan.block_k)
    S, ks = gemv_mx.slices(D, K, plan)
    part = torch.empty(S, T, D, dtype=torch.float32, device=x.device)
    xs = torch.empty(T, K, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    wb = as_bytes(weight).view(torch.int32)
    sc = as_bytes(scale)
    _gemv_post[(cdiv(D, plan.block_n), S)](
        x.view(torch.int32), K // 4, x.stride(0) // 2, xs.view(torch.int32), xs.stride(0) // 2, wb, sc, part, D, ks,
        S, wb.stride(0), sc.stride(0), part.stride(0), part.stride(1), _counters(x.device, D // bd), y, D // bd, s,
        post.float().contiguous(), comb.float().contiguous(), out, s.stride(0), s.stride(1), out.stride(0),
        out.stride(1), WB=block, ROWS=T, BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(), D=bd,
        NS=s.shape[1], num_warps=plan.num_warps, num_stages=plan.num_stages)
    return out
