"""Prefill form of V4's ``sparse_attention_paged`` (bf16 rows) written in Gluon: gathered rows by ``cp.async``
into shared memory a block ahead, both warpgroups on every product.

Same contract and rounding as :mod:`attention` and :mod:`attention_prefill` (a query's virtual key list: its
window rows from this step's ``kv`` or the per-sequence ring, then its compressed entries through the block
table, from a top-k list or every visible entry; fp32 scores, probabilities rounded to bf16 for the PV
product, fp32 denominator, the sink in the denominator only, the optional inverse RoPE of the output's rope
columns). What the Triton forms cannot say and this one does:

* the key rows never pass through registers: ``cp.async`` gathers block ``i + STAGES - 1`` into its shared
  buffer (zero-filled where a key is invalid) while block ``i`` is multiplied, so the gather latency hides
  behind the products instead of sitting between them;
* one program owns one query and 64 heads with two warpgroups (8 warps), and the MMA layouts split the work
  between them instead of repeating it: S = Q·Kᵀ [64 heads, BLOCK_N keys] gives each warpgroup half of the
  keys (``warps_per_cta = [4, 2]``), O = P·K [64, D] gives each half of the columns ([64, 256] fp32 each,
  128 registers a thread), P going through shared memory between the two;
* the softmax denominator is kept as a [64, BLOCK_N] tile (rescaled like the accumulator) and summed once at
  the end, so a block needs one cross-warpgroup reduction (the row maximum), not two.

One CTA barrier per block orders the buffers (each thread fences its own writes for the tensor cores before
it, as CUTLASS does): after it, block ``i``'s rows are in shared memory for both warpgroups and both finished
the previous block's products, so the buffer that block used can take the next gather and P can be
overwritten. Gluon has no interpreter: this kernel runs on an SM90 GPU only, as a
``ATTN_PREFILL_TUNER`` candidate behind the float64-oracle first-use check of :mod:`attention_prefill`.
"""
from __future__ import annotations

import torch

try:  # Gluon ships with Triton >= 3.5; without it the tuner never offers this form
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    AVAILABLE = True
except ImportError:  # pragma: no cover - older Triton
    AVAILABLE = False

from redknot.kernels.triton._common import cdiv
from redknot.kernels.triton.attention import PrefillWGConfig, _query_span, key_rows_at

HEADS = 64  # heads a program: the M of both products, one warpgroup's 4 x 16 rows


def smem_bytes(cfg: PrefillWGConfig, dim: int) -> int:
    return 2 * (HEADS * dim + cfg.stages * cfg.block_n * dim + HEADS * cfg.block_n)


if AVAILABLE:
    @triton.constexpr_function
    def score_layout(block_n):
        """S = Q·Kᵀ [64 heads, block_n keys] over two warpgroups side by side: each owns half of the keys."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, block_n // 2, 16])

    @triton.constexpr_function
    def out_layout(d):
        """O = P·K [64 heads, d] over two warpgroups side by side: each owns half of the columns."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, min(d // 2, 256), 16])

    @triton.constexpr_function
    def row_smem_layout():
        """bf16 rows for the tensor cores (Q, keys): 128-byte swizzle."""
        return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    @triton.constexpr_function
    def p_smem_layout(block_n):
        """P [64, block_n] bf16, the PV product's A operand: the swizzle its row width allows."""
        return gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_n * 2), element_bitwidth=16, rank=2)

    @gluon.jit
    def _rows(kb, n_tot, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr, topk_ptr,
              stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt, stride_tk, ring_size, ratio,
              block_size, BLOCK_N: gl.constexpr, layout: gl.constexpr, COMP: gl.constexpr,
              HAS_RING: gl.constexpr):
        """Row pointers and validity of the virtual keys ``kb .. kb+BLOCK_N`` (``attention.key_rows_at``), in
        ``layout`` (a 1-D slice layout)."""
        return key_rows_at(kb + gl.arange(0, BLOCK_N, layout=layout), n_tot, n_swa, lo, ctx, qs, slot, b, tok,
                           kv_ptr, ring_ptr, cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr,
                           stride_cb, stride_ce, stride_bt, stride_tk, ring_size, ratio, block_size, COMP, HAS_RING)

    @gluon.jit
    def _gather(smem, bias_smem, kb, n_tot, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr,
                topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt, stride_tk, ring_size,
                ratio, block_size, D: gl.constexpr, BLOCK_N: gl.constexpr, ld: gl.constexpr, COMP: gl.constexpr,
                HAS_RING: gl.constexpr):
        """``cp.async`` of the rows of keys ``kb .. kb+BLOCK_N`` into ``smem`` (zeros for invalid keys), and their
        score bias (0 valid, -inf not) into ``bias_smem``: the addressing runs once, one row a thread."""
        ptr, valid = _rows(kb, n_tot, n_swa, lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr,
                           topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce, stride_bt, stride_tk,
                           ring_size, ratio, block_size, BLOCK_N, gl.SliceLayout(1, ld), COMP, HAS_RING)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        cp.async_copy_global_to_shared(smem, ptr[:, None] + cols[None, :], mask=valid[:, None])
        bias_smem.store(gl.where(valid, 0.0, float("-inf")))

    @gluon.jit
    def _online(sc, bias, m, l2, qk_scale):
        """One block's online softmax: scores [64, BLOCK_N] + bias -> (max, the denominator tile rescaled and
        added to, the rescale factor, P)."""
        z = sc * qk_scale + bias[None, :]
        m_new = gl.maximum(m, gl.max(z, axis=1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(z - m_new[:, None])
        return m_new, l2 * alpha[:, None] + p, alpha, p

    @gluon.jit
    def _sparse_attn_prefill_wg(q_ptr, kv_ptr, ring_ptr, cache_ptr, out_ptr, tok_seq_ptr, pos_ptr, ctx_ptr,
                                qstart_ptr, slot_ptr, bt_ptr, topk_ptr, sink_ptr, cos_ptr, sin_ptr,
                                stride_qt, stride_qh, stride_kvt, stride_rs, stride_rr, stride_cb, stride_ce,
                                stride_ot, stride_oh, stride_bt, stride_tk,
                                qk_scale, ring_size, window, ratio, block_size, num_topk, H,
                                D: gl.constexpr, RD: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                COMP: gl.constexpr, HAS_RING: gl.constexpr, HAS_SINK: gl.constexpr,
                                ROPE: gl.constexpr):
        """One program per (query, 64 heads); 8 warps (``num_warps`` must be 8)."""
        BH: gl.constexpr = 64
        # gathers: 16-byte pieces, a warp over BLOCK_N / 8 rows, so a thread addresses one row of a block
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [BLOCK_N // 8, 256 // BLOCK_N], [8, 1], [1, 0])
        s_l: gl.constexpr = score_layout(BLOCK_N)
        o_l: gl.constexpr = out_layout(D)
        row_sl: gl.constexpr = row_smem_layout()
        p_sl: gl.constexpr = p_smem_layout(BLOCK_N)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, D], row_sl)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], row_sl)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BH, BLOCK_N], p_sl)
        bias_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N],
                                              gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))

        tok = gl.program_id(0)
        b, ctx, qs, slot, lo, n_swa, n_comp = _query_span(tok, tok_seq_ptr, pos_ptr, ctx_ptr, qstart_ptr, slot_ptr,
                                                          window, ratio, num_topk, COMP, HAS_RING)
        n_tot = n_swa + n_comp
        nblk = gl.cdiv(n_tot, BLOCK_N)
        h0 = gl.program_id(1) * BH
        tok64 = tok.to(gl.int64)

        # Q, and the first STAGES - 1 blocks, one commit group each (Q with block 0)
        qh = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, ld))
        qc = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        cp.async_copy_global_to_shared(q_smem, q_ptr + tok64 * stride_qt + qh.to(gl.int64)[:, None] * stride_qh
                                       + qc[None, :], mask=(qh < H)[:, None])
        for s in gl.static_range(STAGES - 1):
            _gather(k_smem.index(s), bias_smem.index(s), s * BLOCK_N, n_tot, n_swa, lo, ctx, qs, slot, b, tok,
                    kv_ptr, ring_ptr, cache_ptr, bt_ptr, topk_ptr, stride_kvt, stride_rs, stride_rr, stride_cb,
                    stride_ce, stride_bt, stride_tk, ring_size, ratio, block_size, D, BLOCK_N, ld, COMP, HAS_RING)
            cp.commit_group()

        heads_s = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, s_l))
        if HAS_SINK:
            sink = gl.load(sink_ptr + heads_s, mask=heads_s < H, other=0.0).to(gl.float32) * 1.4426950408889634
        else:  # a finite floor: every query has at least its own row, so m ends at a real score
            sink = gl.full([BH], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_l))
        m = sink
        l2 = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_l)
        acc = gl.zeros([BH, D], gl.float32, layout=o_l)
        s_zero = gl.zeros([BH, BLOCK_N], gl.float32, layout=s_l)
        for i in range(nblk):
            cp.wait_group(STAGES - 2)  # this thread's pieces of block i have landed
            fence_async_shared()       # ... and are visible to the tensor cores' reads
            gl.thread_barrier()        # everyone's are; everyone is done with block i - 1's buffer and with P
            kbuf = k_smem.index(i % STAGES)
            sc = warpgroup_mma(q_smem, kbuf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # while the scores run: the next gather (its top-k ids and block-table loads, the copies, the bias)
            nxt = i + STAGES - 1
            _gather(k_smem.index(nxt % STAGES), bias_smem.index(nxt % STAGES), nxt * BLOCK_N, n_tot, n_swa,
                    lo, ctx, qs, slot, b, tok, kv_ptr, ring_ptr, cache_ptr, bt_ptr, topk_ptr, stride_kvt,
                    stride_rs, stride_rr, stride_cb, stride_ce, stride_bt, stride_tk, ring_size, ratio,
                    block_size, D, BLOCK_N, ld, COMP, HAS_RING)
            cp.commit_group()
            bias = bias_smem.index(i % STAGES).load(gl.SliceLayout(0, s_l))
            sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc,))
            m, l2, alpha, p = _online(sc, bias, m, l2, qk_scale)
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            acc = warpgroup_mma(p_smem, kbuf, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        cp.wait_group(0)

        denom = gl.sum(l2, axis=1) + gl.exp2(sink - m)
        o = acc / gl.convert_layout(denom, gl.SliceLayout(1, o_l))[:, None]
        if ROPE:  # the interleaved pairs among the last RD columns rotated back: (a, b) -> (a·c + b·s, b·c - a·s)
            a, bb = gl.split(gl.reshape(o, [BH, D // 2, 2]))
            pl: gl.constexpr = a.type.layout
            pair = gl.arange(0, D // 2, layout=gl.SliceLayout(0, pl)) - (D - RD) // 2
            rp = pair >= 0
            c = gl.load(cos_ptr + tok64 * (RD // 2) + gl.where(rp, pair, 0), mask=rp, other=1.0)[None, :]
            sn = gl.load(sin_ptr + tok64 * (RD // 2) + gl.where(rp, pair, 0), mask=rp, other=0.0)[None, :]
            o = gl.reshape(gl.join(a * c + bb * sn, bb * c - a * sn), [BH, D])
        st: gl.constexpr = o.type.layout
        oh = h0 + gl.arange(0, BH, layout=gl.SliceLayout(1, st))
        oc = gl.arange(0, D, layout=gl.SliceLayout(0, st))
        gl.store(out_ptr + tok64 * stride_ot + oh.to(gl.int64)[:, None] * stride_oh + oc[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=(oh < H)[:, None])


def launch_prefill_wg(cfg: PrefillWGConfig, **kw) -> torch.Tensor:
    """``attention._launch``'s arguments (already normalised by ``sparse_attention_paged``), this kernel."""
    from redknot.kernels.triton.attention_prefill import paged_launch_args

    if not AVAILABLE:
        raise RuntimeError("sparse_attention_paged: the Gluon prefill form needs Triton with "
                           "triton.experimental.gluon (>= 3.5)")
    q = kw["q"]
    T, H, D = q.shape
    if D % 64 or q.dtype != torch.bfloat16:
        raise ValueError(f"sparse_attention_paged: {cfg} takes bf16 rows of a multiple of 64 columns, "
                         f"not {q.dtype} x {D}")
    if cfg.stages < 2 or cfg.block_n not in (32, 64):
        raise ValueError(f"sparse_attention_paged: {cfg} needs 32 or 64 keys a block and at least 2 stages")
    if not q.is_cuda:
        raise RuntimeError(f"sparse_attention_paged: {cfg} is a Gluon kernel, which runs on an SM90 GPU only "
                           f"(no interpreter); pass a PrefillTConfig or AttnConfig for {q.device}")
    args, comp, rope, rd = paged_launch_args(**kw)
    _sparse_attn_prefill_wg[(T, cdiv(H, HEADS))](
        *args, D=D, RD=rd, BLOCK_N=cfg.block_n, STAGES=cfg.stages, COMP=comp, HAS_RING=kw["ring"] is not None,
        HAS_SINK=kw["sink"] is not None, ROPE=rope, num_warps=8)
    return kw["out"]
