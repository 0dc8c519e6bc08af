#!/usr/bin/env python3
"""Baseline of the PyTorch reference path of DeepSeek-V4 on one GPU.

1. Parity with transformers' DeepseekV4ForCausalLM on the reference §11 config on the device:
   fp32 (max relative error <= 1e-5, as on CPU) and bf16. bf16 criterion: both implementations
   round differently (we pool compressors, mix mHC streams and keep RoPE tables in fp32; HF
   rounds those to bf16), and on this random model bf16 itself moves logits by a few percent,
   so a fixed 1e-5 is meaningless. We require our bf16 logits to be as close to the fp32 truth as
   transformers' own bf16 run: rel_err(ours_bf16, fp32) <= max(1.5 * rel_err(hf_bf16, fp32), 2e-2).
2. Prefill and one decode step of a 3-layer real-dimension cut (SWA, CSA, HCA; D=4096, 64 heads of
   512, q_lora 1024, 8 output groups of 1024, indexer 64x128 top-512, all 256 experts, window 128,
   ratios 4/128) in bf16 with synthetic weights made on the GPU, at 2K/4K/8K tokens, with the time
   as a fraction of the H200 floor from redknot's cost model (bf16 matmul 796 TFLOP/s, 4.17 TB/s).

    PYTHONUNBUFFERED=1 python benchmarks/model_reference.py            # on the H200 (~2-3 minutes)
    python benchmarks/model_reference.py --device cpu --small          # check the script itself on a CPU
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "unit", "model"))  # the transformers oracle helpers

from redknot.models.deepseek_v4.config import V4Config  # noqa: E402
from redknot.models.deepseek_v4.cost import H200, CostModel  # noqa: E402
from redknot.models.deepseek_v4.model import DeepseekV4  # noqa: E402
from redknot.models.deepseek_v4.single import SingleSequence  # noqa: E402
from redknot.models.deepseek_v4.synthetic import randomize_  # noqa: E402
from redknot.models.deepseek_v4.weights import load_checkpoint  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- parity

def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions whose arg-max token agrees."""
    return float((a.argmax(-1).cpu() == b.argmax(-1).cpu()).float().mean())


def parity(device: torch.device) -> list:
    from v4_testutil import PARITY_CONFIG, hf_model, hf_to_native, rel_err
    from transformers import DeepseekV4ForCausalLM
    from redknot.models.deepseek_v4.writer import write_checkpoint

    rows = []
    hf = hf_model(PARITY_CONFIG, seed=0)
    cfg = V4Config.from_hf_dict(hf.config.to_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        native, hf_dir = os.path.join(tmp, "native"), os.path.join(tmp, "hf")
        write_checkpoint(native, cfg, iter(hf_to_native(hf.state_dict(), cfg.n_routed_experts).items()))
        hf.save_pretrained(hf_dir)
        with torch.no_grad():
            truth = hf.to(device)(ids.to(device), use_cache=False).logits[0].float()
            hf_bf16 = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()
            hf_bf16_logits = hf_bf16(ids.to(device), use_cache=False).logits[0].float()
        for dtype in (torch.float32, torch.bfloat16):
            ours = DeepseekV4(cfg, dtype, device="meta", with_mtp=False)
            ours.to_empty(device=device)
            load_checkpoint(ours, native, progress=False)
            full = SingleSequence(ours, 70).step(ids[0].tolist(), all_logits=True)[1]
            seq = SingleSequence(ours, 70, shuffle_blocks=3)
            cuts = [0, 29, 32, 35, 40, 41, 70]
            chunked = torch.cat([seq.step(ids[0, a:b].tolist(), all_logits=True)[1] for a, b in zip(cuts, cuts[1:])])
            err = max(rel_err(full, truth), rel_err(chunked, truth))
            if dtype == torch.float32:
                rows.append(("fp32 ours vs HF fp32", err, 1e-5, err <= 1e-5, top1(full, truth)))
            else:
                hf_err = rel_err(hf_bf16_logits, truth)
                tol = max(1.5 * hf_err, 2e-2)
                rows.append(("bf16 HF vs HF fp32 (reference point)", hf_err, float("nan"), True,
                             top1(hf_bf16_logits, truth)))
                rows.append(("bf16 ours vs HF fp32", err, tol, err <= tol, top1(full, truth)))
                rows.append(("bf16 ours vs HF bf16", rel_err(full, hf_bf16_logits), float("nan"), True,
                             top1(full, hf_bf16_logits)))
    return rows


# ----------------------------------------------------------------------------- timing

def cut_config(small: bool, experts: int) -> V4Config:
    over = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "n_routed_experts": experts}
    if small:
        over.update({"hidden_size": 256, "num_attention_heads": 4, "head_dim": 128, "q_lora_rank": 128,
                     "o_groups": 2, "o_lora_rank": 64, "index_n_heads": 8, "index_head_dim": 64,
                     "moe_intermediate_size": 128, "vocab_size": 129280})
    return V4Config.flash().with_overrides(over)


def timed(fn, device, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def bench_context(model, n: int, device, cost: CostModel) -> dict:
    cfg = model.cfg
    ids = torch.randint(0, cfg.vocab_size, (n + 4,), generator=torch.Generator().manual_seed(n)).tolist()
    seq = SingleSequence(model, n + 4, block_size=256)
    t_prefill = timed(lambda: seq.step(ids[:n]), device)
    decode_times = []
    for i in range(3):
        decode_times.append(timed(lambda: seq.step([ids[n + i]]), device))
    t_decode = sorted(decode_times)[1]
    pre = cost.prefill(n)
    dec = cost.decode(n, weight_bytes=2.0, kv_bytes=2.0)
    head_bytes = cfg.vocab_size * cfg.hidden_size * 2.0  # the step computes one row of logits
    decode_floor = max((dec.bytes + head_bytes) / H200.hbm_bytes_per_s, dec.flops / H200.bf16_flops)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return dict(n=n, prefill_s=t_prefill, prefill_tflops=pre.total / t_prefill / 1e12,
                prefill_frac=pre.floor_s() / t_prefill, decode_s=t_decode, decode_frac=decode_floor / t_decode,
                prefill_floor=pre.floor_s(), decode_floor=decode_floor, peak_gib=peak)


def timing(device: torch.device, contexts, small: bool, experts: int) -> list:
    cfg = cut_config(small, experts)
    log(f"building the 3-layer cut (SWA, CSA, HCA; {experts} experts) in bf16 on {device} ...")
    t0 = time.perf_counter()
    model = DeepseekV4(cfg, torch.bfloat16, device=device, with_mtp=False)
    randomize_(model, seed=0)
    sync(device)
    log(f"  {model.num_parameters() / 1e9:.2f} B parameters in {time.perf_counter() - t0:.1f} s")
    cost = CostModel(cfg)
    seq = SingleSequence(model, 600, block_size=256)  # warm-up: first-call kernels and allocator
    seq.step(list(range(512)))
    seq.step([7])
    results = []
    for n in contexts:
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            r = bench_context(model, n, device, cost)
            log(f"  {n:>6} tokens: prefill {r['prefill_s'] * 1e3:9.1f} ms, decode {r['decode_s'] * 1e3:8.2f} ms")
            results.append(r)
        except torch.OutOfMemoryError:
            log(f"  {n:>6} tokens: out of memory")
            results.append(dict(n=n, error="OOM"))
            torch.cuda.empty_cache()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", type=int, nargs="*", default=[2048, 4096, 8192])
    ap.add_argument("--experts", type=int, default=256, help="routed experts of the cut (256 = all)")
    ap.add_argument("--small", action="store_true", help="toy widths (to check the script on a CPU)")
    ap.add_argument("--skip-parity", action="store_true")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: run on the H200, or pass --device cpu --small to check the script")
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs true fp32 GEMMs
        log(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    status = 0
    par = []
    if not a.skip_parity:
        try:
            par = parity(device)
        except Exception:  # report and still time the model
            traceback.print_exc()
            par, status = [("parity", float("nan"), float("nan"), False, float("nan"))], 1
    res = timing(device, a.contexts, a.small, a.experts)
    log("\n== parity on the reference §11 config, T=70 (error = max|a - b| / max|b| over all logits) ==")
    log(f"  {'comparison':<40} {'error':>10}  {'tolerance':>13}  {'top-1 agree':>11}")
    for name, err, tol, ok, agree in par:
        log(f"  {name:<40} {err:10.3e}  {tol:13.2e}  {agree * 100:10.1f}%  {'ok' if ok else 'FAIL'}")
        status |= 0 if ok else 1
    log(f"\n== reference path, 3-layer real-dimension cut, bf16, floors: {H200.name} bf16 "
        f"{H200.bf16_flops / 1e12:.0f} TFLOP/s, {H200.hbm_bytes_per_s / 1e12:.2f} TB/s ==")
    log(f"{'tokens':>7} {'prefill ms':>11} {'TFLOP/s':>8} {'floor ms':>9} {'% roof':>7} "
        f"{'decode ms':>10} {'floor ms':>9} {'% roof':>7} {'peak GiB':>9}")
    for r in res:
        if "error" in r:
            log(f"{r['n']:>7} {r['error']:>11}")
            continue
        log(f"{r['n']:>7} {r['prefill_s'] * 1e3:11.1f} {r['prefill_tflops']:8.2f} {r['prefill_floor'] * 1e3:9.2f} "
            f"{r['prefill_frac'] * 100:6.2f}% {r['decode_s'] * 1e3:10.2f} {r['decode_floor'] * 1e3:9.3f} "
            f"{r['decode_frac'] * 100:6.2f}% {r['peak_gib']:9.1f}")
    return status


if __name__ == "__main__":
    sys.exit(main())
