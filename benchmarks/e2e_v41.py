"""DeepSeek-V4.1 real-dimension cut on the engine path: parity of the kernel path against the PyTorch
path, chunked prefill time / peak memory / cache bytes per token, decode steps, each against the cost
model's floor (FP8 1451 TFLOP/s, 4.17 TB/s), and time shares per registry op (CUDA events; the rest of the
step is "outside the registry ops") and per kernel (torch.profiler).

The cut keeps the real widths (dim 5120, 64 heads x 512, 384 experts top-6; FP8 32x32-tile weights and
MXFP4 experts kept in memory as random bytes) and five layers with the roles of the full schedule:
0 ratio-2 kv/index source with Engram (like layer 14), 1 ratio-2 consumer, 2 ratio-1 kv source and
candidate source (layer 20), 3 ratio-1 consumer, 4 candidate index source (layer 24). Engram tables are
cut to ``--engram-vocab`` (their row count does not change the per-token work).

Parity runs layer by layer: each attention block, MoE and Engram of the PyTorch path is run again
through the kernel path on the same inputs and a copy of the state (so one quantisation step flipped by
rounding cannot make the two models drift apart), under ``reference`` numerics (every op routed) and
``bf16`` numerics (attention, caches, indexer, Engram routed; linears are plain bf16 there). The
indexer's selections (top-k, and layer 20's candidate blocks, which the consumers then read from the
PyTorch path on both sides) are compared tie-aware against the PyTorch path's scores: rows equal,
equal up to ties at the cut score, and different. Reference numerics rounds the scores to bf16 (the
reference's einsum) and FP4 x FP4 dots take few values, so most long rows tie at the 512th score:
an exact comparison found 3618/6156 rows equal on the H200. At the real indexer width on a CPU
(random FP4 queries and keys, Triton interpreter) the kernel's scores equal the PyTorch path's bit for
bit, 35 of 64 rows have a tie straddling the 512th score, and the 28 rows whose sets differed all
differed only inside that tie. The streamed top-k breaks ties to the lower entry, as the PyTorch path
does.

Every prefill first runs one untimed chunk per new shape class (kernel tuners key on the power of two
above the entries a chunk scores), and a profiled prefill chunk runs once untimed at the same
position first, so the timings and shares are steady-state.

Decode runs eager; ``--decode-graphs`` also runs it through the tensor-only step
(``deepseek_v41/tensor_step.py``) captured in a CUDA graph, timed per replay and compared with the
eager step (that step's attention and indexer are PyTorch math, not the registry's span kernels), and
(unless ``--skip-profile``) profiled: ``--profile-steps`` eager steps and as many replays under torch.profiler,
device time per kernel and per step region, busy time against the replay's wall time (the launch gaps),
in the report's "Decode step profile" sections (``step_profile_v41``).
``--smoke`` runs every step at toy width on a CPU (kernel ops: their PyTorch references). The V4 cut
is ``benchmarks/e2e_cut.py``.

    python benchmarks/e2e_v41.py --out outputs/e2e_v41      (or: benchmarks/e2e_cut.py --model v41 ...)
    python benchmarks/e2e_v41.py --out outputs/e2e_v41_1m --prefill 32768,131072,1048576 --decode-batch '' \
        --decode-context '' --skip-parity --skip-profile --budget-s 540   # long prefills, up to 1M tokens
    python benchmarks/e2e_v41.py --out outputs/e2e_v41_dec --prefill '' --decode-context 8192,131072,1048576 \
        --decode-synthetic --decode-graphs --budget-s 300   # decode in graphs at 1M without the 1M prefill
    python benchmarks/e2e_v41.py --out outputs/e2e_v41_prof --prefill '' --decode-context 8192 --decode-batch 1,32 \
        --decode-synthetic --decode-graphs --skip-parity --profile-steps 10 --budget-s 240   # where a step's time goes

Each prefill is timed chunk by chunk (synchronised): the chunk times are fitted to ``a + b * start``
(``v41_prefill_profile.ChunkFit``; the indexer's scoring of every visible entry is the part that grows),
which projects the next context for the budget. The profiled chunk also gets a self-time breakdown by
region (registry ops and the PyTorch parts by function: ``v41_prefill_profile.region_shares``). Peak
memory is reported with and without the weights, and the global cache bytes per token against the cut's
expected value and scaled to V4.1-Flash's four kv sources (890 B/token).

Every case is skipped, with a note in the report, when its projected end passes ``--budget-s``.
"""
from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time

import torch
from e2e_v41_cut import (  # noqa: F401
    Batch,
    build,
    cut_config,
    fill_synthetic,
    random_stored,
    random_tensors,
    sync,
    tokens,
)
from e2e_v41_decode import decode_rows
from e2e_v41_parity import parity
from e2e_v41_report import write
from e2e_v41_timing import (
    H200_BYTES_PER_S,
    H200_FP8_FLOPS,
    op_shares,
    prefill_floor_s,
    registry_shares,
)
from v41_prefill_profile import ChunkFit, cache_bytes, group_regions, region_shares

print = functools.partial(print, flush=True)  # progress unbuffered


def warm_classes(model, ctx: int, chunk: int, device, warmed: set) -> None:
    """Run one chunk at the first start of every shape class a prefill to ``ctx`` meets and ``warmed``
    does not hold yet, so JIT compilation and tuning stay out of the timings. Kernel tuners key on the
    power of two above the number of cached entries a chunk scores, so a chunk at start s stands for
    every chunk whose entries round to the same powers of two (ratio 1 and 2). It runs at start s on
    an empty state (its length set, nothing prefilled): the caches read are zero bytes, the shapes
    those of the timed run. The indexer's stream tuner merges every entry count above 65536 into one
    class (``indexer_mx.STREAM_TUNE_ENTRIES``), so classes stop there too."""
    from redknot.kernels.triton.indexer_mx import STREAM_TUNE_ENTRIES

    cap = STREAM_TUNE_ENTRIES.bit_length()   # 17: every count above 65536
    starts = []
    for s in range(0, ctx, chunk):
        key = tuple(min(cap, (max(1, (s + chunk) // r) - 1).bit_length()) for r in (1, 2))   # log2 of the pow2s
        if key not in warmed:
            warmed.add(key)
            starts.append(s)
    if not starts:
        return
    w = Batch(model, 1, starts[-1] + chunk + 8)
    ids = tokens(chunk, model.cfg.vocab_size, 1)
    for s in starts:
        t = time.perf_counter()
        w.lens[0] = s
        w.step([ids])
        sync(device)
        print(f"warm-up chunk at {s}: {time.perf_counter() - t:.1f} s")
    del w


# The most rows --step-rows takes: measured to build and run at 32 rows on an H100 (2026-12-07); at 128 one of the
# fused launches asked for more shared memory than an SM has and the step fell back to the PyTorch row math.
STEP_ROWS_MAX = 32


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="DeepSeek-V4.1 real-dimension cut (kernel path)")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/e2e_v41"),
                    help="directory for e2e_v41.json / e2e_v41.md (default $OUT, else outputs/e2e_v41)")
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU (kernel ops: references)")
    ap.add_argument("--prefill", default="8192,32768,131072", help="contexts to prefill, ascending ('' skips)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--decode-batch", default="1,32,128", help="decode batches ('' skips)")
    ap.add_argument("--decode-context", default="8192,131072", help="decode contexts (each <= a prefilled one)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=2048)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--backend", default=None,
                    help="kernel backend of the V4.1 ops (default: triton on a GPU, reference with --smoke; "
                         "--smoke --backend triton runs the Triton kernels in Triton's CPU interpreter)")
    ap.add_argument("--engram-vocab", type=int, default=100000)
    ap.add_argument("--decode-synthetic", action="store_true",
                    help="decode contexts that no --prefill reaches run on a synthetic state (valid random cache "
                         "bytes, see fill_synthetic): CUDA-graph rows only, no prefill needed")
    ap.add_argument("--decode-graphs", action="store_true",
                    help="also time decode through the tensor-only step captured in a CUDA graph (its "
                         "attention/indexer are PyTorch math), with its error against the eager step")
    ap.add_argument("--profile-steps", type=int, default=20,
                    help="with --decode-graphs: eager steps and graph replays under torch.profiler per decode row "
                         "(step_profile_v41: device time by kernel and region, busy time vs the replay's wall)")
    ap.add_argument("--skip-replay-profile", action="store_true",
                    help="profile the eager steps only, not the graph replays (a profiler that fails on graphs)")
    ap.add_argument("--step-rows", type=int, default=None,
                    help="rows up to which a step runs the fused projection and MoE launches (step_proj_v41 / "
                         "step_moe_v41 MAX_ROWS, default theirs: 16; at most 32); above it each linear is its own "
                         "weight stream. Changes a row's bits at the row counts it moves, so compare times, not outputs")
    ap.add_argument("--side-stream-tokens", type=int, default=0,
                    help="graph decode: also capture each step with the side stream on for up to this many rows "
                         "(hardware.side_stream_max_tokens) and time it against the one-stream graph (0: not)")
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="skip a prefill/decode case whose projected end passes this many seconds")
    ap.add_argument("--log-level", default=None, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                    help="log level of the redknot loggers (default: as configured, Python's WARNING); INFO names "
                         "every kernel class a tuner times or takes from the store or seed, with its timings (what a "
                         "cold store's warm-up spends its time on)")
    a = ap.parse_args(argv)
    if a.log_level is not None:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        logging.getLogger("redknot").setLevel(a.log_level)
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.cost import global_kv_bytes_per_token
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    t_start = time.perf_counter()
    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        torch.set_num_threads(1)   # toy shapes: a second thread only contends with whatever else runs
        smoke_prefill = a.prefill if a.prefill != ap.get_default("prefill") else "40"   # toy contexts may be given
        a.prefill, a.chunk, a.parity_tokens, a.decode_steps, a.engram_vocab = smoke_prefill, 32, 40, 1, 100
        a.decode_batch, a.decode_context, a.profile_steps = "1,3", "40", min(a.profile_steps, 2)
    cfg = cut_config(a.smoke, a.engram_vocab)
    backend = a.backend or ("reference" if a.smoke else "triton")
    if a.smoke and backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.side_stream_tokens < 0:
        ap.error(f"--side-stream-tokens must be >= 0 (0: one stream), got {a.side_stream_tokens}")
    if a.step_rows is not None:   # after TRITON_INTERPRET: the import compiles nothing before it
        if not 1 <= a.step_rows <= STEP_ROWS_MAX:
            ap.error(f"--step-rows must be 1..{STEP_ROWS_MAX}, got {a.step_rows} (at 128 rows a fused launch needs "
                     "256 KB of shared memory on sm90, over the 227 KB an SM has)")
        from redknot.kernels.triton import step_moe_v41, step_proj_v41
        restore_rows = (step_proj_v41.MAX_ROWS, step_moe_v41.MAX_ROWS)   # put back at the end (an importing caller)
        step_proj_v41.MAX_ROWS = step_moe_v41.MAX_ROWS = a.step_rows
        print(f"step launches fused up to {a.step_rows} rows")
    kernels = KernelSet(default=backend)
    ops = V41Ops(kernels, route_all=backend == "reference")
    print(f"e2e_v41: device={device} ops={ops.choice}")
    tensors = random_tensors(cfg, device)
    wbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"weights {wbytes / 2**30:.2f} GiB ({time.perf_counter() - t_start:.1f} s)")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": a.smoke,
              "ops": ops.choice, "weights_gib": wbytes / 2**30, "step_rows": a.step_rows,
              "side_stream_tokens": a.side_stream_tokens,
              "cut": "L0 ratio-2 kv/index source + Engram, L1 ratio-2 consumer, L2 ratio-1 candidate source, "
                     "L3 ratio-1 consumer, L4 candidate index source; 384 experts top-6" if not a.smoke else "toy",
              "ceilings": {"fp8_flops": H200_FP8_FLOPS, "bytes_per_s": H200_BYTES_PER_S},
              "parity": [], "prefill": [], "decode": [], "profile": {}, "op_shares": {},
              "decode_mode": ("eager, and the tensor-only step in CUDA graphs (--decode-graphs)" if a.decode_graphs
                              else "eager (--decode-graphs adds the tensor-only step in CUDA graphs)"),
              "expected_global_cache_bytes_per_token": global_kv_bytes_per_token(cfg)}

    def over_budget(projected: float) -> bool:
        return time.perf_counter() - t_start + projected > a.budget_s

    if not a.skip_parity:
        for numerics in ("reference", "bf16"):
            p = parity(cfg, tensors, kernels, device, a.parity_tokens, min(a.chunk, 1024 if not a.smoke else 32),
                       numerics, backend == "reference")
            worst = max((v for k, v in p["errors"].items() if k.endswith("rel")), default=0.0)
            print(f"parity {numerics}: {'ok' if p['ok'] else 'FAILED'}, worst block rel err {worst:.3g}, "
                  f"state bytes differing "
                  f"{p['state_bytes_differing']}/{p['state_bytes_compared']}; " + "; ".join(
                      f"{kind} rows of {v['rows']}: {v['equal']} equal, {v['equal_up_to_ties']} equal up to ties at "
                      f"the cut, {v['different']} different (worst shortfall {v['worst_shortfall_rel']:.2g})"
                      for kind, v in p["selections"].items()) + f" ({p['seconds']:.1f} s)")
            report["parity"].append(p)
    model = build(cfg, tensors, "reference", ops, device)   # timed: reference numerics, routed ops
    ctxs = [int(c) for c in a.prefill.split(",") if c]
    warmed: set = set()   # shape classes compiled and tuned (see warm_classes)
    dctx = {int(c) for c in a.decode_context.split(",") if c}
    batches = [int(x) for x in a.decode_batch.split(",") if x]
    last = None
    profiles = [1 if a.smoke else 100]   # the CPU profiler is slow to start: one profile in a smoke run
    fit = ChunkFit()   # per-chunk seconds = a + b * start, over the chunks of the last timed prefill
    decode = functools.partial(decode_rows, a, report, cfg=cfg, ops=ops, device=device, batches=batches,
                               profiles=profiles, over_budget=over_budget)

    for ctx in ctxs:
        proj = None
        if last is not None:
            proj = fit.prefill(ctx, a.chunk)
            # The untimed warm-up chunks of its new shape classes (one per power of two of the entries,
            # each tuned a few times) stay below half of it.
            if over_budget(1.5 * proj + 20):
                print(f"prefill {ctx}: skipped (projected {proj:.0f} s from the chunk fit passes --budget-s)")
                report["prefill"].append({"context": ctx, "skipped": f"projected {proj:.0f} s"})
                continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t_w = time.perf_counter()
        warm_classes(model, ctx, a.chunk, device, warmed)   # JIT + tuning of its chunk shapes, untimed
        warm_s = time.perf_counter() - t_w
        peak_warm = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()   # the prefill's own peak (tuners allocate while they time)
        print(f"warm-up for {ctx} done ({warm_s:.1f} s; at {time.perf_counter() - t_start:.1f} s)")
        nseq = max(batches) if ctx in dctx and batches else 1
        b = Batch(model, nseq, ctx + 2 * a.chunk + (a.decode_steps + 4) * (len(batches) + 1) + 64)
        ids = tokens(ctx, cfg.vocab_size, seed=ctx)
        sync(device)
        t = time.perf_counter()
        points = []   # (chunk start, seconds): synchronised per chunk, so the growth with context shows
        for s in range(0, ctx, a.chunk):
            t_c = time.perf_counter()
            b.step([ids[s:min(ctx, s + a.chunk)]], seqs=[0])
            sync(device)
            points.append((s, time.perf_counter() - t_c))
        dt = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        floor = prefill_floor_s(cfg, ctx)
        full = [p for p in points if p[0] + a.chunk <= ctx]
        fit = ChunkFit.fit(full or points)
        cb = cache_bytes(b.state, b.layout, ctx, cfg)
        row = {"context": ctx, "chunk": a.chunk, "seconds": dt, "tokens_per_s": ctx / dt, "peak_gib": peak,
               "peak_above_weights_gib": peak - wbytes / 2**30 if device.type == "cuda" else 0.0,
               "warm_up_s": warm_s, "warm_up_peak_gib": peak_warm,
               "state_slots": nseq, "floor_s": floor, "fraction_of_floor": floor / dt,
               "global_cache_bytes_per_token": b.global_cache_bytes() / ctx, "cache_bytes": cb,
               "window_ring_bytes_per_sequence": sum(w[0].numel() for w in b.state.windows),
               "chunk_seconds": [[p, round(x, 5)] for p, x in points], "chunk_fit": fit.as_dict(),
               "projected_s": proj}   # from the previous context's chunk fit (None for the first)
        print(f"prefill {ctx}: {dt:.3f} s ({ctx / dt:.0f} tok/s, {100 * floor / dt:.1f} % of the floor), peak "
              f"{peak:.1f} GiB, global cache {row['global_cache_bytes_per_token']:.1f} B/token (cut expected "
              f"{cb['expected_cut_bytes_per_token']:.1f}; V4.1-Flash "
              f"{'n/a' if cb['v41_flash_bytes_per_token'] is None else format(cb['v41_flash_bytes_per_token'], '.1f')} "
              f"of {cb['v41_flash_expected']:.0f}); chunk s = {fit.a:.4f} + {fit.b * 1e6:.4f}e-6 * start "
              f"(first {points[0][1]:.3f} s, last {points[-1][1]:.3f} s)"
              + ("" if proj is None else f"; projected from the previous fit {proj:.2f} s"))
        report["prefill"].append(row)
        last = (ctx, dt)
        if ctx in dctx and batches:
            b.clone_first()
            decode(b, ctx, eager=True)
        if not a.skip_profile and not over_budget(3 * dt * a.chunk / ctx + 10):
            # One chunk at one position, run three times (the lengths rolled back after each): once to
            # compile and tune its shapes, then under the registry-op timer, then under the profiler.
            chunk_ids = tokens(a.chunk, cfg.vocab_size, 4)

            def chunk(b=b, chunk_ids=chunk_ids):   # bound now: called within this iteration
                b.step([chunk_ids], seqs=[0])
                b.lens[0] -= a.chunk

            chunk()
            sync(device)
            name = f"prefill chunk {a.chunk} after {ctx}"
            report["op_shares"][name] = registry_shares(ops, chunk, device)
            regions = region_shares(chunk, device, ops)
            report.setdefault("regions", {})[name] = regions
            report.setdefault("region_groups", {})[name] = group_regions(regions)
            from v41_prefill_profile import rows_ab

            ab = report.setdefault("prefill_rows_ab", {})[name] = rows_ab(chunk, device)
            print(f"{name}: {ab['unfused_ms']:.1f} ms without the prefill row fusions, {ab['fused_ms']:.1f} ms "
                  f"with them; saving of each: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ab["saving_ms"].items()))
            if profiles[0] and not over_budget(dt * a.chunk / ctx + 10):
                profiles[0] -= 1
                report["profile"][name] = op_shares(chunk, device)
        del b
    for ctx in sorted(dctx - set(ctxs)) if a.decode_synthetic and batches else []:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t_s = time.perf_counter()
        b = Batch(model, max(batches), ctx + (a.decode_steps + 4) * (len(batches) + 1) + 64)
        fill_synthetic(b, ctx, seed=ctx)
        sync(device)
        print(f"synthetic state at {ctx} for {max(batches)} sequences ({time.perf_counter() - t_s:.1f} s)")
        decode(b, ctx, eager=False)
        del b
    report["seconds"] = time.perf_counter() - t_start
    write(report, a.out)
    if a.step_rows is not None:
        step_proj_v41.MAX_ROWS, step_moe_v41.MAX_ROWS = restore_rows
    return report


if __name__ == "__main__":
    main()
    sys.exit(0)
