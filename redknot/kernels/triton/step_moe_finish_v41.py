"""The shared expert's finish at decode sizes (``step_moe_v41.shared_expert_finish``'s last launch): W2's slices
summed, rounded to bf16 and added to the routed experts' sum (``_reduce_add``), with the mHC post mix of the
block (``_reduce_add_post``), or W2 as a GEMV with that finish in the same launch (``_w2_fused``: the last
program of each column block)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.step_moe_route_v41 import _LIBDEVICE
from redknot.kernels.triton.step_moe_w2_v41 import _swiglu_quant, _w2_swiglu_tile
from redknot.kernels.triton.step_proj_v41 import _gemv_tile, _post_block


@triton.jit
def _reduce_add(p_ptr, r_ptr, out_ptr, D, S, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D: tl.constexpr):
    """out = bf16(fp32(routed) + fp32(bf16(Σ_s p))) (slice order)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(S):
        acc += tl.load(p_ptr + s * stride_ps + t * stride_pm + cols, mask=cm, other=0.0)
    y = acc.to(tl.bfloat16).to(tl.float32)
    routed = tl.load(r_ptr + t * stride_r + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (routed + y).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _add_block(p_ptr, r_ptr, out_ptr, t, blk, D, S, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D: tl.constexpr,
               CG: tl.constexpr):
    """out[t, block] = bf16(fp32(routed) + fp32(bf16(Σ_s p))) (slice order; CG: the partials from L2)."""
    cols = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in range(S):
        if CG:
            acc += tl.load(p_ptr + s * stride_ps + t * stride_pm + cols, mask=cm, other=0.0, cache_modifier=".cg")
        else:
            acc += tl.load(p_ptr + s * stride_ps + t * stride_pm + cols, mask=cm, other=0.0)
    y = acc.to(tl.bfloat16).to(tl.float32)
    routed = tl.load(r_ptr + t * stride_r + cols, mask=cm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (routed + y).to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _w2_fused(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, S2, stride_p1s, stride_p1m, stride_a,
              stride_w, stride_s, stride_ps, stride_pm, limit, cnt_ptr, r_ptr, out_ptr, stride_r, stride_o, h_ptr,
              post_ptr, comb_ptr, h_out_ptr, stride_st, stride_sn, stride_ht, stride_hn, WB: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
              LIBDEVICE: tl.constexpr, BLOCK_D: tl.constexpr, MIX: tl.constexpr, NS: tl.constexpr,
              PRO: tl.constexpr = True):
    """The shared expert's W2 and its finish in one launch: ``step_moe_w2_v41._w2_swiglu_gemv``'s program, then (as
    ``step_proj_v41._gemv_post``) a barrier and one acquire-release increment of its ``BLOCK_D``-column block's
    counter; the program that takes it to the block's last count resets it and runs ``_reduce_add`` (MIX:
    ``_reduce_add_post``) for the block and each row, the partials from L2. The bits of those launches. PRO
    False: the SwiGLU rows come quantised (``_swiglu_quant`` launched before; ``gemv_fp8``'s loop on them)."""
    if PRO:
        _w2_swiglu_tile(p1_ptr, a_ptr, x_ptr, w_ptr, s_ptr, p_ptr, N, KW, KSPLIT, S1, stride_p1s, stride_p1m,
                        stride_a, stride_w, stride_s, stride_ps, stride_pm, limit, WB, ROWS, BLOCK_N, BLOCK_K,
                        USE_ASM, LIBDEVICE)
    else:
        _gemv_tile(x_ptr, w_ptr, s_ptr, p_ptr, tl.program_id(0), tl.program_id(1), N, KW, KSPLIT, stride_a // 2,
                   stride_w, stride_s, stride_ps, stride_pm, WB, ROWS, BLOCK_N, BLOCK_K, USE_ASM, 1)
    tl.debug_barrier()   # every thread's partials stored before the release
    blk = (tl.program_id(0) * BLOCK_N) // BLOCK_D
    done = tl.atomic_add(cnt_ptr + blk, 1, sem="acq_rel", scope="gpu")
    if done == (BLOCK_D // BLOCK_N) * S2 - 1:
        tl.atomic_xchg(cnt_ptr + blk, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
        for t in tl.static_range(ROWS):
            _add_block(p_ptr, r_ptr, out_ptr, t, blk, N, S2, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D, True)
            if MIX:
                tl.debug_barrier()   # the block, stored by every thread of the program, then read back
                _post_block(out_ptr, h_ptr, post_ptr, comb_ptr, h_out_ptr, t, blk, N, stride_o, stride_st, stride_sn,
                            stride_ht, stride_hn, NS, BLOCK_D)


@triton.jit
def _reduce_add_post(p_ptr, r_ptr, out_ptr, D, S, stride_ps, stride_pm, stride_r, stride_o, s_ptr, post_ptr, comb_ptr,
                     h_out_ptr, stride_st, stride_sn, stride_ht, stride_hn, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """``_reduce_add`` of one (token, column block) into ``out``, then the mHC post mix of that block
    (``mhc._mhc_post``'s code, ``BLOCK_D`` its block width) into ``h_out``."""
    pid = tl.program_id(0).to(tl.int64)
    nb = tl.cdiv(D, BLOCK_D)
    t = pid // nb
    blk = pid - t * nb
    _add_block(p_ptr, r_ptr, out_ptr, t, blk, D, S, stride_ps, stride_pm, stride_r, stride_o, BLOCK_D, False)
    tl.debug_barrier()   # the block, stored by every thread of the program, then read back
    _post_block(out_ptr, s_ptr, post_ptr, comb_ptr, h_out_ptr, t, blk, D, stride_o, stride_st, stride_sn, stride_ht,
                stride_hn, N, BLOCK_D)


def post_mix_fits(D: int, h: torch.Tensor) -> bool:
    """Whether ``step_moe_v41.shared_expert_finish`` can end with the mHC post mix over ``h`` [T, n, D] (``mhc_post``'s
    column blocks tile D, n a power of two)."""
    n = h.shape[1]
    bd = min(512, next_pow2(D))
    return h.dim() == 3 and h.shape[2] == D and D % bd == 0 and n & (n - 1) == 0


def _w2_fused_launch(p1, w2, s2, limit: float, block: int, name: str, routed, out, mix):
    """``step_moe_v41.shared_expert_finish`` with ``fpgemv*``: W2 (its SwiGLU formed inside) and the finish in one
    ``_w2_fused`` launch; ``fgemv*``: ``_swiglu_quant`` (the rows quantised once), then W2 and the finish in one
    launch (at most ``gemv_mx.MAX_ROWS`` rows; D a multiple of the 512-column block)."""
    from redknot.kernels.triton import gemv_mx
    from redknot.kernels.triton.dequant_mx import as_bytes
    from redknot.kernels.triton.step_proj_v41 import _counters, plan_name
    plan = gemv_mx.PLANS[plan_name(name)]
    S1, T, two_i = p1.shape
    inter = two_i // 2
    D = w2.shape[0]
    bd = min(512, next_pow2(D))
    if T > gemv_mx.MAX_ROWS or block % plan.block_n or D % bd or bd % plan.block_n:
        raise ValueError(f"shared_expert_finish: {name} takes at most {gemv_mx.MAX_ROWS} rows, D ({D}) a multiple "
                         f"of its {bd}-column block and a scale tile ({block}) its {plan.block_n} columns divide")
    routed = routed if routed.stride(-1) == 1 else routed.contiguous()
    act = torch.empty(T, inter, dtype=torch.bfloat16, device=p1.device)
    bk = gemv_mx._block_k(inter, plan.block_k)
    S2, ks2 = gemv_mx.slices(D, inter, plan)
    p2 = torch.empty(S2, T, D, dtype=torch.float32, device=p1.device)
    wb = as_bytes(w2).view(torch.int32)
    pro = name.startswith("fpgemv")
    if not pro:
        bg = min(16, next_pow2(inter // 32))
        _swiglu_quant[(T, cdiv(inter // 32, bg))](p1, act, act, inter, S1, p1.stride(0), p1.stride(1), act.stride(0),
                                                  0, float(limit), BLOCK_G=bg, LIBDEVICE=_LIBDEVICE, QDQ_BF16=True,
                                                  num_warps=4)
    if mix is not None:
        sh, post, comb, h_out = _mix_rows(mix, T, D)
        margs = (sh, post, comb, h_out, sh.stride(0), sh.stride(1), h_out.stride(0), h_out.stride(1))
    else:
        margs = (out, out, out, out, 0, 0, 0, 0)
    _w2_fused[(cdiv(D, plan.block_n), S2)](
        p1, act, act.view(torch.int32), wb, s2, p2, D, inter // 4, ks2, S1, S2, p1.stride(0), p1.stride(1),
        act.stride(0), wb.stride(0), s2.stride(0), p2.stride(0), p2.stride(1), float(limit),
        _counters(p1.device, D // bd), routed, out, routed.stride(0), out.stride(0), *margs, WB=block, ROWS=T,
        BLOCK_N=plan.block_n, BLOCK_K=bk, USE_ASM=gemv_mx._use_asm(), LIBDEVICE=_LIBDEVICE, BLOCK_D=bd,
        MIX=mix is not None, NS=mix[0].shape[1] if mix is not None else 1, PRO=pro, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
    return out if mix is None else h_out


def _mix_rows(mix, T: int, D: int):
    """The mHC post mix's operands for W2's [T, D] output: (h contiguous, post fp32, comb fp32, h' to fill)."""
    h, post, comb = mix
    if not post_mix_fits(D, h) or h.shape[0] != T:
        raise ValueError(f"shared_expert_finish: h {tuple(h.shape)} does not fit the post mix of [{T}, {D}]")
    sh = h.contiguous()
    return sh, post.float().contiguous(), comb.float().contiguous(), torch.empty_like(sh)


def _finish(p2: torch.Tensor, routed: torch.Tensor, out: torch.Tensor, mix) -> torch.Tensor:
    """``step_moe_v41.shared_expert_finish``'s last launch: W2's slices summed, rounded, added to ``routed`` into
    ``out`` (and with ``mix`` the mHC post mix, returning h')."""
    S2, T, D = p2.shape
    routed = routed if routed.stride(-1) == 1 else routed.contiguous()
    if mix is not None:
        sh, post, comb, h_out = _mix_rows(mix, T, D)
        bd = min(512, next_pow2(D))
        _reduce_add_post[(T * (D // bd),)](p2, routed, out, D, S2, p2.stride(0), p2.stride(1), routed.stride(0),
                                           out.stride(0), sh, post, comb, h_out, sh.stride(0), sh.stride(1),
                                           h_out.stride(0), h_out.stride(1), N=sh.shape[1], BLOCK_D=bd, num_warps=4)
        return h_out
    bd = min(1024, next_pow2(D))
    _reduce_add[(T, cdiv(D, bd))](p2, routed, out, D, S2, p2.stride(0), p2.stride(1), routed.stride(0),
                                  out.stride(0), BLOCK_D=bd, num_warps=4)
    return out
