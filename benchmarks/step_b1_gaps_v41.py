"""The batch-1 decode step's launches outside the GEMV streams that have new tuner candidates, each candidate timed
against the launches the step ran before (``benchmarks/step_kernels_v41.py --b1-gaps``).

* ``wo_a``: the attention output's grouped projection at one row (V4.1: 8 groups of 1024 x 4096) as the einsum on
  the dequantised bf16 weight (before: cuBLAS, 64 MiB a layer) and each ``step_wo_a_v41`` GEMV on the stored e4m3
  weight (32 MiB + tiles).
* ``router``: the MoE router's fp32 logits (384 x 5120) as ``F.linear`` on fp32 copies (before: a copy of the row
  and cuBLAS ``gemvx``), ``torch.mm`` on the bf16 gate with fp32 output, and ``step_router_v41.router_gemv``.
* ``mhc_site``: one mHC site's pre at one row (4 streams of 5120) in each ``step_mhc_v41.SITE_FORMS`` form
  (before: ``split``, ``_mhc_mix`` + ``_site_finish``).

Each call is timed as CUDA-graph replays of ``--inner`` rounds over ``--copies`` copies of its weights (so the
weights come from HBM, as in the step, not from L2), median of ``--reps`` replays, per call; with the bytes it
must read in the stored format (the floor at 4.17 TB/s) and its error against the exact (fp64) result.
``--smoke``: toy sizes on the CPU (Triton interpreter; the times mean nothing there).
"""
from __future__ import annotations


from graph_timing import graph_ms

HBM_BYTES_PER_S = 4.17e12
REAL = {"groups": 8, "rank": 1024, "head_k": 4096, "experts": 384, "hidden": 5120, "hc": 4}
SMOKE = {"groups": 2, "rank": 64, "head_k": 256, "experts": 48, "hidden": 512, "hc": 4}


def _time_us(calls, device, reps: int, inner: int) -> float:
    """Median µs per call of ``calls`` (a list of thunks, run in turn ``inner`` times) as CUDA-graph replays."""
    return graph_ms(calls, device, reps, inner) * 1e3


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _row(op, cand, us, floor_bytes, err, before):
    return {"op": op, "candidate": cand, "us": us, "floor_us": floor_bytes / HBM_BYTES_PER_S * 1e6,
            "rel_err": err, "before": before}


def wo_a_rows(dims, device, reps, inner, copies):
    import torch

    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import step_wo_a_v41 as wa

    g, r, k = dims["groups"], dims["rank"], dims["head_k"]
    gen = torch.Generator(device=device).manual_seed(1)
    ws = [mx.quant_fp8_blocks(torch.randn(g * r, k, generator=gen, device=device) * 0.02, 32) for _ in range(copies)]
    bf = [mx.dequant_fp8_blocks(w, s, 32).to(torch.bfloat16).view(g, r, k) for w, s in ws]
    o = torch.randn(1, g, k, generator=gen, device=device).to(torch.bfloat16)
    want = wa.wo_a_reference(o, *ws[0], 32)
    stored = g * r * k + ws[0][1].numel()
    rows = []
    for cand in wa.WO_A_TUNER.candidates:
        if cand == "einsum":
            fns = [lambda b=b: torch.einsum("ngk,grk->ngr", o, b).reshape(1, -1) for b in bf]
        else:
            fns = [lambda w=w, s=s, c=cand: wa.wo_a_gemv(o, w, s, 32, c) for w, s in ws]
        err = _rel(fns[0](), want)
        rows.append(_row("wo_a", cand, _time_us(fns, device, reps, inner), stored, err, cand == "einsum"))
    return rows


def router_rows(dims, device, reps, inner, copies):
    import torch

    from redknot.kernels.triton import step_router_v41 as sr

    e, k = dims["experts"], dims["hidden"]
    gen = torch.Generator(device=device).manual_seed(2)
    wb = [(torch.randn(e, k, generator=gen, device=device) * 0.02).to(torch.bfloat16) for _ in range(copies)]
    w32 = [w.float() for w in wb]
    u = torch.randn(1, k, generator=gen, device=device).to(torch.bfloat16)
    want = u.double() @ wb[0].double().t()
    rows = []
    for cand in sr.ROUTER_TUNER.candidates:
        fns = [lambda a=a, b=b, c=cand: sr.router_logits(u, a, lambda: b, c) for a, b in zip(wb, w32)]
        try:
            err = _rel(fns[0](), want)
        except (TypeError, RuntimeError) as exc:   # torch.mm without the out_dtype overload
            print(f"router {cand}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        rows.append(_row("router", cand, _time_us(fns, device, reps, inner), e * k * 2, err, cand == "fp32"))
    return rows


def mhc_rows(dims, device, reps, inner, copies):
    import torch

    from redknot.kernels.triton.step_mhc_v41 import SITE_FORMS, site_pre
    from redknot.models.deepseek_v41.mhc import hc_collapse, hc_mixes
    from redknot.models.deepseek_v41.ref_math import rms_norm

    n, d = dims["hc"], dims["hidden"]
    gen = torch.Generator(device=device).manual_seed(3)
    h = (torch.randn(1, n, d, generator=gen, device=device) * 2).to(torch.bfloat16)
    pre_in = torch.rand(1, n, generator=gen, device=device) + 0.1
    fns_w = [torch.randn((2 + n) * n, n * d, generator=gen, device=device) * 0.02 for _ in range(copies)]
    base = torch.randn((2 + n) * n, generator=gen, device=device) * 0.5
    scale = torch.rand(3, generator=gen, device=device) + 0.5
    norm_w = torch.ones(d, device=device)
    want_pre = hc_mixes(h.double(), fns_w[0].double(), base.double(), scale.double(), n, 20, 1e-6, 1e-6)[0]
    want_u = rms_norm(hc_collapse(h, pre_in), norm_w, 1e-6)
    floor = n * d * 2 + fns_w[0].numel() * 4 + d * 2
    rows = []
    for form in SITE_FORMS:
        fns = [lambda f=f, c=form: site_pre(h, pre_in, f, base, scale, norm_w, 20, 1e-6, 1e-6, form=c) for f in fns_w]
        got = fns[0]()
        err = max(_rel(got[1], want_pre), _rel(got[0], want_u))
        rows.append(_row("mhc_site", form, _time_us(fns, device, reps, inner), floor, err, form == "split"))
    return rows


def run(device, smoke: bool, reps: int = 50, inner: int = 4, copies: int = 8) -> list:
    """Every row (op, candidate, µs a call, floor µs, rel err, whether it is what the step ran before)."""
    dims = SMOKE if smoke else REAL
    if smoke:
        reps, inner, copies = 1, 1, 2
    rows = []
    for fn in (wo_a_rows, router_rows, mhc_rows):
        rows += fn(dims, device, reps, inner, copies)
        print(f"{fn.__name__[:-5]}: done", flush=True)
    return rows


def table(rows: list) -> list:
    """Markdown lines: per op, each candidate's µs, % of its floor, error, and the saving against ``before`` x
    the launches a V4.1 cut step makes (wo_a, router: 5; mhc_site: 10)."""
    per_step = {"wo_a": 5, "router": 5, "mhc_site": 10}
    lines = ["| op | candidate | us a call | % of floor | rel err | saving ms/step (cut, 5 layers) |",
             "|---|---|---|---|---|---|"]
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        before = next((r["us"] for r in mine if r["before"]), float("nan"))
        for r in mine:
            save = (before - r["us"]) * per_step[op] / 1e3
            lines.append(f"| {op} | {r['candidate']}{' (before)' if r['before'] else ''} | {r['us']:.2f} | "
                         f"{100 * r['floor_us'] / r['us']:.0f} | {r['rel_err']:.1e} | {save:+.4f} |")
    return lines
