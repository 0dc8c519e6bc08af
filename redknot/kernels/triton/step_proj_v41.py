"""Two decode-size FP8 linears that read the same rows, with their row epilogues, in two launches.

A V4.1 attention layer projects its input ``u`` twice (``wq_a`` -> the q latent, ``wkv`` -> the kv latent) and
the normalised q latent once more (``wq_b`` -> the query heads), each through ``linear_mx`` (at decode sizes
with the ``fp8`` decode: activation quantisation, split-K FP8 weight stream, slice reduction: three launches)
followed by a row kernel (``step_rope_v41.rope_rows``: norm, RoPE, FP4 grid). :func:`proj_rows` runs up to two
such linears over the same rows and their row epilogues in two launches:

* one FP8 weight stream over both weights (``stream_fp8._fp8_stream`` with the rows quantised per 32 inside,
  the bits of ``act_quant_mx``): the column blocks of the first weight, then those of the second, each with
  the K slices ``splitk_mx.splitk_mm`` cuts for its own shape with ``decode="fp8"`` (the same partials);
* one program per output row (a token's head): the slice sum in slice order cast to the row dtype (the bits of
  ``splitk_mx.reduce_rows``) into a scratch row, then ``rope_rows``'s own per-row code on that row (same loads,
  shapes and warps: the same bits).

So the outputs are bit for bit ``rope_rows(linear_mx(x, W), ...)`` with the ``fp8`` decode, which the tests
check. Two launches instead of up to eight; not measured on the H200.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, interpreting, next_pow2
from redknot.kernels.triton.quant_mx import e2m1_code, e2m1_value, e8m0_decode, e8m0_exponent, pow2
from redknot.kernels.triton.step_rope_v41 import _mul_rn

# Rows up to which the step runs these kernels (decode and speculative verify), as the MoE's step kernels.
MAX_ROWS = 16


@triton.jit
def _fp8_tile(a_ptr, b_ptr, sb_ptr, p_ptr, pid_m, pid_n, pid_s, M, N, K, KSPLIT, stride_am, stride_bn, stride_sbn,
              stride_ps, stride_pm, WB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              GROUPS: tl.constexpr):
    """``stream_fp8._fp8_stream`` with A_RAW for one (row tile, column block, K slice)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    c64 = cols.to(tl.int64)
    wrow = (cols // WB).to(tl.int64) * stride_sbn
    k_lo = pid_s * KSPLIT
    k_hi = tl.minimum(K, k_lo + KSPLIT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k_step in range(k_lo, k_hi, 32 * GROUPS):
        for g in tl.static_range(GROUPS):
            k0 = tl.multiple_of(k_step + 32 * g, 32)
            kk = tl.max_contiguous(tl.multiple_of(k0 + tl.arange(0, 32), 32), 32)
            x = tl.load(a_ptr + r64[:, None] * stride_am + kk[None, :], mask=rmask[:, None], other=0.0)
            x = x.to(tl.float32)
            e = e8m0_exponent(tl.max(tl.abs(x), 1), 448.0, 1e-4)
            a = tl.minimum(tl.maximum(x * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
            sa = pow2(e)
            w = tl.load(b_ptr + c64[:, None] * stride_bn + kk[None, :], mask=cmask[:, None], other=0.0)
            sw = e8m0_decode(tl.load(sb_ptr + wrow + k0 // WB, mask=cmask, other=127))
            acc += tl.dot(w, tl.trans(a)) * (sw[:, None] * sa[None, :])
    out = pid_s.to(tl.int64) * stride_ps + r64[:, None] * stride_pm + cols[None, :]
    tl.store(p_ptr + out, tl.trans(acc), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _stream2(a_ptr, M, K, stride_am,
             b0_ptr, sb0_ptr, p0_ptr, N0, KS0, S0, NB0, stride_b0, stride_sb0, stride_p0s, stride_p0m,
             b1_ptr, sb1_ptr, p1_ptr, N1, KS1, S1, stride_b1, stride_sb1, stride_p1s, stride_p1m,
             WB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS0: tl.constexpr,
             GROUPS1: tl.constexpr):
    """Column blocks [0, NB0) stream weight 0 (slices < S0), the rest weight 1 (slices < S1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_n < NB0:
        if pid_s < S0:
            _fp8_tile(a_ptr, b0_ptr, sb0_ptr, p0_ptr, pid_m, pid_n, pid_s, M, N0, K, KS0, stride_am, stride_b0,
                      stride_sb0, stride_p0s, stride_p0m, WB, BLOCK_M, BLOCK_N, GROUPS0)
    else:
        if pid_s < S1:
            _fp8_tile(a_ptr, b1_ptr, sb1_ptr, p1_ptr, pid_m, pid_n - NB0, pid_s, M, N1, K, KS1, stride_am, stride_b1,
                      stride_sb1, stride_p1s, stride_p1m, WB, BLOCK_M, BLOCK_N, GROUPS1)


@triton.jit
def _reduce_row(p_ptr, raw_ptr, row, tok, head, S, stride_ps, stride_pm, D: tl.constexpr, DP: tl.constexpr):
    """raw[row] = Σ_s p[s, tok, head·D : (head+1)·D] in slice order, cast (``reduce_rows``)."""
    cols = tl.arange(0, DP)
    m = cols < D
    off = tok * stride_pm + head * D + cols
    acc = tl.zeros([DP], tl.float32)
    for s in range(S):  # slice order 0..S-1
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
    rot = (i >= FIRST) & (i < D2)
    j = tl.maximum(i - FIRST, 0)
    c = tl.load(cos_ptr + tok * stride_c + j, mask=rot, other=1.0)
    s = tl.load(sin_ptr + tok * stride_c + j, mask=rot, other=0.0)
    new_re = _mul_rn(re, c, ASM) - _mul_rn(im, s, ASM)
    new_im = _mul_rn(re, s, ASM) + _mul_rn(im, c, ASM)
    new_re = tl.where(rot, new_re.to(out_ptr.dtype.element_ty).to(tl.float32), re)
    new_im = tl.where(rot, new_im.to(out_ptr.dtype.element_ty).to(tl.float32), im)
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
    x = tl.load(s_ptr + tok * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dmask[None, :],
                other=0.0).to(tl.float32)  # [N(j), BLOCK_D]
    cm = tl.load(comb_ptr + tok * N * N + offs_n[:, None] * N + offs_n[None, :])  # [N(j), N(k)]
    p = tl.load(post_ptr + tok * N + offs_n)
    mixed = tl.sum(cm[:, :, None] * x[:, None, :], 0)  # [N(k), BLOCK_D]
    o = p[:, None] * y[None, :] + mixed
    tl.store(out_ptr + tok * stride_ot + offs_n[:, None] * stride_on + dd[None, :], o.to(out_ptr.dtype.element_ty),
             mask=dmask[None, :])


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


def linear_post(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, block: int = 32) -> torch.Tensor:
    """``mhc_post(linear_mx(x, weight, scale), h, post, comb)`` with the ``fp8`` decode in two launches, the same
    bits: the FP8 stream, then one program per (token, column block of ``mhc_post``'s width) that sums the slices
    and mixes the block into the n streams. x [T, K] 16-bit, weight e4m3 [D, K], h [T, n, D] (n a power of two),
    post [T, n] / comb [T, n, n] fp32 -> h' [T, n, D] in h's dtype."""
    T, K = x.shape
    D = weight.shape[0]
    n = h.shape[1]
    bd = min(512, next_pow2(D))
    if (h.shape != (T, n, D) or D % bd or bd % 2 or n & (n - 1) or weight.dtype != torch.float8_e4m3fn
            or weight.shape[1] != K or K % 32 or block % 32 or x.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"linear_post: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, h "
                         f"{tuple(h.shape)}: need h [T, n, D] (n a power of two), D a multiple of min(512, D's "
                         "power of two), K and block multiples of 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    s = h.contiguous()
    out = torch.empty_like(s)
    if T == 0:
        return out
    scale = scale.view(torch.uint8)
    S, ks, bm, bn = slices(D, K, T)
    part = torch.empty(S, T, D, dtype=torch.float32, device=x.device)
    g = 4 if ks % 128 == 0 and K % 128 == 0 else 1
    _stream2[(cdiv(T, bm), cdiv(D, bn), S)](
        x, T, K, x.stride(0), weight, scale, part, D, ks, S, cdiv(D, bn), weight.stride(0), scale.stride(0),
        part.stride(0), part.stride(1), weight, scale, part, D, ks, S, weight.stride(0), scale.stride(0),
        part.stride(0), part.stride(1), WB=block, BLOCK_M=bm, BLOCK_N=bn, GROUPS0=g, GROUPS1=g, num_warps=4,
        num_stages=4)
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    _epilogue_post[(T * (D // bd),)](part, y, S, part.stride(0), part.stride(1), D // bd, s, post.float().contiguous(),
                                     comb.float().contiguous(), out, s.stride(0), s.stride(1), out.stride(0),
                                     out.stride(1), D=bd, N=n, num_warps=4)
    return out


def slices(N: int, K: int, rows: int) -> Tuple[int, int, int, int]:
    """(S, ksplit, block_m, block_n) of ``splitk_mx.splitk_mm`` with ``decode="fp8"`` for an [N, K] weight."""
    from redknot.kernels.triton import splitk_mx as sk
    block_n = sk.SCALED_BLOCK_N
    bk = sk.block_k_for(K, False, sk.SCALED_BLOCK_K)
    S = sk.split_count(N, K, block_n, bk, sk.SCALED_MIN_STEPS) if rows <= sk.SPLIT_MAX_ROWS else 1
    ksplit = cdiv(cdiv(K, S), bk) * bk
    return cdiv(K, ksplit), ksplit, sk.dense_row_tile(rows), block_n


def epilogue_warps(specs: Sequence["Proj"]) -> Optional[int]:
    """The warps of the epilogue launch: those ``rope_rows`` runs each row kind with (1 up to 128 columns, else
    4). A normalised row's sum of squares depends on them, so its kind decides; None: two normalised kinds
    that ``rope_rows`` would run with different warps (one launch cannot give both their bits)."""
    def warps(d):
        return 1 if d <= 128 else 4
    normed = {warps(s.dim) for s in specs if s.norm_w is not None}
    if len(normed) > 1:
        return None
    return normed.pop() if normed else max(warps(s.dim) for s in specs)


class Proj:
    """One linear of :func:`proj_rows` and its row epilogue: ``weight`` e4m3 [H·dim, K] with E8M0 ``scale``
    tiles, output rows [T, H, dim]; ``norm_w``: RMS norm first (``eps``); ``rope``: rotate the last ``2·half``
    dims by the call's cos/sin; ``qdq``: the FP4 grid after (``rope_rows``'s options)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dim: int, norm_w: Optional[torch.Tensor] = None,
                 eps: float = 0.0, rope: bool = False, qdq: bool = False):
        self.weight, self.scale, self.dim = weight, scale.view(torch.uint8), dim
        self.norm_w, self.eps, self.rope, self.qdq = norm_w, eps, rope, qdq
        self.heads = weight.shape[0] // dim


def check(x: torch.Tensor, specs: Sequence[Proj], half: int, block: int) -> None:
    if not 1 <= len(specs) <= 2:
        raise ValueError(f"proj_rows: {len(specs)} linears (1 or 2)")
    K = x.shape[-1]
    for s in specs:
        N = s.weight.shape[0]
        if s.weight.dtype != torch.float8_e4m3fn or s.weight.shape[1] != K or N % s.dim:
            raise ValueError(f"proj_rows: weight {tuple(s.weight.shape)} {s.weight.dtype} must be e4m3 [H·{s.dim}, "
                             f"{K}]")
        if s.dim % 2 or (s.rope and 2 * half > s.dim) or (s.qdq and (s.dim & (s.dim - 1) or s.dim < 32)):
            raise ValueError(f"proj_rows: row width {s.dim} must be even and >= 2*half ({2 * half}), a power of "
                             "two >= 32 with qdq")
    if K % 32 or block % 32 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"proj_rows: K={K} and block={block} must be multiples of 32, x 16-bit ({x.dtype})")
    if epilogue_warps(specs) is None:
        raise ValueError("proj_rows: two normalised row widths that rope_rows runs with different warps")


def proj_rows(x: torch.Tensor, specs: Sequence[Proj], cos: torch.Tensor, sin: torch.Tensor,
              block: int = 32, pack: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """[rope_rows(linear_mx(x, s.weight, s.scale).view(T, H, dim), cos, sin, norm_w, eps, qdq) for s in specs]
    with ``linear_mx``'s ``fp8`` decode, bit for bit, in two launches (module docstring): x [T, K] 16-bit,
    cos/sin [T, half] (``rope_table``; rows without ``rope`` ignore them). ``pack`` uint8 [T·H, dim + dim/32]: the
    second linear's output rows also as window-cache bytes there (``cache_insert_mx(pack, arange, rows,
    "window")``'s bytes; needs two linears, the second's width a multiple of 32)."""
    half = cos.shape[-1]
    check(x, specs, half, block)
    if pack is not None:
        s = specs[-1]
        if (len(specs) != 2 or s.dim % 32 or s.qdq or pack.dtype != torch.uint8
                or pack.shape != (x.shape[0] * s.heads, s.dim + s.dim // 32) or pack.stride(0) != pack.shape[1]):
            raise ValueError(f"proj_rows: pack {tuple(pack.shape)} {pack.dtype} must be contiguous uint8 "
                             f"[T·H, dim + dim/32] of a second linear (width a multiple of 32, no qdq)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, K = x.shape
    dev = x.device
    outs = [torch.empty(T, s.heads, s.dim, dtype=x.dtype, device=dev) for s in specs]
    if T == 0:
        return outs
    cuts = [slices(s.weight.shape[0], K, T) for s in specs]
    parts = [torch.empty(c[0], T, s.weight.shape[0], dtype=torch.float32, device=dev) for c, s in zip(cuts, specs)]
    raws = [torch.empty(T * s.heads, s.dim, dtype=x.dtype, device=dev) for s in specs]
    bm, bn = cuts[0][2], cuts[0][3]
    two = list(zip(specs, cuts, parts, raws, outs))
    if len(two) == 1:
        two.append(two[0])
    (s0, c0, p0, r0, o0), (s1, c1, p1, r1, o1) = two
    n1 = len(specs) > 1
    nb0 = cdiv(s0.weight.shape[0], bn)
    nb = nb0 + (cdiv(s1.weight.shape[0], bn) if n1 else 0)

    def groups(c):
        return 4 if c[1] % 128 == 0 and K % 128 == 0 else 1
    _stream2[(cdiv(T, bm), nb, max(c0[0], c1[0]))](
        x, T, K, x.stride(0),
        s0.weight, s0.scale, p0, s0.weight.shape[0], c0[1], c0[0], nb0, s0.weight.stride(0), s0.scale.stride(0),
        p0.stride(0), p0.stride(1),
        s1.weight, s1.scale, p1, s1.weight.shape[0], c1[1], c1[0], s1.weight.stride(0), s1.scale.stride(0),
        p1.stride(0), p1.stride(1),
        WB=block, BLOCK_M=bm, BLOCK_N=bn, GROUPS0=groups(c0), GROUPS1=groups(c1), num_warps=4, num_stages=4)
    cos, sin = cos.contiguous(), sin.contiguous()
    n0 = T * s0.heads
    n_all = n0 + (T * s1.heads if n1 else 0)

    def kind(s):
        w = s.norm_w if s.norm_w is not None else cos      # unread without NORM
        return (w, s.eps)

    (w0, e0), (w1, e1) = kind(s0), kind(s1)
    _epilogue2[(n_all,)](
        cos, sin, half, n0,
        p0, r0, o0, w0, c0[0], p0.stride(0), p0.stride(1), e0, s0.heads,
        p1, r1, o1, w1, c1[0], p1.stride(0), p1.stride(1), e1, s1.heads, pack if pack is not None else r1,
        D0=s0.dim, D2P0=next_pow2(s0.dim // 2), HALF0=half if s0.rope else 0, NORM0=s0.norm_w is not None,
        QDQ0=s0.qdq, D1=s1.dim, D2P1=next_pow2(s1.dim // 2), HALF1=half if s1.rope else 0,
        NORM1=s1.norm_w is not None, QDQ1=s1.qdq, PACK1=pack is not None, ASM=not interpreting() and x.is_cuda,
        num_warps=epilogue_warps(specs))
    return outs
