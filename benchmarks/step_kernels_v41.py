#!/usr/bin/env python3
"""Check and time the V4.1 tensor-only step's graph-safe kernels at real V4.1 widths.

    PYTHONUNBUFFERED=1 python benchmarks/step_kernels_v41.py --out DIR   # on an H200, about 1-2 minutes
    python benchmarks/step_kernels_v41.py --smoke --out DIR              # CPU: Triton interpreter, toy sizes

Per (context, batch) of decode rows (one request per row, each at its own context): the step attention
(``step_attention_mx``: 64 heads of 512 over a 128-row FP8 window ring and 512 compressed FP4 entries) and
the paged indexer (``step_index_scores`` + ``topk_select``, the radix top-k: 32 heads of 128 over FP4
index keys, top-512 of the visible entries, ratio 1) against their PyTorch references (the math the tensor step ran before:
gathered, decoded, einsum, sort). Each is checked (attention: relative error; indexer: scores and the
selection) and timed (CUDA events around a CUDA-graph replay of the call, median of repetitions), with
the fraction of the bandwidth floor: bytes a call must read once at 4.17 TB/s (stored formats).
Results: ``DIR/step_kernels_v41.md`` and ``.json`` (``$OUT`` if --out is not given).

    python benchmarks/step_kernels_v41.py --count-launches --out DIR     # CPU, Triton interpreter, ~1 minute

counts the device launches of one decode step of the tensor-only step instead (the e2e_v41 toy cut, every
V4.1 op on its Triton kernel): PyTorch ops that launch a kernel plus Triton launches, per step region. At
decode sizes a replayed graph pays roughly a fixed cost per launch, so this is the number the fused
epilogues reduce; it does not need a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from graph_timing import graph_ms  # noqa: E402

HBM_BYTES_PER_S = 4.17e12
REAL = dict(heads=64, dim=512, window=128, topk=512, index_heads=32, index_dim=128, block_size=256)
SMOKE = dict(heads=4, dim=64, window=16, topk=8, index_heads=4, index_dim=64, block_size=16)


def _time_ms(fn, device, reps: int) -> float:
    """Median ms of ``fn``: a CUDA graph of one call replayed ``reps`` times on a GPU, a plain call on a CPU."""
    return graph_ms([fn], device, reps)


def case(ctx: int, batch: int, dims: dict, device, reps: int, reference: bool) -> dict:
    import torch

    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton.step_attention_mx import step_attention_mx, step_attention_reference
    from redknot.kernels.triton.step_select import topk_select
    from redknot.kernels.triton.step_indexer_mx import (select_topk, step_index_scores,
                                                          step_index_scores_reference)

    torch.manual_seed(ctx + batch)
    h, d, win, k = dims["heads"], dims["dim"], dims["window"], dims["topk"]
    hi, di, bs = dims["index_heads"], dims["index_dim"], dims["block_size"]
    dev = device
    pos = torch.tensor([ctx + 3 * i for i in range(batch)], device=dev)
    back = torch.zeros(batch, dtype=torch.long, device=dev)
    slot = torch.arange(batch, device=dev)
    ring = mx.pack_window_rows(torch.randn(batch * win, d, device=dev))
    new = mx.pack_window_rows(torch.randn(batch, d, device=dev))
    n_ent = ctx + 3 * batch + 1
    pages = -(-n_ent // bs)
    comp = mx.pack_compressed_entries(torch.randn(pages * bs, d, device=dev))
    # Index keys of every request as random stored bytes (any e2m1 code, scales 2^-9..2^0): batch x 1M
    # entries would not fit as fp32 values to pack.
    keys = torch.randint(0, 256, (batch * pages * bs, mx.index_key_bytes(di)), dtype=torch.uint8, device=dev)
    keys[:, di // 2:] = torch.randint(118, 128, (keys.shape[0], di // 32), dtype=torch.uint8, device=dev)
    table = (torch.arange(batch)[:, None] * pages + torch.arange(pages)[None, :]).to(dev, torch.int32)
    q = (torch.randn(batch, h, d, device=dev) * 0.2).to(torch.bfloat16)
    sinks = torch.randn(h, device=dev)
    cidx = torch.sort(torch.randint(0, n_ent, (batch, k), device=dev), 1).values
    qi = mx.act_quant_ref(torch.randn(batch, hi, di, device=dev), "fp4", mx.MX_GROUP, "ue8m0")
    wi = torch.randn(batch, hi, device=dev) * (di ** -0.5 * hi ** -0.5)
    vis = pos + 1
    row = {"context": ctx, "batch": batch}
    attn_args = (q, ring, win, new, slot, pos, back, win, sinks, d ** -0.5, comp, cidx)
    got = step_attention_mx(*attn_args).float()
    attn_bytes = batch * (win * mx.window_row_bytes(d) + k * mx.compressed_entry_bytes(d) + 2 * h * d * 2)
    row["attention_ms"] = _time_ms(lambda: step_attention_mx(*attn_args), dev, reps)
    row["attention_floor_ms"] = attn_bytes / HBM_BYTES_PER_S * 1e3
    row["attention_fraction"] = row["attention_floor_ms"] / row["attention_ms"]
    idx_args = (qi, wi, keys, table, vis, 1, bs)
    for bf16 in (False, True):
        tag = "bf16" if bf16 else "fp32"
        sc = step_index_scores(*idx_args, bf16_scores=bf16)
        sel = topk_select(sc, k)            # the tensor step's selection (radix select on a GPU)
        ib = int(vis.sum()) * mx.index_key_bytes(di) + sc.numel() * 4
        row[f"index_{tag}_ms"] = _time_ms(lambda: topk_select(step_index_scores(*idx_args, bf16_scores=bf16), k),
                                          dev, reps)
        row[f"index_{tag}_floor_ms"] = ib / HBM_BYTES_PER_S * 1e3
        row[f"index_{tag}_fraction"] = row[f"index_{tag}_floor_ms"] / row[f"index_{tag}_ms"]
        if reference:
            want = step_index_scores_reference(*idx_args, bf16_scores=bf16)
            fin = torch.isfinite(want)
            row[f"index_{tag}_inf_equal"] = bool(torch.equal(torch.isinf(sc), torch.isinf(want)))
            row[f"index_{tag}_max_rel"] = float(((sc[fin] - want[fin]).abs() / want[fin].abs().clamp(min=1e-6)).max())
            ref_sel = select_topk(want, k)
            row[f"index_{tag}_rows_same_selection"] = int((ref_sel == sel).all(1).sum())
            row[f"index_{tag}_reference_ms"] = _time_ms(
                lambda: select_topk(step_index_scores_reference(*idx_args, bf16_scores=bf16), k), dev, 3)
    if reference:
        want = step_attention_reference(*attn_args).float()
        row["attention_rel_err"] = float((got - want).abs().max() / want.abs().max())
        row["attention_reference_ms"] = _time_ms(lambda: step_attention_reference(*attn_args), dev, 3)
    return row


# Ops that launch no device kernel (views, allocation, metadata).
NO_LAUNCH = {"view", "_unsafe_view", "expand", "unsqueeze", "squeeze", "reshape", "select", "slice", "t", "transpose",
             "permute", "as_strided", "alias", "detach", "unflatten", "flatten", "split", "unbind", "lift_fresh",
             "empty", "empty_like", "new_empty", "empty_strided", "set_", "_reshape_alias", "view_as", "unfold",
             "chunk", "narrow", "diagonal", "movedim", "resolve_conj", "resolve_neg", "split_with_sizes", "size",
             "stride", "numel", "dim", "is_same_size"}


def count_launches(batch: int = 1) -> dict:
    """Device launches of one tensor-only decode step of the e2e_v41 toy cut (CPU, Triton interpreter), by
    step region and by op: PyTorch ops that launch a kernel (a conversion to the same dtype does not) plus
    Triton launches (the ops PyTorch runs inside an interpreted Triton launch are not counted)."""
    import collections
    import contextlib

    import torch
    import triton.runtime.interpreter as interp
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import e2e_v41
    import redknot.models.deepseek_v41.tensor_step as ts
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    device = torch.device("cpu")
    cfg = e2e_v41.cut_config(True, 100)
    model = e2e_v41.build(cfg, e2e_v41.random_tensors(cfg, device), "reference", V41Ops(KernelSet(default="triton")),
                          device)
    b = e2e_v41.Batch(model, batch, 64, block_size=16)
    ids = e2e_v41.tokens(40, cfg.vocab_size, 1)
    for s in range(batch):
        b.step([ids], seqs=[s])
    step = ts.TensorStep(torch.full((batch,), 11, dtype=torch.long), torch.tensor(b.lens), torch.arange(batch + 1),
                         torch.arange(batch), torch.tensor(b.blocks), max_rows=1)
    ts.tensor_forward(model, step, b.state)                       # warm: weight caches, tuners
    state = {"triton": 0, "region": "(outside the regions)"}
    regions, ops, region_ops = collections.Counter(), collections.Counter(), collections.Counter()

    def launch(name: str) -> None:
        regions[state["region"]] += 1
        ops[name] += 1
        region_ops[(state["region"], name)] += 1

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            same = name == "_to_copy" and isinstance(out, torch.Tensor) and out.dtype == args[0].dtype
            if not state["triton"] and name not in NO_LAUNCH and not same:
                launch(name)
            return out

    run = interp.GridExecutor.__call__

    def counted(self, *a, **kw):
        launch("triton " + getattr(self.fn, "__name__", "?"))
        state["triton"] += 1
        try:
            return run(self, *a, **kw)
        finally:
            state["triton"] -= 1

    @contextlib.contextmanager
    def region(name):
        old, state["region"] = state["region"], name
        try:
            yield
        finally:
            state["region"] = old

    ranges = getattr(ts, "region", None)     # (a step without ranges counts everything outside them)
    interp.GridExecutor.__call__, ts.region = counted, region
    try:
        with Count():
            ts.tensor_forward(model, step, b.state)
    finally:
        interp.GridExecutor.__call__ = run
        if ranges is None:
            del ts.region
        else:
            ts.region = ranges
    return {"layers": cfg.n_layers, "batch": batch, "launches": sum(regions.values()),
            "by_region": dict(regions.most_common()), "by_op": dict(ops.most_common()),
            "by_region_op": {r: {o: n for (rr, o), n in region_ops.most_common() if rr == r} for r in regions}}


def b1_gaps(a) -> dict:
    """``--b1-gaps``: ``step_b1_gaps_v41``'s rows -> ``OUT/step_b1_gaps_v41.{md,json}`` and stdout."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import step_b1_gaps_v41 as gaps

    device = torch.device("cpu" if a.smoke else "cuda")
    rows = gaps.run(device, a.smoke, reps=max(a.reps, 50))
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_b1_gaps_v41.json").write_text(json.dumps(report, indent=1))
    lines = ["# V4.1 b1 step: candidates against the launches they replace", "", f"device: {report['device']}", "",
             *gaps.table(rows)]
    (out / "step_b1_gaps_v41.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/step_kernels_v41"))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU (Triton interpreter)")
    ap.add_argument("--contexts", default="8192,131072,1048576")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--reference-max-context", type=int, default=131072,
                    help="run the PyTorch references (check and time) up to this context")
    ap.add_argument("--count-launches", action="store_true",
                    help="count the launches of one tensor-only decode step instead (CPU, Triton interpreter)")
    ap.add_argument("--small-stream", default=None,
                    help="with --count-launches: the weight stream every fused step linear takes at 1-4 rows "
                         "(step_proj_v41.FORCE_SMALL: fp8, gemv, gemv_n16, gemv_k128; default: the tuner's, "
                         "fp8 off the GPU)")
    ap.add_argument("--b1-gaps", action="store_true",
                    help="time the b1 step's wo_a / router / mHC site candidates against the launches they replace "
                         "instead (benchmarks/step_b1_gaps_v41.py; with --smoke on the CPU)")
    a = ap.parse_args(argv)
    if a.smoke or a.count_launches:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.b1_gaps:
        return b1_gaps(a)
    if a.count_launches:
        if a.small_stream:
            from redknot.kernels.triton import step_proj_v41
            step_proj_v41.FORCE_SMALL = a.small_stream
        rep = count_launches()
        rep["small_stream"] = a.small_stream or "tuned"
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_launches_v41.json").write_text(json.dumps(rep, indent=1))
        print(f"launches of one tensor-only decode step ({rep['layers']} layers, batch {rep['batch']}): "
              f"{rep['launches']}")
        for k, v in rep["by_region"].items():
            print(f"  {k:24s} {v}   " + ", ".join(f"{o} {n}" for o, n in rep["by_region_op"][k].items()))
        return rep
    import torch

    device = torch.device("cpu" if a.smoke else "cuda")
    dims = SMOKE if a.smoke else REAL
    ctxs = [int(c) for c in a.contexts.split(",") if c] if not a.smoke else [40]
    batches = [int(b) for b in a.batches.split(",") if b] if not a.smoke else [1, 3]
    rows = []
    for ctx in ctxs:
        for b in batches:
            r = case(ctx, b, dims, device, a.reps, ctx <= a.reference_max_context)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            rows.append(r)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dims": dims,
              "rows": rows}
    (out / "step_kernels_v41.json").write_text(json.dumps(report, indent=1))
    lines = ["# V4.1 tensor-step kernels", "", f"device: {report['device']}", "",
             "| context | batch | attention ms (% floor) | ref ms | index fp32 ms (% floor) | index bf16 ms | "
             "ref fp32 ms | attn rel err | rows same top-k fp32/bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for r in rows:
        cells = [str(r["context"]), str(r["batch"]),
                 f"{r['attention_ms']:.3f} ({100 * r['attention_fraction']:.0f} %)",
                 f"{r.get('attention_reference_ms', nan):.3f}",
                 f"{r['index_fp32_ms']:.3f} ({100 * r['index_fp32_fraction']:.0f} %)", f"{r['index_bf16_ms']:.3f}",
                 f"{r.get('index_fp32_reference_ms', nan):.3f}", f"{r.get('attention_rel_err', nan):.1e}",
                 f"{r.get('index_fp32_rows_same_selection', '-')}/{r.get('index_bf16_rows_same_selection', '-')}"]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "step_kernels_v41.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return report


if __name__ == "__main__":
    main()
