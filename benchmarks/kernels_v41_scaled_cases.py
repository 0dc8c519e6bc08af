"""``kernels_v41.py --only prefill`` rows of the library-GEMM MoE prefill plans (``moe_prefill_scaled``): each plan
whole at each token count (checked against ``ref_v41.moe_mx`` first, through ``moe_mx.moe_prefill`` and its first-use
check), then the one-chunk plan by part: the expansion of all experts to e4m3 (HBM floor: the packed experts read,
the e4m3 copy written), the rows' e4m3 quantisation, the W1 | W3 and W2 library GEMMs (FP8 floor), the SwiGLU + row
quantisation; next to them, at each token count, the bf16 tensor-core plan (``decode="bf16"`` 128 x 128; on the H100 (run 3) the
tuner chose a ``_prefill_bf16_mm`` plan at 8192 tokens) and the grouped plan (beyond the first token count: the
``before`` row has it there). Selected with ``--prefill-decodes scaled`` (the descriptions carry the
word ``scaled``)."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from kernels_v41_cases import _case, _checked, _moe_bytes, _moe_case_inputs, moe_memo

from redknot.kernels.triton.checks_mx import V41Dims


def scaled_plans():
    """The tuner's ``scaled`` candidates, then every expert in one chunk and the library's fast accumulation."""
    from redknot.kernels.triton import moe_mx
    return [p for p in moe_mx.PREFILL_TUNER.candidates if p.path == "scaled"] + [
        moe_mx.MoePlan("scaled", decode="e4m3_all"), moe_mx.MoePlan("scaled", decode="e4m3f_c128")]


def scaled_cases(dims: V41Dims, device, smoke: bool, tokens: Sequence[int], weights=None,
                 want_moe=None) -> Iterator[tuple[str, Callable]]:
    from redknot.kernels.triton import moe_mx, stream_guard
    from redknot.kernels.triton import moe_prefill_scaled as sc
    if weights is None:
        weights, want_moe = moe_memo(dims, device)
    d, i, E, k = dims.hidden, dims.moe_inter, dims.experts, dims.topk_experts
    flops_per_token = 2 * k * 3 * d * i
    state = {}  # one token count's inputs and part buffers at a time (a real-size set is several GB)

    def held(t):
        if state.get("t") != t:
            state.clear()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            state["t"] = t
        return state

    def inputs(t):
        st = held(t)
        if "x" not in st:
            st["x"], st["idx"], st["wt"] = _moe_case_inputs(dims, device, t, t)
        return st["x"], st["idx"], st["wt"]

    one = moe_mx.MoePlan("scaled", decode="e4m3_all")

    def parts(t):
        st = held(t)
        if "parts" not in st:
            x, idx, wt = inputs(t)
            got = {}
            sc.moe_prefill_scaled(x, idx, wt, *weights(), 10.0, one, parts=got)
            got["h"] = sc.scaled_grouped_mm(got["a"], got["sa"], got["w13"], got["cs13"], got["offs_c"])
            st["parts"] = got
        return st["parts"]

    def build_expand(t, launch=()):
        w = weights()
        p = parts(t)
        w13, cs13, w2e, cs2 = p["w13"], p["cs13"], p["w2e"], p["cs2"]
        kw = dict(zip(("block_n", "block_k", "num_warps"), launch))

        def run():
            sc.expand_e4m3(w[0], w[1], 0, E, w13, cs13, 0, **kw)
            sc.expand_e4m3(w[2], w[3], 0, E, w13, cs13, i, **kw)
            sc.expand_e4m3(w[4], w[5], 0, E, w2e, cs2, 0, **kw)
        packed = sum(t_.numel() for t_ in w)
        shape = launch or (sc.EXPAND_BLOCK_N, sc.EXPAND_BLOCK_K, sc.EXPAND_WARPS)
        return _case("moe_mx prefill part", f"scaled expand {E} experts W1+W3+W2 {shape[0]}x{shape[1]} w{shape[2]}",
                     run, 0, packed + 3 * E * i * d + 4 * E * (2 * i + d), "hbm",
                     note="e4m3 copy of every expert (each has rows here); independent of T")

    def build_rows(t):
        p, x, m = parts(t), inputs(t)[0], t * k
        return _case("moe_mx prefill part", f"T={t} scaled rows e4m3", lambda: sc.rows_e4m3(
            x, p["rows"], p["bounds"], 0, E, p["a"], p["sa"]), 0, m * d * 2 + m * d + m * 4, "hbm")

    def build_w13(t):
        p, m = parts(t), t * k
        return _case("moe_mx prefill part", f"T={t} W1+W3 scaled e4m3_all", lambda: sc.scaled_grouped_mm(
            p["a"], p["sa"], p["w13"], p["cs13"], p["offs_c"]), 2 * m * d * 2 * i, m * d + E * 2 * i * d + m * 4 * i)

    def build_swiglu(t):
        p, m = parts(t), t * k
        return _case("moe_mx prefill part", f"T={t} scaled swiglu + rows e4m3", lambda: sc.swiglu_e4m3(
            p["h"], p["wt"], p["bounds"], 0, E, 10.0, p["act"], p["sact"]), 0, m * 4 * i + m * i + m * 8, "hbm")

    def build_w2(t):
        p, m = parts(t), t * k
        return _case("moe_mx prefill part", f"T={t} W2 scaled e4m3_all", lambda: sc.scaled_grouped_mm(
            p["act"], p["sact"], p["w2e"], p["cs2"], p["offs_c"]), 2 * m * i * d, m * i + E * i * d + m * d * 2)

    # same-run baselines: the bf16 tensor-core plan (H100 run 3's tuner chose ``_prefill_bf16_mm``) and grouped
    baselines = [moe_mx.MoePlan("fp8", 128, 128, 64, 8, True, "bf16", 3), moe_mx.MoePlan("grouped")]
    for n, t in enumerate(tokens):
        for plan in baselines if n else baselines[:1]:
            def build_base(plan=plan, t=t):
                x, idx, wt = inputs(t)
                fn = lambda: moe_mx.moe_prefill(x, idx, wt, *weights(), 10.0, plan=plan)
                note = _checked("moe_mx", f"T={t}", fn, lambda: want_moe(t, x, idx, wt), 3e-2)
                if plan in stream_guard.DECODE_ERRORS:
                    note += f"; refused, grouped ran instead: {stream_guard.DECODE_ERRORS[plan]}"
                name = plan.path if plan.path == "grouped" else f"{plan.decode} {plan.block_m}x{plan.block_n}"
                return _case("moe_mx prefill", f"T={t} baseline {name}", fn, t * flops_per_token,
                             _moe_bytes(dims, idx), note=note)
            name = plan.path if plan.path == "grouped" else plan.decode
            yield f"compare moe prefill scaled baseline {name} T={t}", build_base
        for plan in scaled_plans():
            def build(plan=plan, t=t):
                x, idx, wt = inputs(t)
                fn = lambda: moe_mx.moe_prefill(x, idx, wt, *weights(), 10.0, plan=plan)
                sc.reset_inexact_columns(device)
                note = _checked("moe_mx", f"T={t}", fn, lambda: want_moe(t, x, idx, wt), 3e-2)
                note += f"; inexact weight columns {int(sc.inexact_columns(device))}"
                if plan in stream_guard.DECODE_ERRORS:  # refused by its first-use check: the grouped plan ran
                    note += f"; refused, grouped ran instead: {stream_guard.DECODE_ERRORS[plan]}"
                scratch = sc.chunk_experts(plan, E) * 2 * i * d / 2**30
                return _case("moe_mx prefill", f"T={t} scaled {plan.decode}", fn, t * flops_per_token,
                             _moe_bytes(dims, idx), note=f"plan scaled {plan.decode}; scratch {scratch:.2f} GiB; {note}")
            yield f"compare moe prefill plan scaled {plan.decode} T={t}", build
        if n == 0:  # the plan's launch shape, then neighbours (columns per program, K per step, warps)
            for launch in ((), (32, 256, 4), (8, 512, 4), (16, 1024, 4), (32, 512, 8)):
                yield f"prefill part scaled expand {launch}", lambda t=t, launch=launch: build_expand(t, launch)
        yield f"prefill part scaled rows T={t}", lambda t=t: build_rows(t)
        yield f"prefill part W1+W3 scaled T={t}", lambda t=t: build_w13(t)
        yield f"prefill part scaled swiglu T={t}", lambda t=t: build_swiglu(t)
        yield f"prefill part W2 scaled T={t}", lambda t=t: build_w2(t)
