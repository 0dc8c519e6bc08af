#!/usr/bin/env python3
"""Time the prefill RoPE of the rotated columns in place: ``prefill_rows_v41.rope_cols_`` (one contiguous load
and store of each row's 2·half rotated columns, cos/sin once per token) against the stride-2 form it replaced
(two interleaved 16-bit loads and stores per pair, cos/sin per row; kept here only to be timed) and against
``step_rope_v41.rope_rows`` (the unfused path: every column read and written, into a new tensor).

    python benchmarks/rope_cols_v41.py --out DIR            # on a GPU, about 20 s
    python benchmarks/rope_cols_v41.py --smoke --out DIR    # CPU: Triton interpreter, toy sizes

x [T, 64, 512] bf16 (the q rows after ``wq_b`` and the attention output before ``wo_a`` at V4.1 widths), 64
rotated columns. Each call is a CUDA graph replayed (median). ``GB/s`` counts the bytes a kernel must move:
the rotated columns read and written (plus cos/sin) for the in-place forms, the whole tensor read and written
for ``rope_rows``. Every form is checked for the bits of ``rope_rows`` first. Results: ``DIR/rope_cols_v41.md``
and ``.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels below are decorated

import triton
import triton.language as tl
from step_kernels_v41 import _time_ms  # graph-replay timing, one copy

from redknot.kernels.triton.step_rope_v41 import _mul_rn


@triton.jit
def _rope_cols_pairs(x_ptr, cos_ptr, sin_ptr, R, heads, stride_t, stride_h, stride_c, col0,
                     HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, INVERSE: tl.constexpr,
                     ASM: tl.constexpr):
    """The stride-2 form (as measured on the H100, 2026-12-06: 0.57 ms a call at [8192, 64, 512])."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < R
    tok = (r // heads).to(tl.int64)
    hh = (r % heads).to(tl.int64)
    j = tl.arange(0, HALF_P)
    m = rm[:, None] & (j < HALF)[None, :]
    base = x_ptr + tok[:, None] * stride_t + hh[:, None] * stride_h + col0 + 2 * j[None, :]
    re = tl.load(base, mask=m, other=0.0).to(tl.float32)
    im = tl.load(base + 1, mask=m, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + tok[:, None] * stride_c + j[None, :], mask=m, other=1.0)
    s = tl.load(sin_ptr + tok[:, None] * stride_c + j[None, :], mask=m, other=0.0)
    if INVERSE:
        s = -s
    tl.store(base, (_mul_rn(re, c, ASM) - _mul_rn(im, s, ASM)).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(base + 1, (_mul_rn(re, s, ASM) + _mul_rn(im, c, ASM)).to(x_ptr.dtype.element_ty), mask=m)


def rope_cols_pairs_(x, cos, sin):
    from redknot.kernels.triton._common import cdiv, interpreting, next_pow2

    t, heads, d = x.shape
    half = cos.shape[-1]
    half_p = next_pow2(half)
    block_r = max(1, min(64, 2048 // half_p))
    _rope_cols_pairs[(cdiv(t * heads, block_r),)](
        x, cos, sin, t * heads, heads, x.stride(0), x.stride(1), cos.stride(0), d - 2 * half, HALF=half,
        HALF_P=half_p, BLOCK_R=block_r, INVERSE=False, ASM=not interpreting() and x.is_cuda, num_warps=4)
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="output folder (default: $OUT, else outputs/rope_cols_v41)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    import torch

    from redknot.kernels.triton.prefill_rows_v41 import rope_cols_
    from redknot.kernels.triton.step_rope_v41 import rope_rows, rope_table
    from redknot.models.deepseek_v41.ref_math import rope_inv_freq

    out = Path(a.out or os.environ.get("OUT") or "outputs/rope_cols_v41")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    t, heads, d, rope = (5, 3, 64, 16) if a.smoke else (a.tokens, 64, 512, 64)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, heads, d, generator=g, device=device).to(torch.bfloat16)
    pos = torch.arange(8192, 8192 + t, device=device)
    cos, sin = rope_table(pos, rope_inv_freq(rope, 160000.0, (16.0, 65536, 32.0, 1.0)).to(device))
    want = rope_rows(x, cos, sin)
    esz = x.element_size()
    rot = t * heads * rope * esz * 2 + 2 * cos.numel() * 4     # rotated columns read + written, cos/sin
    whole = 2 * x.numel() * esz + 2 * cos.numel() * 4
    rows = []
    for name, fn, nbytes in (("rope_cols_ (contiguous rows)", lambda y: rope_cols_(y, cos, sin), rot),
                             ("stride-2 pairs (before)", lambda y: rope_cols_pairs_(y, cos, sin), rot),
                             ("rope_rows (unfused)", lambda y: rope_rows(y, cos, sin), whole)):
        y = x.clone()
        equal = bool(torch.equal(fn(y), want))
        y = x.clone()
        ms = _time_ms(lambda f=fn, v=y: f(v), device, a.reps)   # repeated in place: the timing, not the values
        rows.append({"kernel": name, "equal": equal, "ms": ms, "bytes": nbytes, "gb_s": nbytes / ms / 1e6})
        print(f"{name}: {ms:.4f} ms, {nbytes / ms / 1e6:.0f} GB/s, same bits as rope_rows: {equal}", flush=True)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    lines = [f"# RoPE of the rotated columns, x [{t}, {heads}, {d}] bf16, {rope} rotated ({dev})", "",
             "| kernel | same bits | ms | MB moved | GB/s |", "|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['equal']} | {r['ms']:.4f} | {r['bytes'] / 1e6:.0f} | {r['gb_s']:.0f} |"
              for r in rows]
    (out / "rope_cols_v41.md").write_text("\n".join(lines) + "\n")
    (out / "rope_cols_v41.json").write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
