"""Paths for the V4.1 routed experts (MXFP4 weights), all on the device with no host sync.

``moe_splitk`` (decode, a few rows per expert): the batch is a weight stream. One routing kernel sorts
the (token, slot) pairs by expert (stable) and writes the token rows' per-32 FP8 QDQ values; split-K
grouped GEMMs (``splitk_mx``, weights decoded by ``tl.dot_scaled``) read every touched expert's packed
FP4 slice once for all its rows (one 16-row tile per expert at decode sizes; each program finds its tile
from the per-expert ends), W1 and W3 in one launch; one reduction applies the SwiGLU, the routing weight
and the FP8 QDQ of the W2 input; the W2 launch; one reduction rounds every slot to bf16 and adds a
token's k slots in slot order. Five launches, CUDA-graph safe. (``decode="registers"``, the earlier
hand decode, adds a tile-map launch and quantises x inside the W1 | W3 kernel up to 128 tokens.)

``moe_prefill`` (many rows per expert) runs the plan ``PREFILL_TUNER`` measured fastest per token-count
class: ``tiled``, the split-K kernel as a plain grouped GEMM (FP4 decoded in registers, one K slice,
larger row tiles; no expert is decoded to memory and untouched experts are never read), or
``moe_grouped``: experts decoded ``CHUNK_EXPERTS`` at a time into a bf16 scratch (``e2m1 · 2^s`` is
exact in bf16) and multiplied by ``torch._grouped_mm`` (a library grouped GEMM, fp32
accumulation) against token rows that hold their exact per-32 FP8 QDQ values in bf16. Only the
summation order differs from the reference. Each chunk's rows are gathered into a chunk buffer by a
kernel that reads the chunk's row range from the device offsets, so the host never learns the routing
counts. Scratch: the bf16 weights of one chunk plus row buffers of ``T·k`` rows. ``fp8``
(``moe_prefill_fp8``): grouped GEMMs on FP8 tensor cores, FP4 turned into e4m3 in registers, one MMA per
32-wide K group scaled in fp32 (the reference's block order), the SwiGLU epilogue writing the W2 input as
e4m3 + E8M0; each such plan passes a first-use check against ``grouped`` on the device before it runs.
``scaled`` (``moe_prefill_scaled``): the experts expanded to e4m3 with per-column fp32 scales, rows quantised
with one scale each, ``torch._scaled_grouped_mm`` (library FP8 grouped GEMM), gated the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from redknot.kernels import tuning_cache
from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2
from redknot.kernels.triton import splitk_mx, stream_guard
from redknot.kernels.triton.moe_stream import StreamPlan, moe_stream
from redknot.kernels.triton.dequant_mx import chunk_rows, dequant_fp4_bf16, fp8_qdq_groups, qdq_bf16
from redknot.kernels.triton.quant_mx import e8m0_exponent, pow2
from redknot.kernels.triton.splitk_mx import (RAW_MAX_ROWS, ROW_TILE, reduce_combine, reduce_swiglu, splitk_mm,
                                              tile_map)

# Experts decoded to bf16 per grouped-GEMM chunk: 32 V4.1 experts are 2.26 GB of bf16 scratch.
CHUNK_EXPERTS = 32
# Above this many tokens per call a prefill plan runs (measured choice, ``PREFILL_TUNER``); at or below
# it the split-K stream. At 1024 tokens (top-6 of 384) an expert sees ~16 rows: one split-K row tile.
GROUPED_MIN_TOKENS = 1024
PATHS = ("auto", "splitk", "grouped", "tiled")


@dataclass(frozen=True)
class MoePlan:
    """A prefill plan: ``grouped`` (bf16 expert chunks + ``torch._grouped_mm``), ``tiled`` (the split-K
    kernel as a plain grouped GEMM: one K slice, ``block_m`` rows per tile, FP4 decoded in registers) or
    ``fp8`` (``moe_prefill_fp8``: FP4 -> e4m3 in registers, one FP8 MMA per 32-wide K group, ``block_k`` =
    32 x the groups per loop step, the weight tile as the MMA's first operand; ``decode`` ``fp8`` or
    ``fp8_prefetch``); ``scaled`` (``moe_prefill_scaled``: ``decode`` ``e4m3_c<C>`` experts per chunk, or
    ``e4m3_all``; ``e4m3f_...`` the library's fast FP8 accumulation; the other fields unused)."""
    path: str
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    swap: bool = False  # the decoded weight tile as the MMA's first operand (it never leaves registers)
    decode: str = "scaled"  # ``splitk_mx.DECODES``: how the tiled kernel decodes the FP4 weight tiles
    num_stages: int = 3  # ``fp8`` plans: software-pipelining depth of the K loop


# Measured per token-count class on the first call (the first plan off the GPU or under graph capture).
# The tiled shapes compile for sm90 without register spills (two fp32 accumulators, decoded FP4 tiles).
PREFILL_TUNER = ConfigTuner("moe_mx_prefill", [
    MoePlan("grouped"), MoePlan("tiled", 64, 128, 128, 8, True), MoePlan("tiled", 128, 64, 128, 8, True),
    MoePlan("tiled", 64, 64, 128, 4, True),
    # FP8 tensor cores (``moe_prefill_fp8``; not measured on the H200 yet): block_m rows x block_n weight
    # columns, W1 | W3 in one program; block_k 32: one group per loop step (``_prefetch``: the next group's
    # scales loaded one step ahead), 128: four groups per step with 32-bit scale words; ``fp8h``: K groups in
    # halves order (no byte permutes); ``fp8ht``: that, with the rows' scales transposed per sorted row (one
    # base address per tile). sm_90a loop step of the 128 x 64 W1 | W3 kernel: 369 (fp8) / 293 (fp8h) / 261
    # (fp8ht) SASS instructions, 128 of them the fp32 scaling. Each compiles without register spills (ptxas,
    # W1 | W3 / W2 registers: fp8 191 / 148, 113 / 68 at 32 x 64 (four 4-warp programs per SM), 253 / 167
    # at block_k 128; fp8h 222 / 148; fp8ht 199 / 110, 202 / 108, 96 / 70, 244 / 139 prefetching).
    MoePlan("fp8", 128, 64, 32, 8, True, "fp8", 3), MoePlan("fp8", 32, 64, 32, 4, True, "fp8", 4),
    MoePlan("fp8", 32, 256, 128, 8, True, "fp8", 3), MoePlan("fp8", 128, 64, 32, 8, True, "fp8h", 3),
    MoePlan("fp8", 128, 64, 32, 8, True, "fp8ht", 3), MoePlan("fp8", 64, 128, 32, 8, True, "fp8ht", 3),
    MoePlan("fp8", 32, 64, 32, 4, True, "fp8ht", 4), MoePlan("fp8", 128, 64, 32, 8, True, "fp8ht_prefetch", 3),
    # the same programs on bf16 tensor cores (``decode="bf16"``: exact bf16 operands, scales folded into the
    # decoded weight tile, one MMA per 64-deep step accumulating in place): W1 | W3 / W2 registers 255 / 121
    # (128 x 128), 156 / 88 (64 x 128), no spills
    MoePlan("fp8", 128, 128, 64, 8, True, "bf16", 3), MoePlan("fp8", 64, 128, 64, 8, True, "bf16", 3),
    # ``fp8f`` (``moe_prefill_fold``): the weight's scale folded into the decoded e4m3 values per column, one FFMA
    # per accumulator element and group; a column block outside the fold's exact range runs the per-group scaling
    # (not measured on the H200 yet). sm_90a SASS per group and thread, W1 | W3 / W2 (block_k 128: W2 four groups
    # per step with scale words): 128 x 64 8 warps 213 / 123 (fp8ht 261 / 162); 4 warps (one warpgroup, 128 MMA
    # columns) 278 / 147 for twice the MMA work per warp; 128 x 128 8 warps 319 / 175; 64 x 128 8 warps 212 / 122
    # (fp8ht 258 / 160; 64-row tiles waste fewer rows past an expert's end). Registers 190 / 130, 255 / 255,
    # 255 / 185, 195 / 101; no spills in the K loops but the 4-warp W2's (2 LDL per 4-group step).
    MoePlan("fp8", 128, 64, 128, 8, True, "fp8f", 3), MoePlan("fp8", 128, 64, 128, 4, True, "fp8f", 4),
    MoePlan("fp8", 128, 128, 128, 8, True, "fp8f", 3), MoePlan("fp8", 64, 128, 128, 8, True, "fp8f", 3),
    # ``scaled`` (``moe_prefill_scaled``): the experts expanded to e4m3 with one fp32 scale per column (exact where a
    # column's scale bytes span <= 14) in chunks of 64 / 128 experts (1.5 / 3.0 GB of scratch at V4.1 sizes), rows
    # quantised with one power-of-two scale each, ``torch._scaled_grouped_mm`` (CUTLASS) for W1 | W3 and W2; gated
    # by its first-use check against ``grouped``. Not measured on the H200.
    MoePlan("scaled", decode="e4m3_c64"), MoePlan("scaled", decode="e4m3_c128"),
])
# (Two fp32 accumulators of [BN, BM] and two decoded [BN, BK] weight tiles per program: these stay near
# 128 registers per thread; 128 x 128 tiles with 8 warps would spill.)
# Measured and dropped (H200, 8192 tokens): the ``registers`` tiled plan, 28.2 ms against 22.2 ms grouped.


# The decode streams' weight decode, measured per weight shape on the first call on a GPU (``scaled``
# first: taken untimed off the GPU, under graph capture or with tuning off). ``StreamPlan`` candidates run
# ``moe_stream`` (epilogues fused, no fp32 partials at one K slice); ``stream_guard`` checks each on first use.
DECODE_TUNER = ConfigTuner("moe_mx_decode", [
    splitk_mx.DECODE, "registers",
    # the fused streams (``moe_stream``): one program per expert tile and column block over all of K (or K
    # slices of 8+ steps). H200, bf16 decode: regs 64x128 1.28 / 1.43 / 1.43x the split-K ``scaled`` stream at
    # T = 1 / 32 / 128 (dot_scaled, 32x256 and 128x128 tiles slower, dropped). FP8 plans: FP4 -> e4m3 by word
    # arithmetic (``moe_stream_fp8``), a fraction of the bf16 decode's instructions. Few candidates: each costs
    # its compiles (and its first-use check) on the first decode call of a process. fp8 32x128 and 64x256
    # (timed against fp8 64x128, the H200's choice on 2026-12-03) left for the fp8h plans; the stream bench
    # (``kernels_v41.py --only stream``) still times them.
    StreamPlan("regs", 64, 128, 4, 3), StreamPlan("fp8", 64, 128, 4, 3),
    # ``fp8h`` (``moe_stream_fp8h``: K in halves order, no byte permutes, 4 groups' bytes / scale words per load;
    # not measured on the H200 yet). ptxas for sm_90a, no spills: 64 columns W1 | W3 128 registers (s4: 158),
    # W2 96; two 64-column blocks per program (128) W1 | W3 254, W2 128. SASS per 4-group step and warp: W1 | W3
    # 434 instructions at 64 columns (fp8: 803), W2 269 (fp8: 512). 32-column shapes fall back to mma.sync with
    # fp16 conversions and 8-warp ones stage the activations through registers: both left out.
    StreamPlan("fp8h", 64, 128, 4, 3),
    # ``fp8hd`` / ``fp8hd4``: 8- / 4-row tiles, one MMA per 4 groups against block-diagonal activations (64
    # columns: W1 | W3 332 / 293 SASS per step, 161 / 96 registers, W2 209 / 189, 96 / 72; 128 columns, per 64:
    # W1 | W3 282 / 244, W2 163 / 143, registers 226 / 164 and 146 / 115; no spills). The stream bench also
    # times fp8h 128 / W2 at 128 and the s4 shapes.
    StreamPlan("fp8hd", 64, 128, 4, 3), StreamPlan("fp8hd", 128, 128, 4, 3), StreamPlan("fp8hd4", 64, 128, 4, 3),
    StreamPlan("fp8hd4", 64, 128, 4, 3, w2_block_n=128), StreamPlan("fp8hd4", 128, 128, 4, 3),
    # ``fp8hd4`` with block_k 256 / 512: 2 / up to 4 four-group steps per loop iteration (``diag_unroll``: W1 | W3
    # K = 5120 by 2 / 4, W2 K = 2304 by 2 / 3), so each weight row gives 128 / 256 contiguous bytes per pipeline
    # stage instead of 64 (the H200 bytes-only ladder: 60.5 % of the floor at 64 bytes a row and step, 85.4 % at
    # 128), and 2-4x the bytes in flight per program (the 128 plans keep one 8 KB W1 | W3 stage in flight). sm_90a,
    # W1 | W3 / W2, no spills: 256 s3 108 / 74 registers, 45 / 28 KB shared; 256 s4 108 / 78, 64 / 40 KB; 512 s2
    # 106 / 80, 48 / 24 KB (128 s3: 96 / 72, 22 / 14 KB). Same bits as block_k 128. Not measured on a GPU yet.
    StreamPlan("fp8hd4", 64, 256, 4, 3), StreamPlan("fp8hd4", 64, 256, 4, 4), StreamPlan("fp8hd4", 64, 512, 4, 2),
])


# Tokens of the batch on which ``DECODE_TUNER`` times its candidates (the decode target: batch 32).
TUNE_TOKENS = 32
# Calls of at most ``gemv_mx.MAX_ROWS`` tokens (decode at batch 1-4): a second choice per weight shape between
# the stream ``DECODE_TUNER`` chose (``stream``, first: taken untimed off the GPU) and ``gemv_mx.moe_gemv``
# (CUDA-core GEMV streams over the (token, slot) pairs; names in ``gemv_mx.PLANS``), timed on
# ``SMALL_TUNE_TOKENS`` tokens. Each keeps a token's bits whatever the other tokens of the call, within its
# class; where a GEMV stream wins, a token's bits at 1-4 tokens and at 5+ tokens differ by summation order
# (the same exact products). ``SMALL_ROWS_CLASS`` False: one choice for every token count.
# ``moe_gemv_d*``: ``gemv_mx._gemv_fp4d`` (the activation and scale loads in the weight words' register layout, no
# shared-memory conversion in the loop; sm_90a W1 | W3 at 32 x 128: 527 SASS a step of 8 KB against 623).
SMALL_TUNER = ConfigTuner("moe_mx_decode_small", ["stream", "moe_gemv", "moe_gemv_n16", "moe_gemv_k128", "moe_gemv_d",
                                                  "moe_gemv_d1", "moe_gemv_d64", "moe_gemv_d64_2", "moe_gemv_f",
                                                  "moe_gemv_f_w64", "moe_gemv_f_p2"])
SMALL_TUNE_TOKENS = 1
SMALL_ROWS_CLASS = True
# Pairs (T·k) up to which one routing kernel replaces the sort and its companions (decode batches).
ROUTE_KERNEL_MAX_PAIRS = 8192


@triton.jit
def _route_kernel(ids_ptr, w_ptr, inv_ptr, rows_ptr, wt_ptr, offs_ptr, x_ptr, xq_ptr, xs_ptr, M, E, T, D, stride_x,
                  stride_q, stride_s, TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                  BLOCK_E: tl.constexpr, QDQ: tl.constexpr, FP8: tl.constexpr, BLOCK_D: tl.constexpr,
                  HALVES: tl.constexpr = False):
    """Stable expert order without a sort: the sorted position of pair i is the number of pairs with a
    smaller expert id, plus those with the same id and a smaller index. Programs also count the pairs
    with id <= e for their slice of experts (the per-expert ends). QDQ: program t also writes token row
    t's per-32 FP8 QDQ values (bf16, ``fp8_qdq_groups``: the bits of ``qdq_bf16``), one launch fewer; FP8:
    its e4m3 values and E8M0 bytes instead (the bits of ``quant_mx.act_quant_mx``; HALVES: the e4m3 values of
    each 32-wide group in ``moe_stream_fp8h`` halves order and the scales as fp32 powers of two)."""
    pid = tl.program_id(0)
    if QDQ:
        if pid < T:
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                v = tl.load(x_ptr + pid.to(tl.int64) * stride_x + cols, mask=cols < D, other=0.0).to(tl.float32)
                if FP8:
                    vg = tl.reshape(v, (BLOCK_D // 32, 32))
                    e = e8m0_exponent(tl.max(tl.abs(vg), 1), 448.0, 1e-4)
                    q8 = tl.minimum(tl.maximum(vg * pow2(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
                    if HALVES:
                        q8 = tl.reshape(tl.permute(tl.reshape(q8, (BLOCK_D // 32, 16, 2)), (0, 2, 1)),
                                        (BLOCK_D // 32, 32))
                    tl.store(xq_ptr + pid.to(tl.int64) * stride_q + cols, tl.reshape(q8, (BLOCK_D,)), mask=cols < D)
                    gs = d0 // 32 + tl.arange(0, BLOCK_D // 32)
                    if HALVES:
                        tl.store(xs_ptr + pid.to(tl.int64) * stride_s + gs, pow2(e), mask=gs * 32 < D)
                    else:
                        tl.store(xs_ptr + pid.to(tl.int64) * stride_s + gs, (e + 127).to(tl.uint8), mask=gs * 32 < D)
                else:
                    q = tl.reshape(fp8_qdq_groups(tl.reshape(v, (1, BLOCK_D)), 1, BLOCK_D), (BLOCK_D,))
                    tl.store(xq_ptr + pid.to(tl.int64) * stride_q + cols, q.to(tl.bfloat16), mask=cols < D)
    if pid * BLOCK_I < M:
        i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        im = i < M
        idi = tl.load(ids_ptr + i, mask=im, other=0).to(tl.int32)
        pos = tl.zeros([BLOCK_I], tl.int32)
        for j0 in range(0, M, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            jm = j < M
            idj = tl.load(ids_ptr + j, mask=jm, other=0).to(tl.int32)
            before = (idj[None, :] < idi[:, None]) | ((idj[None, :] == idi[:, None]) & (j[None, :] < i[:, None]))
            pos += tl.sum((before & jm[None, :]).to(tl.int32), 1)
        tl.store(inv_ptr + i, pos, mask=im)
        tl.store(rows_ptr + pos, i // TOPK, mask=im)
        tl.store(wt_ptr + pos, tl.load(w_ptr + i, mask=im, other=0.0).to(tl.float32), mask=im)
    if pid * BLOCK_E < E:
        e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
        cnt = tl.zeros([BLOCK_E], tl.int32)
        for j0 in range(0, M, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            jm = j < M
            idj = tl.load(ids_ptr + j, mask=jm, other=0).to(tl.int32)
            cnt += tl.sum(((idj[None, :] <= e[:, None]) & jm[None, :]).to(tl.int32), 1)
        tl.store(offs_ptr + e, cnt, mask=e < E)


def _sorted_pairs(topk_idx: torch.Tensor, topk_weight: torch.Tensor, experts: int,
                  x: Optional[torch.Tensor] = None, fp8: bool = False, halves: bool = False):
    """(token row of each expert-sorted pair int32, sorted position of each pair int32, per-expert ends
    int32, routing weight per sorted pair fp32); stable order, no host sync. Up to
    ``ROUTE_KERNEL_MAX_PAIRS`` pairs one kernel, above it a sort. With ``x`` [T, D] a fifth result,
    ``qdq_bf16(x)`` (written by the routing kernel when it runs); with ``fp8`` instead a fifth and sixth,
    ``act_quant_mx(x)`` (e4m3 [T, D], E8M0 [T, D/32]); ``halves``: the e4m3 values in
    ``moe_stream_fp8h.halves_order`` and the scales as fp32 (``moe_stream_fp8h.scales_f32``)."""
    flat = topk_idx.reshape(-1)
    M = flat.numel()
    dev = flat.device
    if M <= ROUTE_KERNEL_MAX_PAIRS:
        w = topk_weight.reshape(-1)
        w = w if w.is_contiguous() else w.contiguous()
        flat = flat if flat.is_contiguous() else flat.contiguous()
        inv = torch.empty(M, dtype=torch.int32, device=dev)
        rows = torch.empty(M, dtype=torch.int32, device=dev)
        wt = torch.empty(M, dtype=torch.float32, device=dev)
        offs = torch.empty(experts, dtype=torch.int32, device=dev)
        bi, be = 64, 64
        qdq = x is not None
        T, D = x.shape if qdq else (0, 0)
        if fp8 and D % 32:
            raise ValueError(f"_sorted_pairs: the hidden size {D} must be a multiple of 32 for FP8 rows")
        xq = torch.empty(T, D, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev) if qdq else None
        xs = torch.empty(T, D // 32, dtype=torch.float32 if halves else torch.uint8, device=dev) if qdq and fp8 \
            else None
        grid = max(cdiv(M, bi), cdiv(experts, be), T)
        _route_kernel[(grid,)](flat, w, inv, rows, wt, offs, x if qdq else w, xq if qdq else w,
                               xs if xs is not None else w, M, experts, T, D, x.stride(0) if qdq else 0,
                               xq.stride(0) if qdq else 0, xs.stride(0) if xs is not None else 0,
                               TOPK=topk_idx.shape[1], BLOCK_I=bi, BLOCK_J=64, BLOCK_E=be, QDQ=qdq, FP8=fp8,
                               BLOCK_D=512, HALVES=halves, num_warps=4)
        return (rows, inv, offs, wt) + (((xq, xs) if fp8 else (xq,)) if qdq else ())
    ids, order = torch.sort(flat, stable=True)
    inv = torch.empty(M, dtype=torch.int32, device=dev)
    inv[order] = torch.arange(M, dtype=torch.int32, device=dev)
    # per-expert ends straight from the sorted ids (fewer launches than counting and a prefix sum)
    offs = torch.searchsorted(ids, torch.arange(experts, dtype=ids.dtype, device=dev), right=True, out_int32=True)
    rows = (order // topk_idx.shape[1]).to(torch.int32)
    wt = topk_weight.reshape(-1).float()[order].contiguous()
    if x is not None and fp8:
        from redknot.kernels.triton.quant_mx import act_quant_mx
        xq, xs = act_quant_mx(x)
        if halves:
            from redknot.kernels.triton.moe_stream_fp8h import halves_order, scales_f32
            xq, xs = halves_order(xq), scales_f32(xs)
        return rows, inv, offs, wt, xq, xs
    return (rows, inv, offs, wt) + ((qdq_bf16(x),) if x is not None else ())


def moe_splitk(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
               plan: MoePlan = None, decode: Optional[str] = None):
    """``moe_mx`` as split-K weight streams (see the module docstring); with a ``tiled`` plan the same
    kernels run as plain grouped GEMMs (one K slice, larger row tiles) for prefill. ``decode``: how the
    GEMMs decode the FP4 weights (``splitk_mx.DECODES``, or a ``moe_stream.StreamPlan``: the fused streams;
    None: the plan's, else ``DECODE_TUNER``'s measured choice per weight shape)."""
    from redknot.kernels.triton import gemv_mx
    decode = decode or (plan.decode if plan is not None else None)
    args = (x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit, plan)
    key = (tuple(w1.shape), tuple(w2.shape))  # not the token count: a token's bits stay batch-invariant
    if decode is None and plan is None and SMALL_ROWS_CLASS and tuning_cache.small_rows_class() and topk_idx.shape[0] <= gemv_mx.MAX_ROWS:
        def stream() -> str:
            return DECODE_TUNER.pick(key, _tuning_run(x, topk_idx.shape[1], args[3:]), x.device)
        small = SMALL_TUNER.pick(key, _tuning_run(x, topk_idx.shape[1], args[3:], SMALL_TUNE_TOKENS, stream),
                                 x.device)
        decode = stream() if small == "stream" else small
    if isinstance(decode, str) and decode.startswith("moe_gemv"):
        return stream_guard.with_fallback(
            x.device, decode, lambda: gemv_mx.moe_gemv(*args[:-1], gemv_mx.PLANS[decode]),
            lambda: _moe_splitk(*args, "registers"))
    if decode is None:
        decode = DECODE_TUNER.pick(key, _tuning_run(x, topk_idx.shape[1], args[3:]), x.device)
    if isinstance(decode, StreamPlan):
        return stream_guard.with_fallback(x.device, decode, lambda: moe_stream(*args[:-1], decode),
                                          lambda: _moe_splitk(*args, "registers"))
    if decode != "registers":
        return stream_guard.with_fallback(x.device, decode, lambda: _moe_splitk(*args, decode),
                                          lambda: _moe_splitk(*args, "registers"))
    return _moe_splitk(*args, decode)


def _tuning_run(x: torch.Tensor, k: int, weights, tokens: int = 0, stream=None):
    """``DECODE_TUNER``'s timed call: each candidate on ``TUNE_TOKENS`` tokens routed at random (fixed seed),
    whatever the size of the call that triggers the tuning, so the choice per weight shape is measured at
    the decode batch the step targets (inputs built on the first timed call: none under graph capture).
    ``SMALL_TUNER``'s: ``tokens`` tokens, its ``stream`` candidate the choice ``stream()`` returns."""
    made = {}
    tokens = tokens or TUNE_TOKENS

    def run(decode):
        if not made:
            E, D = weights[0].shape[0], x.shape[1]
            g = torch.Generator(device=x.device).manual_seed(0)
            made["x"] = torch.randn(tokens, D, generator=g, device=x.device).to(x.dtype)
            made["idx"] = torch.rand(tokens, E, generator=g, device=x.device).topk(min(k, E), -1).indices
            made["wt"] = torch.rand(tokens, min(k, E), generator=g, device=x.device) + 0.1
        if decode == "stream":
            decode = stream()
        return moe_splitk(made["x"], made["idx"], made["wt"], *weights, decode=decode)
    return run


def _moe_splitk(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
                plan: Optional[MoePlan], decode: str):
    T, k = topk_idx.shape
    E, inter = w1.shape[0], w1.shape[1]
    D = w2.shape[1]
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    M = T * k
    split = decode == "registers"  # that decode reads FP4 activations de-interleaved (even / odd columns)
    # decode sizes: the W1 | W3 kernel may quantise its x slices itself (``registers``: up to RAW_MAX_ROWS)
    raw = plan is None and T <= (RAW_MAX_ROWS if split else splitk_mx.SCALED_RAW_MAX_ROWS)
    x = x if x.stride(-1) == 1 else x.contiguous()
    if raw or split:
        rows, inv, offs, wt = _sorted_pairs(topk_idx, topk_weight, E)
        xq = x if raw else qdq_bf16(x, split=True)  # [2, T, D/2]: even / odd columns, QDQ'd
    else:  # the routing kernel also writes the QDQ'd rows (one launch fewer)
        rows, inv, offs, wt, xq = _sorted_pairs(topk_idx, topk_weight, E, x)
    if plan is None:
        launch = dict(block_m=ROW_TILE)
    else:
        launch = dict(block_m=plan.block_m, block_n=plan.block_n, block_k=plan.block_k, num_warps=plan.num_warps,
                      splits=1, swap=plan.swap)
    launch["decode"] = decode
    # ``registers``: one tile map for both GEMMs; ``scaled``: each program finds its tile (no launch)
    tiles = tile_map(offs, launch["block_m"], M) if split else None
    p1, p3 = splitk_mm(xq, w1, w1_scale, M, w_fp4=True, rowid=rows, offs=offs, w3=w3, ws3=w3_scale, tiles=tiles,
                       raw=raw, **launch)
    act = torch.empty((2, M, inter // 2) if split else (M, inter), dtype=torch.bfloat16, device=x.device)
    reduce_swiglu(p1, p3, wt, swiglu_limit, act, split=split)
    p2 = splitk_mm(act, w2, w2_scale, M, w_fp4=True, offs=offs, tiles=tiles, **launch)
    return reduce_combine(p2, inv, k, out)


def moe_prefill(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
                plan: MoePlan = None):
    """The prefill plan measured fastest for this token-count class (``PREFILL_TUNER``), or ``plan``."""
    args = (x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit)
    if plan is None:
        key = (min(next_pow2(topk_idx.shape[0]), 65536), topk_idx.shape[1], tuple(w1.shape), tuple(w2.shape))
        plan = PREFILL_TUNER.pick(key, lambda p: moe_prefill(*args, plan=p), x.device)
    if plan.path == "grouped":
        return moe_grouped(*args)
    if plan.path == "fp8":
        from redknot.kernels.triton import moe_prefill_fp8 as fp8
        return fp8.guarded(plan, x.device, lambda: fp8.moe_prefill_fp8(*args, plan), lambda: moe_grouped(*args))
    if plan.path == "scaled":
        from redknot.kernels.triton import moe_prefill_scaled as scaled
        return scaled.guarded(plan, x.device, lambda: scaled.moe_prefill_scaled(*args, plan),
                              lambda: moe_grouped(*args))
    return moe_splitk(*args, plan=plan)


def moe_grouped(x, topk_idx, topk_weight, w1, w1_scale, w3, w3_scale, w2, w2_scale, swiglu_limit: float,
                chunk_experts: int = 0):
    """``moe_mx`` through bf16 expert chunks and ``torch._grouped_mm`` (see the module docstring)."""
    T, k = topk_idx.shape
    E, inter, DH = w1.shape
    D = 2 * DH
    out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    rows, inv, offs, wt = _sorted_pairs(topk_idx, topk_weight, E)
    bounds = torch.cat([offs.new_zeros(1), offs])  # [E+1]: 0, then per-expert ends
    M = T * k
    xq = qdq_bf16(x)  # [T, D] exact FP8 QDQ values
    C = min(E, chunk_experts or CHUNK_EXPERTS)
    w13 = torch.empty(C, 2 * inter, D, dtype=torch.bfloat16, device=x.device)
    w2b = torch.empty(C, D, inter, dtype=torch.bfloat16, device=x.device)
    a_c = torch.empty(M, D, dtype=torch.bfloat16, device=x.device)
    act = torch.empty(M, inter, dtype=torch.bfloat16, device=x.device)
    y = torch.empty(M, D, dtype=torch.bfloat16, device=x.device)
    for e0 in range(0, E, C):
        e1 = min(E, e0 + C)
        n = e1 - e0
        dequant_fp4_bf16(w1, w1_scale, e0, e1, w13)
        dequant_fp4_bf16(w3, w3_scale, e0, e1, w13[:, inter:])
        dequant_fp4_bf16(w2, w2_scale, e0, e1, w2b)
        offs_c = offs[e0:e1] - bounds[e0]  # chunk-relative ends, on the device
        chunk_rows(xq, a_c, bounds, e0, e1, gather=True, rowid=rows)
        h = torch._grouped_mm(a_c, w13[:n].transpose(-2, -1), offs=offs_c)  # [M, 2I]; rows past the chunk unused
        reduce_swiglu(h[None, :, :inter], h[None, :, inter:], wt, swiglu_limit, act, split=False, bounds=bounds,
                      e0=e0, e1=e1)
        y_c = torch._grouped_mm(act, w2b[:n].transpose(-2, -1), offs=offs_c)
        chunk_rows(y_c, y, bounds, e0, e1, gather=False)
    return reduce_combine(y[None], inv, k, out)
