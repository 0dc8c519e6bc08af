#!/usr/bin/env python3
"""Multi-GPU measurements of the parallel layer (numbers only; nothing asserted).

On a 3-layer real-dimension cut of V4-Flash (SWA, CSA, HCA like real layers 1-3, D=4096, 64 heads
of 512, indexer 64x128 top-512, two hash layers; ``--experts`` routed experts, 6 active; synthetic
bf16 weights written once under ``--out/cache``):

1. **suite** — the long-context suite (``--suite 64k``) over every GPU with attention DP x MoE EP, in
   three layouts: dp=N/ep=1 (every GPU holds every expert), dp=N/ep=N, dp=N/ep=N with EPLB
   (N redundant experts, re-placed every ``--rebalance`` steps). With ``--data DIR`` (LongBench
   files) each layout is a real ``torchrun -m redknot suite=64k`` run and the table comes from its
   results.json and MLflow run; without data, ``--requests`` random-token prompts of the suite's
   length go through the engine API with the suite's admission (1 active request per DP rank).
   Printed: cases, wall time, TTFT p50/p90, prefill and decode tokens/s, per-rank EP load and the
   EPLB imbalance before/after its last re-placement.
2. **cp** — one ``--cp-context`` (128K) prompt prefilled in a single step: on one GPU (this
   process), then with context parallel over N GPUs (torchrun, zigzag chunks); TTFT of each and the
   speed-up.

    python3 benchmarks/parallel.py --gpus 8 --out "$OUT"                         # H200 x8 (not run yet)
    python3 benchmarks/parallel.py --gpus 8 --out "$OUT" --data /data/longbench  # the real 64k suite
    python3 benchmarks/parallel.py --smoke                                       # CPU dry run (gloo, toy widths)
    python3 benchmarks/parallel.py --smoke --cli --suite smoke --skip cp         # CPU dry run of the CLI path

The script starts torchrun itself (``--worker`` marks the ranks it starts). Positional arguments
are Hydra overrides of the run config (e.g. ``hardware.kernels.default=reference``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = str(ROOT / "conf")
# Real layers 1-3 of V4-Flash at real width (every other key keeps its V4-Flash value).
CUT = dict(num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], num_hash_layers=2)
# --smoke: the same layer pattern at toy width.
CUT_SMOKE = dict(CUT, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32, q_lora_rank=64,
                 o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=16,
                 moe_intermediate_size=64, compress_rate_hca=16, compress_ratios=[0, 4, 16, 0])
SUITE_CONTEXT = {"64k": 65536, "128k": 131072, "256k": 262144}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=8, help="processes (one GPU each)")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/bench-parallel"))
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: 2 gloo processes, toy widths, short prompts")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: suite,cp")
    ap.add_argument("--experts", type=int, default=64, help="routed experts of the cut (V4-Flash has 256)")
    ap.add_argument("--suite", default="64k")
    ap.add_argument("--data", default=None, help="LongBench data directory: run the real suite through the CLI")
    ap.add_argument("--cli", action="store_true", help="run the suite through the CLI without --data "
                                                        "(suites whose data is packaged, e.g. --suite smoke)")
    ap.add_argument("--requests", type=int, default=16, help="random-prompt requests (without --data)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rebalance", type=int, default=50, help="EPLB re-placement interval (steps)")
    ap.add_argument("--cp-context", type=int, default=131072)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank started by this script
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------- config
def base_overrides(args) -> list:
    hw = "cpu" if args.smoke else "sm90-port"
    return [f"hardware={hw}", "model=tiny", "model.name=v4-cut3", f"output.root={args.out}"] + list(args.overrides)


def cut_architecture(args) -> dict:
    """config.json keys of the cut: every key of model=tiny's architecture spelled out (V4-Flash values
    unless the cut sets them), so the in-process runs and the command-line runs share one checkpoint."""
    from redknot.models.deepseek_v4.config import flash_config_dict

    arch = dict(CUT_SMOKE if args.smoke else CUT)
    arch["n_routed_experts"] = 8 if args.smoke else args.experts
    flash = flash_config_dict()
    for key in composed_config(args).model.synthetic.architecture:
        arch.setdefault(key, flash[key])
    return arch


def composed_config(args, extra=()):
    from hydra import compose, initialize_config_dir

    from redknot.config.resolve import to_typed

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_typed(compose(config_name="config", overrides=base_overrides(args) + list(extra)))


def typed_config(args, extra=()):
    """The run config with the cut as a synthetic model (every unspecified key at its V4-Flash value)."""
    from redknot.config.schema import SyntheticModelConfig

    cfg = composed_config(args, extra)
    cfg.model = dataclasses.replace(cfg.model, sliding_window=128, max_position=1048576,
                                    synthetic=SyntheticModelConfig(seed=0, architecture=cut_architecture(args)))
    cfg.engine.cache_dir = str(Path(args.out) / "cache")
    cfg.features.dspark.method = "none"
    return cfg


def cli_model_overrides(args) -> list:
    """The same cut as command-line overrides of model=tiny."""
    out = ["model.sliding_window=128", "model.max_position=1048576", f"engine.cache_dir={Path(args.out) / 'cache'}"]
    for key, value in sorted(cut_architecture(args).items()):
        out.append(f"++model.synthetic.architecture.{key}={json.dumps(value).replace(' ', '')}")
    return out


def layouts(n: int, rebalance: int) -> list:
    return [("dp_only", [f"features.parallel.dp={n}"]),
            ("dp_ep", [f"features.parallel.dp={n}", f"features.parallel.ep={n}"]),
            ("dp_ep_eplb", [f"features.parallel.dp={n}", f"features.parallel.ep={n}",
                            "features.parallel.eplb.enabled=true", f"features.parallel.eplb.num_redundant_experts={n}",
                            f"features.parallel.eplb.rebalance_interval={rebalance}"])]


def torchrun(n: int, argv: list, timeout: int = 3600) -> int:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *argv]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, timeout=timeout).returncode


# ---------------------------------------------------------------------------------------- workloads
def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def drive(llm, prompts: list, max_tokens: int, admission: int, dp: int) -> dict:
    """Rank 0: at most ``admission`` active requests per DP rank (the harness's rule)."""
    from redknot.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pending, active, outs = list(enumerate(prompts)), 0, []
    t0 = time.perf_counter()
    while pending or llm.has_unfinished_requests():
        while pending and active < admission * dp:
            i, ids = pending.pop(0)
            llm.add_request(f"p{i}", ids, params)
            active += 1
        for out in llm.step():
            if out.finished:
                outs.append(out)
                active -= 1
    wall = time.perf_counter() - t0
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    decode = [(len(o.token_ids) - 1) / (o.metrics.finish_time - o.metrics.first_token_time) for o in outs
              if len(o.token_ids) > 1 and o.metrics.finish_time > o.metrics.first_token_time]
    prompt_tokens = sum(len(p) for p in prompts)
    return {"cases": len(outs), "wall_s": wall, "ttft_p50_s": ttft[len(ttft) // 2],
            "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "prefill_tok_s": prompt_tokens / sum(ttft), "decode_tok_s_per_req": statistics.mean(decode or [0.0]),
            "output_tok_s": sum(len(o.token_ids) for o in outs) / wall}


def worker(args) -> int:
    """One rank of a world started by this script: build the engine, rank 0 drives, the rest serve."""
    import torch

    from redknot.engine import build_engine
    from redknot.parallel import serve

    spec = json.loads(Path(args.worker).read_text())
    cfg = typed_config(args, spec["overrides"])
    sched = cfg.engine.scheduler
    sched.long_prefill_chunk = sched.max_num_batched_tokens = spec["step_tokens"]
    llm = build_engine(cfg.model, cfg.hardware, cfg.features, cfg.engine)
    runtime = getattr(llm, "parallel", None)  # None: the one-GPU baseline (started without torchrun)
    if runtime is not None and runtime.layout.rank != 0:
        serve(llm)
        llm.close()
        return 0
    prompts = random_prompts(spec["requests"], spec["context"], llm.runner.vocab_size)
    if spec.get("warmup"):
        drive(llm, random_prompts(1, min(2048, spec["context"]), llm.runner.vocab_size, seed=1), 2, 1, 1)
    result = drive(llm, prompts, spec["max_tokens"], 1, cfg.features.parallel.dp)
    result["rank_metrics"] = runtime.rank_metrics() if runtime is not None else {}
    result["peak_memory_gib"] = llm.stats().peak_memory_bytes / 2**30 if torch.cuda.is_available() else 0.0
    Path(spec["result"]).write_text(json.dumps(result, indent=2))
    llm.close()
    return 0


# ---------------------------------------------------------------------------------------- parts
def suite_part(args, n: int) -> list:
    rows = []
    context = 1024 if args.smoke else SUITE_CONTEXT[args.suite]
    for name, extra in layouts(n, 4 if args.smoke else args.rebalance):
        out = Path(args.out) / f"suite-{name}"
        out.mkdir(parents=True, exist_ok=True)
        if args.data or args.cli:
            data = [f"suite.data.dir={args.data}"] if args.data else []
            small = ["suite.samples_per_dataset=1", "suite.warmup_requests=0"] if args.smoke else []
            argv = ["-m", "redknot", f"suite={args.suite}", *data, *small, *base_overrides(args),
                    *cli_model_overrides(args), *extra, f"output.root={out}", "output.allow_outside_cwd=true"]
            code = torchrun(n, argv)
            rows.append(dict(layout=name, code=code, **read_suite_run(out)))
            continue
        spec = dict(overrides=extra, requests=4 if args.smoke else args.requests, context=context,
                    max_tokens=4 if args.smoke else args.max_tokens, step_tokens=max(2048, min(context, 16384)),
                    warmup=True, result=str(out / "result.json"))
        (out / "spec.json").write_text(json.dumps(spec))
        code = torchrun(n, [__file__, "--worker", str(out / "spec.json"), *passthrough(args)])
        result = json.loads((out / "result.json").read_text()) if code == 0 else {}
        rows.append(dict(layout=name, code=code, **result))
    return rows


def read_suite_run(out: Path) -> dict:
    """The suite run's results.json and its MLflow run's per-rank metrics, in this script's fields."""
    found = sorted(out.glob("*/*/results.json"))
    if not found:
        return {}
    res = json.loads(found[-1].read_text())
    ttft, e2e = res.get("ttft_s") or {}, res.get("e2e_s") or {}
    row = {"cases": res.get("completed", 0), "ttft_p50_s": ttft.get("p50") or 0.0, "ttft_p90_s": ttft.get("p90") or 0.0,
           "prefill_tok_s": res.get("prefill_tok_s") or 0.0, "decode_tok_s_per_req": res.get("decode_tok_s") or 0.0,
           "e2e_p50_s": e2e.get("p50"), "score": res.get("overall_score")}
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    ranks: dict = {}
    for key, value in (runs[0].data.metrics.items() if runs else ()):
        if key.startswith("rank"):
            rank, name = key[4:].split(".", 1)
            ranks.setdefault(rank, {})[name] = value
    row["rank_metrics"] = ranks
    return row


def cp_part(args, n: int) -> dict:
    """One prompt prefilled in one step: a one-GPU process, then cp=n under torchrun."""
    context = 2048 if args.smoke else args.cp_context
    runs = {}
    for name, size in (("one_gpu", 1), ("cp", n)):
        out = Path(args.out) / f"cp-{name}"
        out.mkdir(parents=True, exist_ok=True)
        spec = dict(overrides=[f"features.parallel.cp={size}", "features.swa_replay.mode=off"], requests=1, context=context, max_tokens=1,
                    step_tokens=context, warmup=True, result=str(out / "result.json"))
        (out / "spec.json").write_text(json.dumps(spec))
        argv = [__file__, "--worker", str(out / "spec.json"), *passthrough(args)]
        code = torchrun(n, argv) if size > 1 else subprocess.run([sys.executable, *argv], timeout=3600).returncode
        runs[name] = json.loads((out / "result.json").read_text()) if code == 0 else {"code": code}
    one, many = runs["one_gpu"].get("ttft_p50_s"), runs["cp"].get("ttft_p50_s")
    return {"context": context, "gpus": n, "ttft_1gpu_s": one, "ttft_cp_s": many,
            "speedup": one / many if one and many else None,
            "peak_memory_gib": {k: r.get("peak_memory_gib") for k, r in runs.items()}}


def passthrough(args) -> list:
    flags = ["--out", args.out, "--experts", str(args.experts)] + (["--smoke"] if args.smoke else [])
    return flags + list(args.overrides)


def print_suite(rows: list) -> None:
    print(f"\n{'layout':12} {'cases':>5} {'wall s':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'prefill tok/s':>13} "
          f"{'decode tok/s/req':>16} {'EPLB before->after':>19}")
    for r in rows:
        ranks = r.get("rank_metrics") or {}
        eplb = [(m.get("eplb.imbalance_before"), m.get("eplb.imbalance_after")) for m in ranks.values()]
        eplb_s = f"{eplb[0][0]:.3f}->{eplb[0][1]:.3f}" if eplb and eplb[0][0] is not None else "-"
        print(f"{r['layout']:12} {r.get('cases', 0):5} {r.get('wall_s') or 0.0:8.2f} "
              f"{r.get('ttft_p50_s', 0):9.3f} {r.get('ttft_p90_s', 0):9.3f} {r.get('prefill_tok_s', 0):13.0f} "
              f"{r.get('decode_tok_s_per_req', 0):16.1f} {eplb_s:>19}  exit {r['code']}")
        for rank, m in sorted(ranks.items(), key=lambda kv: int(kv[0])):
            print(f"    rank {rank}: routed pairs {m.get('ep.routed_pairs', 0):.0f}, "
                  f"prefill {m['prefill_tokens']:.0f}, decode {m['decode_tokens']:.0f} tokens, "
                  f"execute {m['execute_time_s']:.2f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    n = 2 if args.smoke else args.gpus
    if args.smoke:
        args.out = args.out if args.out != "outputs/bench-parallel" else "outputs/bench-parallel-smoke"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from redknot.models.deepseek_v4.build import checkpoint_path

    cfg = typed_config(args)
    t0 = time.perf_counter()
    print(f"cut checkpoint: {checkpoint_path(cfg.model, cfg.engine.cache_dir)} "
          f"({time.perf_counter() - t0:.0f} s; written once, before the ranks start)", flush=True)
    skip = {s for s in args.skip.split(",") if s}
    report = {"gpus": n, "experts": cut_architecture(args)["n_routed_experts"], "smoke": args.smoke}
    if "suite" not in skip:
        report["suite"] = suite_part(args, n)
        print_suite(report["suite"])
    if "cp" not in skip:
        report["cp"] = cp = cp_part(args, n)
        nan = float("nan")
        print(f"\nCP prefill of {cp['context']} tokens: 1 GPU {cp['ttft_1gpu_s'] or nan:.3f} s, cp={n} "
              f"{cp['ttft_cp_s'] or nan:.3f} s, speed-up {cp['speedup'] or nan:.2f}x")
    (Path(args.out) / "parallel.json").write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
