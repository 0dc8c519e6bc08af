"""What the GEMV streams for 1-4 activation rows (``gemv_mx``: dense FP8; ``gemv_fp4_mx``: MXFP4 experts) share:
the launch shapes (``GemvPlan``, the tuners' ``PLANS``), the row limit ``MAX_ROWS``, the K step and K slice rules
(``_block_k``, ``slices``, which reads ``TARGET_PROGRAMS`` here), the inline-PTX switch and the word-wise e4m3
decode (``_e4m3x4``). Both stream modules import from here; ``gemv_mx`` re-exports every name."""
from __future__ import annotations

import os
from dataclasses import dataclass

import triton
import triton.language as tl

from redknot.kernels.triton._common import cdiv


def _use_asm() -> bool:
    """Inline PTX when the kernels are compiled; Triton's CPU interpreter runs the byte arithmetic."""
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


# Rows up to which the GEMV streams are candidates (each row is its own accumulator set).
MAX_ROWS = 4
# Programs a launch aims for at least (132 SMs, several programs each so that loads overlap).
TARGET_PROGRAMS = 6 * 132


@dataclass(frozen=True)
class GemvPlan:
    """Launch shape: ``block_n`` weight rows per program (dense: a divisor of the scale tile), ``block_k``
    weight bytes per row per K step (16 per thread and row: ``block_n · block_k / (512 · num_warps)`` rows
    per thread), ``min_steps`` K steps per slice at least (fewer slices: less partial traffic, a longer
    load pipeline per program)."""
    block_n: int = 32
    block_k: int = 256
    min_steps: int = 2
    num_warps: int = 4
    num_stages: int = 1
    w2_block_n: int = 0  # MoE: another column block for W2 (one weight per program: fewer rows per thread)
    direct: bool = False  # MoE: ``_gemv_fp4d`` (activations and scales loaded in the weights' register layout)
    fuse: bool = False  # MoE, direct: the SwiGLU in the W1 | W3 launch, the combine in W2's (one K slice each)
    ksplits: int = 0  # MoE: K slices of every launch of this plan, whatever the pairs (0: ``slices``' rule)
    w2_block_k: int = 0  # MoE: another K step for W2 (0: block_k)
    depth: int = 1  # MoE, direct: K steps of weights and scales loaded ahead (1 or 2)



# The default launch shape of ``gemv_fp8`` / ``moe_gemv`` (frozen: one shared instance).
DEFAULT_PLAN = GemvPlan()

# The small-row tuners' GEMV candidates by name (strings: the tuning store keeps names): ``gemv*`` dense FP8
# (``gemm_mx.LINEAR_SMALL_TUNER``), ``moe_gemv*`` MXFP4 experts (``moe_mx.SMALL_TUNER``; block_k in packed bytes).
PLANS = {"gemv": GemvPlan(32, 256), "gemv_n16": GemvPlan(16, 512), "gemv_k128": GemvPlan(32, 128),
         "moe_gemv": GemvPlan(16, 256, w2_block_n=32), "moe_gemv_n16": GemvPlan(16, 128, w2_block_n=32),
         "moe_gemv_k128": GemvPlan(32, 128),
         # ``_gemv_fp4d`` with fixed K slices (W1 | W3: 2 / 1 at 32 rows, 4 / 2 at 64; W2 one), so that a token's
         # sums do not depend on how many tokens share the call (``slices`` counts the pairs' column blocks)
         "moe_gemv_d": GemvPlan(32, 128, w2_block_n=32, direct=True, ksplits=2),
         "moe_gemv_d1": GemvPlan(32, 128, w2_block_n=32, direct=True, ksplits=1),
         "moe_gemv_d64": GemvPlan(64, 128, w2_block_n=32, direct=True, ksplits=4),
         "moe_gemv_d64_2": GemvPlan(64, 128, w2_block_n=32, direct=True, ksplits=2),
         # ``moe_gemv_d1`` with the SwiGLU and the combine in the GEMV launches (``_gemv_fp4d``'s EPI): three
         # launches instead of five
         "moe_gemv_f": GemvPlan(32, 128, w2_block_n=32, direct=True, fuse=True, ksplits=1),
         # W2 at 64 x 64 (480 programs of 18 steps at one token, 76 regs: one wave) instead of 32 x 128 (960 of 9)
         "moe_gemv_f_w64": GemvPlan(32, 128, w2_block_n=64, direct=True, fuse=True, ksplits=1, w2_block_k=64),
         # ``moe_gemv_f`` with two K steps in flight per program (more bytes in flight an SM, more registers)
         "moe_gemv_f_p2": GemvPlan(32, 128, w2_block_n=32, direct=True, fuse=True, ksplits=1, depth=2)}


# One 32-bit word of 4 e4m3 bytes (K positions 4i..4i+3, little-endian) -> their 4 fp32 values: two packed
# e4m3x2 -> f16x2 conversions and four f16 -> f32 ones (every e4m3 value is an f16 normal or zero: exact).
_E4M3X4_PTX = tl.constexpr(
    "{ .reg .b16 l, h, a0, a1, b0, b1; .reg .b32 a, b; mov.b32 {l, h}, $4; cvt.rn.f16x2.e4m3x2 a, l; "
    "cvt.rn.f16x2.e4m3x2 b, h; mov.b32 {a0, a1}, a; mov.b32 {b0, b1}, b; cvt.f32.f16 $0, a0; "
    "cvt.f32.f16 $1, a1; cvt.f32.f16 $2, b0; cvt.f32.f16 $3, b1; }")


@triton.jit
def _e4m3x4(wd, USE_ASM: tl.constexpr):
    """int32 words of 4 e4m3 bytes -> the 4 values as fp32 tensors (bytes 0, 1, 2, 3)."""
    if USE_ASM:
        v0, v1, v2, v3 = tl.inline_asm_elementwise(_E4M3X4_PTX, "=r,=r,=r,=r,r", [wd],
                                                   dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
                                                   is_pure=True, pack=1)
    else:  # the interpreter: the bytes themselves, bitcast
        v0 = (wd & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v1 = ((wd >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v2 = ((wd >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        v3 = ((wd >> 24) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v0, v1, v2, v3


def _block_k(K: int, block_k: int, least: int = 32) -> int:
    """The largest power of two up to ``block_k`` that divides K (no K masks), at least ``least``."""
    bk = block_k
    while K % bk:
        bk //= 2
    if bk < least:
        raise ValueError(f"gemv_mx: K={K} must be a multiple of {least}")
    return bk


def slices(N: int, K: int, plan: GemvPlan, least: int = 32) -> tuple:
    """(slice count, slice width) for an [N, K] weight: enough programs for ``TARGET_PROGRAMS`` from the
    column blocks and K slices, each slice at least ``plan.min_steps`` K steps. A function of the weight
    shape and the plan only (not of the rows)."""
    bk = _block_k(K, plan.block_k, least)
    n_blocks = cdiv(N, plan.block_n)
    S = max(1, min(cdiv(TARGET_PROGRAMS, n_blocks), K // (plan.min_steps * bk)))
    ksplit = cdiv(cdiv(K, S), bk) * bk
    return cdiv(K, ksplit), ksplit

