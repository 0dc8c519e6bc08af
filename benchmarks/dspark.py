#!/usr/bin/env python3
"""DSpark speculative decoding and compact SWA replay: what they cost and save (numbers only).

For the tiny model and a 3-layer real-dimension cut (D=4096, 64 heads of 512, q_lora 1024,
indexer 64x128 top-512, window 128, ratios 4/128 like real layers 1-3, real vocabulary; 8 routed
experts instead of 256 so the synthetic checkpoint stays small, 6 active per token as in Flash):

* decode tokens/s of a batch: plain decoding (the default engine, async scheduling) vs DSpark
  (steps run synchronously) with confidence-scheduled (varlen) and fixed-length verification;
* the mechanics per step: forward + sampling of a plain step, of a verify step, and the MTP
  work after it (catch-up + chained drafts);
* the same with the MTP layer shaped to agree with the target (the tests' construction), so
  that drafts are accepted and the speed-up mechanics show;
* prefill time of one long prompt with ``features.swa_replay.mode`` compact vs off.

With random weights acceptance is meaningless (the MTP layer was never trained to predict the
target); it is printed and labelled so.

    python benchmarks/dspark.py hardware=sm90-port hardware.kernels.default=reference  # H200, < 4 min
    python benchmarks/dspark.py --smoke                                                # CPU check
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "spec"))  # make_mtp_agree: the tests' agreeing MTP

from redknot.config.resolve import to_typed  # noqa: E402
from redknot.config.schema import SwaReplayMode  # noqa: E402
from redknot.engine import LLM, SamplingParams  # noqa: E402
from redknot.speculative.replay import CompactReplay  # noqa: E402
from spec_testutil import make_mtp_agree  # noqa: E402

CONF_DIR = str(ROOT / "conf")
# Real layers 1-3 of V4-Flash (SWA, CSA, HCA; two hash-routed) at real width; 8 routed experts.
ARCH_CUT = dict(num_hidden_layers=3, compress_ratios=[0, 4, 128, 0], num_hash_layers=2, n_routed_experts=8)
# --smoke: the same layer pattern at toy width, so the script's every path runs on a CPU in seconds.
ARCH_CUT_SMOKE = dict(ARCH_CUT, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32,
                      q_lora_rank=64, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32,
                      index_topk=16, moe_intermediate_size=64, compress_rate_hca=16, compress_ratios=[0, 4, 16, 0])


@dataclasses.dataclass
class Workload:
    batch: int
    prompt_len: int
    max_tokens: int
    prefill_len: int


def sync(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def spec_delta(llm: LLM, before):
    after = llm.stats().spec
    if after is None:
        return None
    d = copy.deepcopy(after)
    for f in dataclasses.fields(after):
        a, b = getattr(after, f.name), getattr(before, f.name) if before is not None else None
        if b is None or f.name == "max_draft":
            continue
        setattr(d, f.name, [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b)
    return d


def decode_run(llm: LLM, w: Workload, seed: int) -> dict:
    """Decode tokens/s of ``w.batch`` greedy requests, timed after every request has its first token."""
    rng = random.Random(seed)
    vocab = llm.runner.vocab_size
    before = copy.deepcopy(llm.stats().spec)
    for i in range(w.batch):
        llm.add_request(f"d{seed}-{i}", [rng.randrange(3, vocab) for _ in range(w.prompt_len)],
                        SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
    outs, first = {}, set()
    t_decode, steps = None, 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.token_ids:
                first.add(o.req_id)
            if o.finished:
                outs[o.req_id] = o
        if t_decode is None and len(first) == w.batch:
            sync(llm)
            t_decode = time.perf_counter()
        elif t_decode is not None:
            steps += 1
    sync(llm)
    wall = time.perf_counter() - (t_decode or time.perf_counter())
    tokens = sum(len(o.token_ids) - 1 for o in outs.values())
    row = {"decode_tok_s": tokens / wall if wall > 0 else 0.0, "decode_steps": steps,
           "ms_per_step": 1e3 * wall / max(steps, 1)}
    spec = spec_delta(llm, before)
    if spec is not None:
        m = spec.as_metrics(prefix="")
        row.update({k: m[k] for k in ("mean_accept_len", "acceptance_rate", "plain_step_ms", "verify_step_ms",
                                      "draft_ms_per_step")})
        row["acceptance_by_position"] = [round(x, 3) for x in spec.acceptance_by_position()]
        row["drafts_verified_per_step"] = spec.num_proposed / max(spec.num_decode_request_steps, 1)
    return row


def prefill_time(llm: LLM, length: int, seed: int) -> float:
    """Seconds from adding one ``length``-token prompt to its first token."""
    rng = random.Random(seed)
    sync(llm)
    t0 = time.perf_counter()
    llm.add_request(f"p{seed}", [rng.randrange(3, llm.runner.vocab_size) for _ in range(length)],
                    SamplingParams(max_tokens=1, ignore_eos=True))
    while llm.has_unfinished_requests():
        llm.step()
    sync(llm)
    return time.perf_counter() - t0


def set_compact(llm: LLM, keep_tokens):
    """Switch compact replay of a built engine (the bound is only read per step)."""
    replay = CompactReplay(keep_tokens=keep_tokens) if keep_tokens else None
    llm.runner.replay = replay
    llm.runner.speculator.drafter.replay = replay


def cut_checkpoint(arch: dict, device: torch.device, cache_dir: str) -> str:
    """The cut's checkpoint in the native layout, with seeded weights made on ``device`` (a GPU makes
    2.5B values in a second; the CPU path of synthetic models would take minutes), written once."""
    from redknot.models.deepseek_v4.model import DeepseekV4
    from redknot.models.deepseek_v4.synthetic import checkpoint_key, randomize_, synthetic_config
    from redknot.models.deepseek_v4.weights import INDEX_FILE
    from redknot.models.deepseek_v4.writer import native_tensors, write_checkpoint
    cfg = synthetic_config(arch, quantize_fp8=False)
    path = os.path.join(cache_dir, "models", f"bench-cut3-{device.type}-{checkpoint_key(cfg, 0)}")
    if not os.path.isfile(os.path.join(path, INDEX_FILE)):
        t0 = time.perf_counter()
        model = DeepseekV4(cfg, torch.float32, device=device)
        randomize_(model, seed=0)
        tmp = path + f".tmp-{os.getpid()}"
        write_checkpoint(tmp, cfg, native_tensors(cfg, model.state_dict(), float_dtype=torch.bfloat16))
        del model
        os.replace(tmp, path)
        print(f"[cut3] wrote {path} in {time.perf_counter() - t0:.1f}s", flush=True)
    return path


def engine(cfg, model, dspark: bool) -> LLM:
    features = copy.deepcopy(cfg.features)
    features.dspark.enabled = dspark
    features.swa_replay.mode = SwaReplayMode.off
    return LLM(model, cfg.hardware, features, cfg.engine)


def bench_model(cfg, model, w: Workload, label: str, repeat: int) -> list:
    t0 = time.perf_counter()
    plain, ds = engine(cfg, model, False), engine(cfg, model, True)
    print(f"[{label}] engines built in {time.perf_counter() - t0:.1f}s (kernels "
          f"{cfg.hardware.kernels.default}, device {ds.device}, {ds.stats().cuda_graphs})", flush=True)
    small = dataclasses.replace(w, batch=1, max_tokens=4, prompt_len=16)
    for llm in (plain, ds):  # warm-up: allocator, kernels, caches
        decode_run(llm, small, seed=999)
    rows = []

    def measure(name, llm, note=""):
        best = None
        for rep in range(repeat):
            r = decode_run(llm, w, seed=rep)
            best = r if best is None or r["decode_tok_s"] > best["decode_tok_s"] else best
        best.update(model=label, variant=name, note=note)
        print(json.dumps(best), flush=True)
        rows.append(best)
    measure("plain", plain)
    ds.runner.speculator.drafter.varlen = True
    measure("dspark varlen", ds, "random weights: acceptance meaningless")
    ds.runner.speculator.drafter.varlen = False
    measure("dspark fixed", ds, "random weights: acceptance meaningless")
    ds.runner.speculator.drafter.varlen = True
    for llm in (plain, ds):
        make_mtp_agree(llm.runner.model)
    measure("plain (agreeing MTP)", plain)
    measure("dspark varlen (agreeing MTP)", ds, "drafts made to agree: mechanics, not model quality")
    keep = cfg.features.swa_replay.keep_tokens
    times = {}
    for rep in range(repeat):
        for mode in ("off", "compact"):
            set_compact(ds, keep if mode == "compact" else None)
            t = prefill_time(ds, w.prefill_len, seed=100 + rep)
            times[mode] = min(times.get(mode, t), t)
    set_compact(ds, None)
    rows.append({"model": label, "variant": "prefill", "prefill_len": w.prefill_len, "keep_tokens": keep,
                 "prefill_off_s": times["off"], "prefill_compact_s": times["compact"]})
    print(json.dumps(rows[-1]), flush=True)
    plain.close()
    ds.close()
    return rows


def cell(row: dict, key: str, width: int, prec: int = 2) -> str:
    return f"{row[key]:{width}.{prec}f}" if key in row else "-".rjust(width)


def print_table(rows: list) -> None:
    print(f"\n{'model':10} {'variant':30} {'decode tok/s':>12} {'ms/step':>8} {'plain ms':>9} {'verify ms':>9} "
          f"{'draft ms':>9} {'drafts/step':>11} {'accept len':>10} {'accept rate':>11}")
    for r in rows:
        if r["variant"] == "prefill":
            continue
        print(f"{r['model']:10} {r['variant']:30} {r['decode_tok_s']:12.1f} {r['ms_per_step']:8.2f} "
              f"{cell(r, 'plain_step_ms', 9)} {cell(r, 'verify_step_ms', 9)} {cell(r, 'draft_ms_per_step', 9)} "
              f"{cell(r, 'drafts_verified_per_step', 11)} {cell(r, 'mean_accept_len', 10)} "
              f"{cell(r, 'acceptance_rate', 11)}")
    print("  plain/verify ms: forward + sampling (verification) of a step without / with drafts; draft ms: the MTP")
    print("  catch-up + chained drafts after a step. Acceptance with random weights is meaningless.")
    print(f"\n{'model':10} {'prefill tokens':>14} {'keep_tokens':>11} {'off s':>8} {'compact s':>9} {'saved':>7}")
    for r in rows:
        if r["variant"] == "prefill":
            saved = 1 - r["prefill_compact_s"] / r["prefill_off_s"]
            print(f"{r['model']:10} {r['prefill_len']:14d} {r['keep_tokens']:11d} {r['prefill_off_s']:8.3f} "
                  f"{r['prefill_compact_s']:9.3f} {saved:7.1%}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="small workloads and a toy-width cut (CPU check)")
    ap.add_argument("--skip-cut", action="store_true", help="only the tiny model")
    ap.add_argument("--repeat", type=int, default=1, help="runs per variant (best kept)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the run config")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    overrides = list(args.overrides)
    if args.smoke:
        overrides.append("model.max_position=4096")
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_typed(compose(config_name="config", overrides=overrides))
    os.makedirs(cfg.engine.cache_dir, exist_ok=True)
    start = time.perf_counter()
    if args.smoke:
        tiny_w, cut_w, repeat = Workload(2, 32, 12, 512), Workload(2, 32, 8, 256), 1
    else:
        tiny_w, cut_w, repeat = Workload(8, 128, 64, 4096), Workload(4, 128, 32, 2048), args.repeat
    tiny = dataclasses.replace(cfg.model, max_position=min(cfg.model.max_position, 8192))
    rows = bench_model(cfg, tiny, tiny_w, "tiny", repeat)
    if not args.skip_cut:
        arch = ARCH_CUT_SMOKE if args.smoke else ARCH_CUT
        t0 = time.perf_counter()
        device = torch.device("cuda" if cfg.hardware.accelerator.value == "cuda" else "cpu")
        path = cut_checkpoint(arch, device, cfg.engine.cache_dir)
        cut = dataclasses.replace(cfg.model, name="v4-cut3", path=path, tokenizer_path=None, num_layers=None,
                                  max_position=8192, sliding_window=128, synthetic=None)
        rows += bench_model(cfg, cut, cut_w, "cut3", repeat)
        print(f"[cut3] done in {time.perf_counter() - t0:.1f}s", flush=True)
    print_table(rows)
    print(f"\ntotal {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
