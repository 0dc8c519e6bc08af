#!/usr/bin/env python3
"""Baseline of the PyTorch reference path of DeepSeek-V4 on one GPU.

1. Parity with transformers' DeepseekV4ForCausalLM on the reference §11 config on the device:
   fp32 (max relative error <= 1e-5, as on CPU) and bf16. bf16 criterion: the two implementations
   round in different places (we pool compressors, mix mHC streams and keep RoPE tables in fp32;
   transformers rounds those to bf16), and on this random model bf16 itself moves logits by a few
   percent (mean row error ~3-6%, and a flipped expert or indexer choice moves single rows far more),
   so a fixed 1e-5 is meaningless. We require our bf16 logits to be as close to the fp32 truth as
   transformers' own bf16 run: mean row error(ours_bf16) <= 1.5 * mean row error(hf_bf16) + 5e-3.
2. Prefill and one decode step of a 3-layer real-dimension cut (SWA, CSA, HCA like real layers 1-3; D=4096, 64 heads of
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


def row_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over positions of ||a - b|| / ||b|| (robust to the rare top-k flip that dominates the max)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).mean())


def _ours(cfg, native: str, dtype, device, ids) -> tuple:
    model = DeepseekV4(cfg, dtype, device="meta", with_mtp=False)
    model.to_empty(device=device)
    load_checkpoint(model, native, progress=False)
    full = SingleSequence(model, 70).step(ids[0].tolist(), all_logits=True)[1]
    seq = SingleSequence(model, 70, shuffle_blocks=3)
    cuts = [0, 29, 32, 35, 40, 41, 70]
    chunked = torch.cat([seq.step(ids[0, a:b].tolist(), all_logits=True)[1] for a, b in zip(cuts, cuts[1:])])
    return full, chunked


def _hf_bf16_logits(hf, hf_dir: str, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """transformers' own bf16 logits: its bf16 checkpoint load (fp32-kept params stay fp32) when that
    runs; some releases mix fp32 mHC outputs into bf16 linears there, so fall back to casting the whole
    model to bf16 (reference §11 pitfall b: also rounds the fp32-kept params, a slightly harsher point)."""
    from transformers import DeepseekV4ForCausalLM
    try:
        model = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()
        return model(ids, use_cache=False).logits[0].float()
    except RuntimeError as exc:
        log(f"  transformers bf16 load failed ({str(exc).splitlines()[0][:90]}); using a bf16 cast of the fp32 model")
        import copy
        return copy.deepcopy(hf).to(device=device, dtype=torch.bfloat16)(ids, use_cache=False).logits[0].float()


def parity(device: torch.device) -> list:
    """Rows (comparison, max rel error, mean row error, tolerance, ok, top-1 agreement)."""
    from v4_testutil import PARITY_CONFIG, hf_model, hf_to_native, rel_err
    from redknot.models.deepseek_v4.writer import write_checkpoint

    hf = hf_model(PARITY_CONFIG, seed=0)
    cfg = V4Config.from_hf_dict(hf.config.to_dict())
    ids = torch.randint(0, cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        native, hf_dir = os.path.join(tmp, "native"), os.path.join(tmp, "hf")
        write_checkpoint(native, cfg, iter(hf_to_native(hf.state_dict(), cfg.n_routed_experts).items()))
        hf.save_pretrained(hf_dir)
        with torch.no_grad():
            truth = hf.to(device)(ids.to(device), use_cache=False).logits[0].float()
            hfb = _hf_bf16_logits(hf, hf_dir, ids.to(device), device)
        f32, f32_chunked = _ours(cfg, native, torch.float32, device, ids)
        b16, b16_chunked = _ours(cfg, native, torch.bfloat16, device, ids)
    err32 = max(rel_err(f32, truth), rel_err(f32_chunked, truth))
    hf_row = row_err(hfb, truth)
    tol = 1.5 * hf_row + 5e-3
    ours_row = max(row_err(b16, truth), row_err(b16_chunked, truth))
    nan = float("nan")
    return [("fp32 ours (full, chunked) vs HF fp32", err32, row_err(f32, truth), 1e-5, err32 <= 1e-5, top1(f32, truth)),
            ("bf16 HF vs HF fp32 (reference point)", rel_err(hfb, truth), hf_row, nan, True, top1(hfb, truth)),
            ("bf16 ours (full, chunked) vs HF fp32", max(rel_err(b16, truth), rel_err(b16_chunked, truth)),
             ours_row, tol, ours_row <= tol, top1(b16, truth)),
            ("bf16 ours vs HF bf16", rel_err(b16, hfb), row_err(b16, hfb), nan, True, top1(b16, hfb))]


# ----------------------------------------------------------------------------- timing

def cut_config(small: bool, experts: int) -> V4Config:
    # Like real layers 1-3 (SWA, CSA, HCA): the first two hash-routed, the third with the learned router.
    over = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0], "n_routed_experts": experts,
            "num_hash_layers": 2}
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
            nan = float("nan")
            par, status = [("parity", nan, nan, nan, False, nan)], 1
    res = timing(device, a.contexts, a.small, a.experts)
    log("\n== parity on the reference §11 config, T=70 ==")
    log("   max = max|a-b| / max|b| over all logits (fp32 criterion); row = mean over positions of ||a-b||/||b||")
    log("   (bf16 criterion: ours must be as close to fp32 as transformers' own bf16 run: row <= 1.5*HF + 5e-3)")
    log(f"  {'comparison':<40} {'max':>10} {'row':>10} {'tolerance':>10} {'top-1':>7}")
    for name, err, row, tol, ok, agree in par:
        log(f"  {name:<40} {err:10.3e} {row:10.3e} {tol:10.2e} {agree * 100:6.1f}%  {'ok' if ok else 'FAIL'}")
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
