"""Prefill form of ``sparse_attention_mx`` (V4.1's stored caches) written in Gluon: the stored bytes gathered
by ``cp.async`` two blocks ahead, decoded in shared memory while the tensor cores run, both warpgroups on every
product.

Same contract, decoding and rounding as :mod:`attention_mx` / :mod:`attention_prefill_mx` (window rows e4m3
+ E8M0 per 32 and compressed entries e2m1 + e4m3 per 16, both decoded exactly to bf16; fp32 scores,
probabilities rounded to bf16 for the PV product, fp32 denominator, the running maximum started at the sink,
a query with no valid row returns 0). The schedule of one program (one query, 64 heads, 8 warps), per block
``i`` of ``BLOCK_N`` keys (window blocks first, then compressed ones; a block is one kind or the other):

1. barrier: block ``i``'s decoded rows and bias are in shared memory; both warpgroups finished block
   ``i - 1``'s products;
2. S = Q·Kᵀ [64, BLOCK_N] issued on the tensor cores (each warpgroup half of the keys), and while it runs,
   the stored bytes of block ``i + STAGES - 1`` requested by ``cp.async`` (with their score bias);
3. online softmax of S (one cross-warpgroup row maximum), P to shared memory, barrier (block ``i + 1``'s
   bytes have landed for every thread by then);
4. O += P·K issued (each warpgroup half of the 512 columns), and while it runs, block ``i + 1``'s bytes
   decoded into the other bf16 buffer.

So the gathers have a block and a half of work to land behind, and the decode overlaps the PV product.
Shared memory at ``BLOCK_N`` 32: Q 64 KB, two decoded buffers 64 KB, ``STAGES`` byte buffers 17 KB each, P
4 KB. Gluon has no interpreter: this kernel runs on an SM90 GPU only, as an ``ATTN_MX_PREFILL_TUNER``
candidate behind :func:`attention_prefill_mx.first_use_ok` (the reference on fresh random inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.attention_prefill_wg import AVAILABLE

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from redknot.kernels.triton.attention_prefill_wg import (
        _online,
        out_layout,
        p_smem_layout,
        row_smem_layout,
        score_layout,
    )

HEADS = 64


@dataclass(frozen=True)
class PrefillMXWGConfig:
    """Launch shape of the Gluon V4.1 prefill kernel (``attention_prefill_mx_wg``): keys a block and byte
    buffers (``stages`` >= 3: a block's bytes are requested two blocks before they are decoded)."""
    block_n: int = 32
    stages: int = 3


def smem_bytes(cfg: PrefillMXWGConfig, dim: int) -> int:
    raw = cfg.block_n * (dim + dim // 16)  # window data + the larger scale run (compressed: dim / 16)
    return 2 * HEADS * dim + 2 * 2 * cfg.block_n * dim + cfg.stages * raw + 2 * HEADS * cfg.block_n


if AVAILABLE:
    @gluon.jit
    def _fetch(raw, rsc, bias_smem, idx_ptr, j0, n, D: gl.constexpr, BLOCK_N: gl.constexpr, stride_c,
               cache_ptr, COMP: gl.constexpr, l16: gl.constexpr):
        """``cp.async`` of the stored bytes of list entries ``j0 .. j0+BLOCK_N`` (< n; index -1: none) into
        ``raw`` (values) / ``rsc`` (scales), zeros where invalid, and their score bias into ``bias_smem``."""
        j = j0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, l16))
        idx = gl.load(idx_ptr + j, mask=j < n, other=-1)
        ok = idx >= 0
        base = cache_ptr + gl.where(ok, idx, 0).to(gl.int64) * stride_c
        if COMP:  # packed e2m1 (D/2 bytes), then e4m3 per 16 (D/16 bytes)
            cv = gl.arange(0, D // 2, layout=gl.SliceLayout(0, l16))
            cp.async_copy_global_to_shared(raw.slice(0, D // 2, dim=1), base[:, None] + cv[None, :],
                                           mask=ok[:, None])
            cs = gl.arange(0, D // 16, layout=gl.SliceLayout(0, l16))
            cp.async_copy_global_to_shared(rsc, base[:, None] + D // 2 + cs[None, :], mask=ok[:, None])
        else:      # e4m3 (D bytes), then E8M0 per 32 (D/32 bytes)
            cv = gl.arange(0, D, layout=gl.SliceLayout(0, l16))
            cp.async_copy_global_to_shared(raw, base[:, None] + cv[None, :], mask=ok[:, None])
            cs = gl.arange(0, D // 32, layout=gl.SliceLayout(0, l16))
            cp.async_copy_global_to_shared(rsc.slice(0, D // 32, dim=1), base[:, None] + D + cs[None, :],
                                           mask=ok[:, None])
        bias_smem.store(gl.where(ok, 0.0, float("-inf")))

    @gluon.jit
    def _fetch_block(i, nbw, raw, rsc, bias_smem, widx, cidx, NW, NC, win_ptr, comp_ptr, stride_w, stride_c,
                     D: gl.constexpr, BLOCK_N: gl.constexpr, HAS_COMP: gl.constexpr, l16: gl.constexpr):
        """Block ``i`` of the key list: window blocks ``0 .. nbw-1``, then compressed ones."""
        if HAS_COMP:
            if i < nbw:
                _fetch(raw, rsc, bias_smem, widx, i * BLOCK_N, NW, D, BLOCK_N, stride_w, win_ptr, False, l16)
            else:
                _fetch(raw, rsc, bias_smem, cidx, (i - nbw) * BLOCK_N, NC, D, BLOCK_N, stride_c, comp_ptr, True,
                       l16)
        else:
            _fetch(raw, rsc, bias_smem, widx, i * BLOCK_N, NW, D, BLOCK_N, stride_w, win_ptr, False, l16)

    @gluon.jit
    def _decode_win(raw, rsc, dst, D: gl.constexpr, BLOCK_N: gl.constexpr, l3w: gl.constexpr):
        """e4m3 bytes with E8M0 per 32 -> exact bf16 rows (``attention_prefill_mx._win_dec``)."""
        v = raw.reshape([BLOCK_N, D // 32, 32]).load(l3w).to(gl.float8e4nv, bitcast=True).to(gl.float32)
        sb = rsc.slice(0, D // 32, dim=1).load(gl.SliceLayout(2, l3w))
        s = (sb.to(gl.int32) << 23).to(gl.float32, bitcast=True)          # 2^(e-127) for e = 1..254
        s = gl.where(sb == 0, 5.877471754111438e-39, s)                   # e = 0: 2^-127 (subnormal)
        dst.store(gl.reshape((v * s[:, :, None]).to(gl.bfloat16), [BLOCK_N, D]))

    @gluon.jit
    def _decode_comp(raw, rsc, dst, D: gl.constexpr, BLOCK_N: gl.constexpr, l2c: gl.constexpr):
        """packed e2m1 with e4m3 per 16 -> exact bf16 rows (``attention_prefill_mx._comp_dec``: each nibble as the
        e4m3 byte of its value times 2^-6, the 2^6 joined to the scale)."""
        p = gl.reshape(raw.slice(0, D // 2, dim=1).load(l2c), [BLOCK_N, D // 16, 8])
        lo = ((p & 0x08) << 4) | ((p & 0x07) << 2)
        hi = (p & 0x80) | ((p >> 2) & 0x1C)
        v = gl.reshape(gl.join(lo, hi), [BLOCK_N, D // 16, 16]).to(gl.float8e4nv, bitcast=True).to(gl.float32)
        vl: gl.constexpr = v.type.layout
        s = rsc.load(gl.SliceLayout(2, vl)).to(gl.float8e4nv, bitcast=True).to(gl.float32) * 64.0
        dst.store(gl.reshape((v * s[:, :, None]).to(gl.bfloat16), [BLOCK_N, D]))

    @gluon.jit
    def _decode_block(i, nbw, raw, rsc, dst, D: gl.constexpr, BLOCK_N: gl.constexpr, HAS_COMP: gl.constexpr,
                      l3w: gl.constexpr, l2c: gl.constexpr):
        if HAS_COMP:
            if i < nbw:
                _decode_win(raw, rsc, dst, D, BLOCK_N, l3w)
            else:
                _decode_comp(raw, rsc, dst, D, BLOCK_N, l2c)
        else:
            _decode_win(raw, rsc, dst, D, BLOCK_N, l3w)

    @gluon.jit
    def _attn_prefill_mx_wg(q_ptr, win_ptr, widx_ptr, comp_ptr, cidx_ptr, sink_ptr, out_ptr, H, NW, NC,
                            stride_qt, stride_qh, stride_w, stride_wi, stride_c, stride_ci, stride_ot, stride_oh,
                            qk_scale, HAS_COMP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr):
        """One program per (query, 64 heads); 8 warps."""
        BH: gl.constexpr = 64
        l16: gl.constexpr = gl.BlockedLayout([1, 16], [BLOCK_N // 8, 256 // BLOCK_N], [8, 1], [1, 0])
        l3w: gl.constexpr = gl.BlockedLayout([1, 1, 32], [BLOCK_N // 8, 256 // BLOCK_N, 1], [8, 1, 1], [2, 1, 0])
        l2c: gl.constexpr = gl.BlockedLayout([1, 8], [BLOCK_N // 8, 256 // BLOCK_N], [8, 1], [1, 0])
        lq: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
        s_l: gl.constexpr = score_layout(BLOCK_N)
        o_l: gl.constexpr = out_layout(D)
        row_sl: gl.constexpr = row_smem_layout()
        p_sl: gl.constexpr = p_smem_layout(BLOCK_N)
        flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], row_sl)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D], row_sl)
        raw_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D], flat)
        rsc_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, D // 16], flat)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BLOCK_N], p_sl)
        bias_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N],
                                              gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))

        t = gl.program_id(0).to(gl.int64)
        h0 = gl.program_id(1) * BH
        widx = widx_ptr + t * stride_wi
        cidx = cidx_ptr + t * stride_ci
        nbw = gl.cdiv(NW, BLOCK_N)
        nblk = nbw
        if HAS_COMP:
            nblk = nbw + gl.cdiv(NC, BLOCK_N)

        for s in gl.static_range(STAGES - 1):  # one commit group a block; blocks past the list copy nothing
            if s < nblk:
                _fetch_block(s, nbw, raw_smem.index(s), rsc_smem.index(s), bias_smem.index(s), widx, cidx, NW, NC,
                             win_ptr, comp_ptr, stride_w, stride_c, D, BLOCK_N, HAS_COMP, l16)
            cp.commit_group()
        qh = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, lq))
        qc = gl.arange(0, D, layout=gl.SliceLayout(0, lq))
        q = gl.load(q_ptr + t * stride_qt + qh.to(gl.int64)[:, None] * stride_qh + qc[None, :],
                    mask=(qh < H)[:, None], other=0.0)
        q_smem.store(q.to(gl.bfloat16))
        cp.wait_group(STAGES - 2)
        gl.thread_barrier()
        _decode_block(0, nbw, raw_smem.index(0), rsc_smem.index(0), k_smem.index(0), D, BLOCK_N, HAS_COMP, l3w,
                      l2c)

        heads_s = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
        m = gl.load(sink_ptr + heads_s, mask=heads_s < H, other=0.0) * 1.4426950408889634  # the sink, log2 units
        sink = m
        l2 = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_l)
        acc = gl.zeros([BH, D], gl.float32, layout=o_l)
        s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_l)
        for i in range(nblk):
            fence_async_shared()   # this thread's decoded rows (and Q) visible to the tensor cores
            gl.thread_barrier()    # everyone's; everyone done with block i - 1's products
            kbuf = k_smem.index(i % 2)
            sc = warpgroup_mma(q_smem, kbuf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            nxt = i + STAGES - 1
            if nxt < nblk:
                _fetch_block(nxt, nbw, raw_smem.index(nxt % STAGES), rsc_smem.index(nxt % STAGES),
                             bias_smem.index(nxt % STAGES), widx, cidx, NW, NC, win_ptr, comp_ptr, stride_w,
                             stride_c, D, BLOCK_N, HAS_COMP, l16)
            cp.commit_group()
            cp.wait_group(STAGES - 2)  # this thread's bytes of block i + 1
            bias = bias_smem.index(i % STAGES).load(gl.SliceLayout(0, s_l))
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            m, l2, alpha, p = _online(sc, bias, m, l2, qk_scale)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()    # P from both warpgroups; block i + 1's bytes from every thread
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            acc = warpgroup_mma(p_smem, kbuf, acc, is_async=True)
            if i + 1 < nblk:       # the next block's decode while the PV product runs
                _decode_block(i + 1, nbw, raw_smem.index((i + 1) % STAGES), rsc_smem.index((i + 1) % STAGES),
                              k_smem.index((i + 1) % 2), D, BLOCK_N, HAS_COMP, l3w, l2c)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        denom = gl.sum(l2, axis=1) + gl.exp2(sink - m)
        o = acc / gl.convert_layout(denom, gl.SliceLayout(1, o_l))[:, None]
        oh = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, o_l))
        oc = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
        gl.store(out_ptr + t * stride_ot + oh.to(gl.int64)[:, None] * stride_oh + oc[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(oh < H)[:, None])


def prefill_attention_mx_wg(q: torch.Tensor, window_cache: torch.Tensor, window_idx: torch.Tensor,
                            sinks: torch.Tensor, scale: float, comp_cache=None, comp_idx=None,
                            config: PrefillMXWGConfig = PrefillMXWGConfig()) -> torch.Tensor:
    """``ref_v41.sparse_attention_mx``'s contract with this kernel (SM90 GPU, ``D`` a multiple of 64)."""
    if not AVAILABLE:
        raise RuntimeError("sparse_attention_mx: the Gluon prefill form needs Triton with "
                           "triton.experimental.gluon (>= 3.5)")
    T, H, D = q.shape
    if D % 64 or config.stages < 3 or config.block_n not in (16, 32, 64):
        raise ValueError(f"sparse_attention_mx: {config} takes a latent of a multiple of 64 columns, 3 or more "
                         f"stages and 16 / 32 / 64 keys a block, not D={D}")
    if not q.is_cuda:
        raise RuntimeError(f"sparse_attention_mx: {config} is a Gluon kernel, which runs on an SM90 GPU only "
                           f"(no interpreter); pass a PrefillAttnConfig or AttnMxConfig for {q.device}")
    out = torch.empty_like(q)
    if T == 0:
        return out
    from redknot.kernels.triton.attention_prefill_mx import mx_launch_args

    args, has_comp = mx_launch_args(q, window_cache, window_idx, sinks, scale, comp_cache, comp_idx, out)
    _attn_prefill_mx_wg[(T, cdiv(H, HEADS))](*args, HAS_COMP=has_comp, D=D, BLOCK_N=config.block_n,
                                             STAGES=config.stages, num_warps=8)
    return out
