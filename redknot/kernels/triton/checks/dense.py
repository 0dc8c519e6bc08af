"""Checks of the row-wise and GEMM kernels: MoE, linear (bf16 / FP8), RMSNorm, RoPE, mHC."""
from __future__ import annotations

from typing import List

import torch

from redknot.kernels import ref_moe
from redknot.kernels import reference as ref
from redknot.kernels.ref_quant import dequantize_fp8_block, quantize_fp8_block
from redknot.kernels.triton import fp8, mhc, moe, norm, ops
from redknot.kernels.triton._common import interpreting
from redknot.kernels.triton.checks.common import CheckResult, Dims, poisoned, result


def _routing(t: int, d: Dims, gen: torch.Generator, device, skew: bool):
    """Top-k distinct expert ids per token and weights; ``skew`` sends every token to experts 0 and 1."""
    e, k = d.experts, d.experts_per_token
    if skew:
        rows = [torch.cat([torch.tensor([0, 1]), torch.randperm(e - 2, generator=gen) + 2])[:k] for _ in range(t)]
    else:
        rows = [torch.randperm(e, generator=gen)[:k] for _ in range(t)]
    ids = torch.stack(rows) if t else torch.empty(0, k, dtype=torch.long)
    return ids.to(device), torch.rand(t, k, generator=gen).to(device)


def check_moe(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    dm, inter, e = d.hidden, d.moe_inter, d.experts
    w1 = (torch.randn(e, inter, dm, generator=gen) * dm ** -0.5)
    w3 = (torch.randn(e, inter, dm, generator=gen) * dm ** -0.5)
    w2 = (torch.randn(e, dm, inter, generator=gen) * inter ** -0.5)
    float_w = [w.to(device=device, dtype=dtype) for w in (w1, w2, w3)]
    for case, t, skew in (("37 tokens, uniform routing", 37, False), ("1 token (decode)", 1, False),
                          ("64 tokens, 2 hot experts", 64, True)):
        x = torch.randn(t, dm, generator=gen).to(device=device, dtype=dtype) * 2.0
        ids, wts = _routing(t, d, gen, device, skew)
        want = ref_moe.moe(x, ids, wts, *float_w, 1.0)
        out = poisoned((t, dm), dtype, device)
        moe.moe_experts(x, ids, wts, *float_w, 1.0, out=out)
        rows.append(result("moe", f"{case}, poisoned", dtype, out, want))
    x = torch.randn(37, dm, generator=gen).to(device=device, dtype=dtype)
    ids = torch.zeros(37, 1, dtype=torch.long, device=device)
    wts = torch.rand(37, 1, generator=gen).to(device)
    one = [w[:1] for w in float_w]
    out = poisoned((37, dm), dtype, device)
    moe.moe_experts(x, ids, wts, *one, 1.0, out=out)
    rows.append(result("moe", "1 expert (shared), 37 tokens, poisoned", dtype, out, ref_moe.moe(x, ids, wts, *one, 1.0)))
    if dtype == torch.bfloat16:
        quant = [quantize_fp8_block(w[i]) for w in (w1, w2, w3) for i in range(e)]
        q = [torch.stack([quant[j * e + i][0] for i in range(e)]).to(device) for j in range(3)]
        s = [torch.stack([quant[j * e + i][1] for i in range(e)]).to(device) for j in range(3)]
        x = torch.randn(29, dm, generator=gen).to(device=device, dtype=dtype)
        ids, wts = _routing(29, d, gen, device, False)
        want = ref_moe.moe(x, ids, wts, q[0], q[1], q[2], 10.0, s[0], s[1], s[2])
        got = ops.moe_op(x, ids, wts, q[0], q[1], q[2], 10.0, s[0], s[1], s[2])
        rows.append(result("moe", "FP8 experts (128x128 block scales)", dtype, got, want))
    return rows


def check_linear(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    for m, n, k in ((1, 3 * 128, 2 * 128), (77, 2 * 128 + 64, 3 * 128)):
        x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        w = torch.randn(n, k, generator=gen) * k ** -0.5
        rows.append(result("linear", f"float weight {m}x{n}x{k}", dtype, ops.linear(x, w.to(device, dtype)),
                           ref.linear(x, w.to(device, dtype))))
        wq, ws = (t.to(device) for t in quantize_fp8_block(w))
        rows.append(result("linear", f"FP8 weight, 16-bit activations {m}x{n}x{k}", dtype, ops.linear(x, wq, ws),
                           ref.linear(x, wq, ws)))
        # FP8 x FP8: checked against the dequantised GEMM of exactly the quantised operands; Hopper's e4m3
        # tensor cores accumulate each 128-deep slice with ~14-bit precision, hence 1e-3.
        xq, xs = fp8.quantize_act(x)
        got = fp8.block_scaled_mm(xq, xs, wq, ws, out_dtype=torch.float32)
        deq_x = xq.double() * xs.double().repeat_interleave(128, 1)[:, :k]
        want = deq_x @ dequantize_fp8_block(wq, ws).double().T
        rows.append(result("linear", f"FP8 act x FP8 weight {m}x{n}x{k}", torch.float32, got, want, tol=1e-3))
        if not interpreting():  # the interpreter's e4m3 rounding is not round-to-nearest
            exact = (xq.float() == (x.float() / xs.repeat_interleave(128, 1)[:, :k]).to(torch.float8_e4m3fn).float())
            rows.append(CheckResult("linear", f"activation quantisation {m}x{k}", str(dtype).replace("torch.", ""),
                                    bool(exact.all()), 1.0 - float(exact.float().mean()), 0.0,
                                    "e4m3 codes equal torch's round-to-nearest cast"))
    return rows


def check_norms(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    t = 13
    for shape, name in (((t, d.heads, d.head_dim), "per-head"), ((t, d.hidden), "hidden")):
        x = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype) * 3.0
        wt = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device)
        for weight in (wt, None):
            out = poisoned(shape, dtype, device)
            norm.rms_norm(x, weight, 1e-6, out=out)
            rows.append(result("rms_norm", f"{name} {'weighted' if weight is not None else 'unweighted'}, poisoned",
                               dtype, out, ref.rms_norm(x, weight, 1e-6)))
        ang = torch.rand(t, d.rope_dim // 2, generator=gen) * 1000
        cos, sin = ang.cos().to(device), ang.sin().to(device)
        for inverse in (False, True):
            out = poisoned(shape, dtype, device)
            norm.rope(x, cos, sin, inverse, out=out)
            rows.append(result("rope", f"{name} {'inverse' if inverse else 'forward'}, poisoned", dtype, out,
                               ref.rope(x, cos, sin, inverse)))
    return rows


def check_mhc(d: Dims, device, dtype: torch.dtype, seed: int = 0) -> List[CheckResult]:
    gen = torch.Generator().manual_seed(seed)
    rows: List[CheckResult] = []
    n, dm = d.hc_mult, d.hidden
    for t in (1, 37, 300):  # 300 > 256: the 64-token tiles of prefill-sized calls
        streams = torch.randn(t, n, dm, generator=gen).to(device=device, dtype=dtype)
        fn = (torch.randn((2 + n) * n, n * dm, generator=gen) * (n * dm) ** -0.5).to(device)
        base = (0.5 * torch.randn((2 + n) * n, generator=gen)).to(device)
        scale = (1 + 0.1 * torch.randn(3, generator=gen)).to(device)
        outs = (poisoned((t, dm), dtype, device), poisoned((t, n), torch.float32, device),
                poisoned((t, n, n), torch.float32, device))
        mhc.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, outs=outs)
        want = ref.mhc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
        for name, got, exp in zip(("collapsed", "post", "comb"), outs, want):
            rows.append(result("mhc_pre", f"{name}, {t} tokens, poisoned", got.dtype, got, exp))
        y = torch.randn(t, dm, generator=gen).to(device=device, dtype=dtype)
        out = poisoned((t, n, dm), dtype, device)
        mhc.mhc_post(y, streams, want[1], want[2], out=out)
        rows.append(result("mhc_post", f"{t} tokens, poisoned", dtype, out, ref.mhc_post(y, streams, want[1], want[2])))
        fh = (torch.randn(n, n * dm, generator=gen) * (n * dm) ** -0.5).to(device)
        bh, sh = (0.5 * torch.randn(n, generator=gen)).to(device), (1 + 0.1 * torch.randn(1, generator=gen)).to(device)
        rows.append(result("mhc_head", f"{t} tokens", dtype, ops.mhc_head(streams, fh, bh, sh, 1e-6, 1e-6),
                           ref.mhc_head(streams, fh, bh, sh, 1e-6, 1e-6)))
    return rows
