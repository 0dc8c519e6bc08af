"""FP8 (e4m3) GEMMs with DeepSeek block scales: 1×128 per-token groups on activations, 128×128 on weights.

``quantize_act`` turns bf16 rows into e4m3 with one fp32 scale per 128 columns (optionally rounded up to
a power of two, the ue8m0 convention of the checkpoints). ``block_scaled_mm`` multiplies such rows by an
e4m3 weight ``[N, K]`` with scales ``[N/128, K/128]``: each 128-deep slice of K is one tensor-core dot
whose fp32 result is scaled by the row scale times the weight-block scale and accumulated in fp32.
With per-group offsets it runs a grouped GEMM (MoE experts): M-tiles never straddle two groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv, dot_precision, next_pow2

FP8_MAX = 448.0
GROUP = 128


@triton.jit
def _quant_rows(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s, UE8M0: tl.constexpr,
                BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * GROUP_K + tl.arange(0, GROUP_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-10)
    scale = amax / 448.0
    if UE8M0:
        scale = tl.exp2(tl.ceil(tl.log2(scale)))
    q = tl.div_rn(x, scale[:, None])  # correctly rounded, so the e4m3 codes match a host-side cast
    tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + g, scale, mask=rows < M)


@triton.jit
def _block_scaled_mm(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr,
                     N, K, stride_am, stride_sam, stride_bg, stride_bn, stride_sbg, stride_sbn, stride_cm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPED: tl.constexpr,
                     A_SCALED: tl.constexpr, PREC: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        grp = tl.load(tile_group_ptr + pid_m)
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
    else:
        grp = 0
        row0 = pid_m * BLOCK_M
        row_end = tl.load(tile_end_ptr)
    if grp >= 0:
        rows = row0 + tl.arange(0, BLOCK_M)
        rmask = rows < row_end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        offs_k = tl.arange(0, BLOCK_K)
        a_row = a_ptr + rows[:, None].to(tl.int64) * stride_am
        b_row = b_ptr + grp.to(tl.int64) * stride_bg + cols[:, None].to(tl.int64) * stride_bn
        sb_row = sb_ptr + grp.to(tl.int64) * stride_sbg + (pid_n * BLOCK_N // 128) * stride_sbn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            kk = kb * BLOCK_K + offs_k
            a = tl.load(a_row + kk[None, :], mask=rmask[:, None] & (kk[None, :] < K), other=0.0)
            b = tl.load(b_row + kk[None, :], mask=cmask[:, None] & (kk[None, :] < K), other=0.0)
            sb = tl.load(sb_row + kb)
            if A_SCALED:
                sa = tl.load(sa_ptr + rows.to(tl.int64) * stride_sam + kb, mask=rmask, other=0.0)
                acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
            else:  # 16-bit activations: e4m3 weights widen exactly, the block scale applies after the dot
                acc += tl.dot(a, tl.trans(b.to(a.dtype)), input_precision=PREC) * sb
        tl.store(c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def quantize_act(x: torch.Tensor, ue8m0: bool = False, out_dtype: torch.dtype = torch.float8_e4m3fn
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x [M, K]`` → (e4m3 ``[M, K]``, fp32 scales ``[M, ceil(K/128)]``) with ``x ≈ q · scale``."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=out_dtype, device=x.device)
    s = torch.empty(M, cdiv(K, GROUP), dtype=torch.float32, device=x.device)
    if M:
        bm = 16
        _quant_rows[(cdiv(M, bm), cdiv(K, GROUP))](x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0),
                                                    UE8M0=ue8m0, BLOCK_M=bm, GROUP_K=GROUP, num_warps=4)
    return q, s


def _tile_map(offs: torch.Tensor, block_m: int, max_rows: int):
    """Per M-tile (group, first row, group end) for rows grouped by ``offs`` (ends); extra tiles get group -1."""
    ends = offs.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    cum = torch.cumsum(tiles, 0)
    bound = cdiv(max_rows, block_m) + offs.numel()
    j = torch.arange(bound, device=offs.device)
    grp = torch.searchsorted(cum, j, right=True)
    valid = grp < offs.numel()
    g = grp.clamp(max=offs.numel() - 1)
    first_tile = cum[g] - tiles[g]
    row0 = starts[g] + (j - first_tile) * block_m
    group = torch.where(valid, g, torch.full_like(g, -1))
    return group.to(torch.int32), row0.to(torch.int32), ends[g].to(torch.int32), bound


@dataclass(frozen=True)
class GemmConfig:
    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3


GEMM_TUNER = ConfigTuner("block_scaled_mm", [
    GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 8, 3), GemmConfig(128, 64, 4, 4),
])


def block_scaled_mm(a: torch.Tensor, sa: Optional[torch.Tensor], b: torch.Tensor, sb: torch.Tensor,
                    offs: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.bfloat16,
                    config: Optional[GemmConfig] = None) -> torch.Tensor:
    """``(a·sa) @ (b·sb)ᵀ``: a ``[M, K]`` e4m3 with sa ``[M, K/128]`` (or a 16-bit/fp32 ``a`` and
    ``sa=None``: weight-only FP8); b ``[N, K]`` (or ``[G, N, K]`` with ``offs`` = per-group row ends of
    ``a``) e4m3 with sb ``[N/128, K/128]`` (or ``[G, ...]``) → ``[M, N]``. ``config=None``: tuned per
    shape class."""
    M, K = a.shape
    if config is None:
        key = (min(next_pow2(M), 8192), b.shape[-2], K, offs is not None, sa is not None, str(a.dtype))
        config = GEMM_TUNER.pick(key, lambda cfg: block_scaled_mm(a, sa, b, sb, offs, out_dtype, cfg), a.device)
    block_m, block_n, num_warps, num_stages = config.block_m, config.block_n, config.num_warps, config.num_stages
    grouped = offs is not None
    b3 = b if grouped else b.unsqueeze(0)
    sb3 = sb if grouped else sb.unsqueeze(0)
    N = b3.shape[1]
    if block_n > 128 or 128 % block_n:
        raise ValueError(f"block_n={block_n}: must divide 128 so one weight scale covers a tile")
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0:
        return out
    if grouped:
        tg, tr, te, n_tiles = _tile_map(offs, block_m, M)
    else:
        n_tiles = cdiv(M, block_m)
        te = torch.full((1,), M, dtype=torch.int32, device=a.device)
        tg = tr = te
    a_scaled = sa is not None
    sa_t = sa if a_scaled else sb3
    _block_scaled_mm[(n_tiles, cdiv(N, block_n))](
        a, sa_t, b3, sb3, out, tg, tr, te, N, K, a.stride(0), sa_t.stride(0) if a_scaled else 0,
        b3.stride(0), b3.stride(1), sb3.stride(0), sb3.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=GROUP, GROUPED=grouped, A_SCALED=a_scaled,
        PREC=dot_precision(a.dtype), num_warps=num_warps, num_stages=num_stages)
    return out


def linear_fp8(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, quantize_activations: bool = False,
               ue8m0: bool = True) -> torch.Tensor:
    """``x @ dequant(w)ᵀ``; x ``[..., K]`` → ``[..., N]``.

    By default weight-only: the e4m3 weight widens to x's dtype inside the kernel, so the result is the
    dequantised GEMM up to summation order. ``quantize_activations`` also quantises x per 1×128 group
    (FP8 tensor-core rate, about 2-3 % relative difference from the dequantised GEMM).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if quantize_activations:
        q, s = quantize_act(x2, ue8m0=ue8m0)
        y = block_scaled_mm(q, s, w, w_scale.float(), out_dtype=x.dtype)
    else:
        y = block_scaled_mm(x2, None, w, w_scale.float(), out_dtype=x.dtype)
    return y.reshape(*lead, w.shape[0])
