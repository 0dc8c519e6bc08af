"""Timing helpers of ``benchmarks/e2e_v41.py``: device time by kernel (torch.profiler), time by registry
op (CUDA events), and the prefill / decode floors of the cost model at the H200's FP8 rate and bandwidth."""
from __future__ import annotations

import time

import torch
from e2e_v41_cut import sync

H200_FP8_FLOPS, H200_BYTES_PER_S = 1451e12, 4.17e12


def op_shares(fn, device, top: int = 12, max_launches: int = 8) -> list[dict]:
    """Device time by kernel (CPU time on a CPU) over one call of ``fn``; the largest ``top`` and the rest.
    A kernel among them launched 2 to ``max_launches`` times also gets ``launch_ms``, each launch's time in
    launch order (which layer's call of a kernel costs what: the indexer stream runs once per index source)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    rows = []
    for ev in prof.key_averages():
        t = ev.self_device_time_total if device.type == "cuda" else ev.self_cpu_time_total
        if t > 0:
            rows.append((ev.key, t, ev.count))
    total = sum(t for _, t, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    launches = _launch_times(prof, device, {k for k, _, c in rows[:top] if 1 < c <= max_launches})
    out = [{"op": k[:80], "share": t / total, "ms": t / 1e3, "calls": c, **({"launch_ms": launches[k]}
                                                                           if k in launches else {})}
           for k, t, c in rows[:top]]
    rest = sum(t for _, t, _ in rows[top:])
    out.append({"op": "(rest)", "share": rest / total, "ms": rest / 1e3, "calls": sum(c for *_, c in rows[top:])})
    return out


def _launch_times(prof, device, names) -> dict:
    """Self time of each launch (ms, in launch order) of the kernels / ops named ``names``."""
    out: dict = {}
    for ev in prof.events():
        if ev.key in names:
            t = ev.self_device_time_total if device.type == "cuda" else ev.self_cpu_time_total
            if t > 0:
                out.setdefault(ev.key, []).append((ev.time_range.start, t / 1e3))
    return {k: [round(ms, 3) for _, ms in sorted(v)] for k, v in out.items()}


def registry_shares(ops, fn, device) -> list[dict]:
    """Time of one call of ``fn`` by registry op (CUDA events around every routed op call, else wall
    time), and the rest of the step ("outside the registry ops": the PyTorch parts and launch gaps)."""
    from redknot.models.deepseek_v41.kernel_ops import OPS

    cuda = device.type == "cuda"
    marks: dict[str, list] = {}
    saved = {op: getattr(ops, op) for op in OPS if getattr(ops, op) is not None}

    def timed(op, impl):
        def call(*args, **kw):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = impl(*args, **kw)
                b.record()
                marks.setdefault(op, []).append((a, b))
            else:
                t = time.perf_counter()
                out = impl(*args, **kw)
                marks.setdefault(op, []).append(time.perf_counter() - t)
            return out
        return call

    for op, impl in saved.items():
        setattr(ops, op, timed(op, impl))
    try:
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        total = (time.perf_counter() - t) * 1e3
    finally:
        for op, impl in saved.items():
            setattr(ops, op, impl)
    rows = []
    for op, ms in marks.items():
        ms = sum(a.elapsed_time(b) for a, b in ms) if cuda else sum(ms) * 1e3
        rows.append({"op": op, "ms": ms, "share": ms / total, "calls": len(marks[op])})
    rows.sort(key=lambda r: -r["ms"])
    rest = total - sum(r["ms"] for r in rows)
    rows.append({"op": "(outside the registry ops)", "ms": rest, "share": rest / total, "calls": 0})
    rows.append({"op": "(step, wall)", "ms": total, "share": 1.0, "calls": 1})
    return rows


def decode_floor_s(cfg, ctx: int, batch: int) -> float:
    """Bandwidth/FLOP floor of one decode step of ``batch`` sequences at ``ctx``: the cost model's batch-1
    bytes, the per-sequence caches times the batch, and the extra routed experts a batch touches
    (expected distinct experts of batch*k uniform picks)."""
    from redknot.models.deepseek_v41.cost import CostModel

    d = CostModel(cfg).decode(ctx)
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = e * (1 - (1 - k / e) ** batch)
    per_expert = 3 * cfg.dim * cfg.moe_inter_dim * (0.5 + 1 / 32)
    extra = max(0.0, distinct - k) * per_expert * cfg.n_layers
    nbytes = d.weight_bytes + extra + batch * (d.kv_bytes + d.engram_bytes)
    return max(nbytes / H200_BYTES_PER_S, batch * d.flops / H200_FP8_FLOPS)


def prefill_floor_s(cfg, ctx: int) -> float:
    from redknot.models.deepseek_v41.cost import CostModel

    p = CostModel(cfg).prefill(ctx)
    bf16 = 796e12   # window / compressed attention run at the bf16 rate (cost model's split)
    return (p.linear + p.indexer) / H200_FP8_FLOPS + (p.window + p.compressed) / bf16
