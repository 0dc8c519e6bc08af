"""What DeepSeek-V4.1 bounded replay costs in accuracy and saves in prefill time (reference §5.5).

``features.swa_replay.mode=off`` runs every layer on every prompt token (exact);
``compact`` runs the layers up to the last kv source (layer 20 of V4.1-Flash, its
compressor and index keys included) on every token and the layers above only on the
last ``keep_tokens`` rows, whose windows then start there. For each prompt length and
``keep_tokens`` this measures, against ``off`` on the same prompt:

* the last prompt row's logits: max abs error and argmax agreement;
* greedy agreement: both modes decode greedily on their own; tokens equal until the
  first divergence, and the fraction of equal tokens;
* teacher-forced agreement: ``compact`` is fed ``off``'s greedy tokens; per step, whether
  its argmax equals ``off``'s (and the max abs logit error over those steps);
* prefill wall time of each mode (chunked as the engine chunks: ``--chunk`` tokens a step).

Architectures (random weights, nothing to download):

* ``--arch tiny``: the tiny-v41 parity config (6 layers, window 16, top-8) with the real vocabulary;
* ``--arch cut``: real width (hidden 5120, 64 heads of 512, q-LoRA 1280, 32x128 indexer,
  window 128, top-512, 2048x8 candidates, hc 4) over the first ``--layers`` layers of the
  real schedule (default 26: Engram at 1 and 14, ratio-2 owners 2/8/14, layer 20, its
  consumers 21-23, the re-index at 24 and a consumer), with ``--experts`` routed experts
  (default 8, top-6) and small Engram tables; BF16 weights, reference numerics.

    python benchmarks/v41_bounded_replay.py --arch tiny --prompts 512 2048 --out outputs/v41_replay
    python benchmarks/v41_bounded_replay.py --arch cut --device cuda --dtype bfloat16 --prompts 4096 16384 \\
        --out $OUT

Writes ``results.json`` and ``results.md`` under ``--out``; prints the table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from typing import Dict, List, Optional

import torch

from redknot.models.deepseek_v41.config import V41Config, tiny_v41_config
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights
from redknot.models.deepseek_v41.state import allocate_state
from redknot.models.deepseek_v41.state_layout import create_state_layout
from redknot.step.metadata import StepMetadata

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


# ------------------------------------------------------------------------------ models
def cut_config(layers: int, experts: int) -> V41Config:
    """Real widths, the first ``layers`` layers of the real schedule, fewer experts, small Engram tables."""
    from redknot.models.deepseek_v41.engram_hash import engram_primes, table_rows

    cfg = V41Config.flash().cut(layers)
    vocab = 1000
    primes = engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads, vocab)
    return replace(cfg, n_routed_experts=experts, n_activated_experts=min(6, experts), n_mtp_layers=0,
                   dspark_target_layer_ids=(), engram_vocab_size=vocab,
                   engram_num_embeddings=tuple(table_rows(p) for p in primes),
                   compress_ratios=cfg.compress_ratios[:cfg.n_layers])


def random_weights(cfg, dtype: torch.dtype, device, seed: int) -> Weights:
    """Random tensors of the native schema, in ``dtype`` (FP8/FP4 linears held dequantised; the
    reference numerics still quantise their inputs), Engram tables in their stored FP8 form."""
    from redknot.kernels import mx_formats as mx
    from redknot.models.deepseek_v41.checkpoint import ENGRAM, F32, FP4, FP8, checkpoint_spec

    gen = torch.Generator(device=device).manual_seed(seed)
    out: Dict[str, torch.Tensor] = {}
    quantized = set()
    for spec in checkpoint_spec(replace(cfg, quant=cfg.quant), include_draft=False):
        name = spec.name
        r = torch.randn(spec.shape, generator=gen, device=device, dtype=torch.float32)
        if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
            v = 1.0 + 0.1 * r
        elif "hc_" in name and name.endswith("_scale"):
            v = 0.5 + 0.05 * r
        elif "hc_" in name and name.endswith("_fn"):
            v = 0.05 * r
        elif name == "embed.weight" or name.endswith("engram.embed.weight"):
            v = 0.5 * r
        elif len(spec.shape) == 1:
            v = 0.5 * r
        else:
            v = r * (1.5 / math.sqrt(spec.shape[-1]))
        if spec.kind == ENGRAM:
            q, s = mx.quant_fp8_groups(v, 32, mx.E4M3_MAX * 2.0 ** -126)
            out[name], out[spec.scale_name] = q, s
            continue
        if spec.kind in (FP8, FP4):
            quantized.add(name)
        out[name] = v.float() if spec.kind == F32 else v.to(dtype)
        del r, v
    return Weights(out, dtype, quantized=frozenset(quantized))


def build(arch: str, dtype: torch.dtype, device, layers: int, experts: int, seed: int) -> DeepseekV41:
    cfg = tiny_v41_config() if arch == "tiny" else cut_config(layers, experts)
    w = random_weights(cfg, dtype, device, seed)
    tmap = (torch.arange(cfg.vocab_size, device=device) * 7919) % cfg.engram_compressed_vocab_size
    return DeepseekV41(cfg, w, tmap, int(tmap[cfg.engram_pad_id]), Numerics("reference", dtype), device=device)


# ------------------------------------------------------------------------------ runs
class Run:
    """One sequence over a private state, in ``off`` (replay None) or ``compact`` mode."""

    def __init__(self, model: DeepseekV41, max_tokens: int, keep: Optional[int]):
        self.model, self.keep = model, keep
        self.layout = create_state_layout(model.cfg, block_size=256, max_backtrack=0)
        n = self.layout.blocks_for(max_tokens)
        self.state = allocate_state(model.cfg, self.layout, num_slots=1, num_blocks=n, device=model.device,
                                    dtype=model.dtype)
        self.blocks = list(range(n))
        self.length = 0

    def step(self, ids: List[int], seq_len: int) -> torch.Tensor:
        meta = StepMetadata.build([ids], [self.length], [0], [self.blocks], device=self.model.device)
        if self.keep is not None:
            meta.replay_from = [max(0, seq_len - self.keep)]
        x = self.model.forward(meta, self.state)
        self.length += len(ids)
        return self.model.compute_logits(x[meta.logits_indices])[0].float()

    def prefill(self, prompt: List[int], chunk: int) -> (torch.Tensor, float):
        sync(self.model.device)
        t0 = time.perf_counter()
        for s in range(0, len(prompt), chunk):
            logits = self.step(prompt[s:s + chunk], len(prompt))
        sync(self.model.device)
        return logits, time.perf_counter() - t0


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def measure(model: DeepseekV41, prompt_len: int, keep: int, decode: int, chunk: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + prompt_len)
    prompt = torch.randint(3, model.cfg.vocab_size - 3, (prompt_len,), generator=gen).tolist()
    total = prompt_len + decode + 1
    off, comp = Run(model, total, None), Run(model, total, keep)
    lo, t_off = off.prefill(prompt, chunk)
    lc, t_comp = comp.prefill(prompt, chunk)
    row = {"prompt": prompt_len, "keep_tokens": keep, "prefill_s_off": t_off, "prefill_s_compact": t_comp,
           "last_row_max_abs_err": float((lo - lc).abs().max()), "last_row_logit_scale": float(lo.abs().max()),
           "last_row_argmax_equal": bool(lo.argmax() == lc.argmax())}
    # Teacher-forced: compact is fed off's greedy tokens (a second compact run, fresh state).
    tf = Run(model, total, keep)
    tf.prefill(prompt, chunk)
    greedy_off, agree_tf, err_tf = [int(lo.argmax())], [], []
    tok, logit_off = greedy_off[0], lo
    lt = lc
    for i in range(decode):
        agree_tf.append(bool(lt.argmax() == logit_off.argmax()))
        err_tf.append(float((lt - logit_off).abs().max()))
        seq_len = prompt_len + i + 1
        logit_off = off.step([tok], seq_len)
        lt = tf.step([tok], seq_len)
        tok = int(logit_off.argmax())
        greedy_off.append(tok)
    # Free greedy for compact on its own tokens.
    greedy_comp, tok, logit = [int(lc.argmax())], int(lc.argmax()), lc
    for i in range(decode):
        logit = comp.step([tok], prompt_len + i + 1)
        tok = int(logit.argmax())
        greedy_comp.append(tok)
    first_div = next((i for i, (a, b) in enumerate(zip(greedy_off, greedy_comp)) if a != b), len(greedy_off))
    row.update({
        "decode_steps": decode,
        "greedy_equal_prefix": first_div,
        "greedy_agreement": sum(a == b for a, b in zip(greedy_off, greedy_comp)) / len(greedy_off),
        "teacher_forced_agreement": sum(agree_tf) / max(1, len(agree_tf)),
        "teacher_forced_max_abs_err": max(err_tf) if err_tf else 0.0,
    })
    return row


def table(rows: List[dict]) -> str:
    head = ("| prompt | keep | last-row max abs err (logit scale) | argmax eq | greedy eq prefix / agreement | "
            "teacher-forced agreement (max err) | prefill s off | prefill s compact |\n"
            "|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['prompt']} | {r['keep_tokens']} | {r['last_row_max_abs_err']:.3g} "
             f"({r['last_row_logit_scale']:.3g}) | {r['last_row_argmax_equal']} "
             f"| {r['greedy_equal_prefix']}/{r['decode_steps'] + 1} {r['greedy_agreement']:.3f} "
             f"| {r['teacher_forced_agreement']:.3f} ({r['teacher_forced_max_abs_err']:.3g}) "
             f"| {r['prefill_s_off']:.2f} | {r['prefill_s_compact']:.2f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=("tiny", "cut"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--keep", type=int, nargs="+", default=None,
                    help="keep_tokens values (default: 140; tiny: 17 32 140, since its 2 tail layers of window 16 "
                         "make keep >= 31 exact at the last row)")
    ap.add_argument("--decode", type=int, default=16, help="decode steps for the agreement measures")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step (engine chunking)")
    ap.add_argument("--layers", type=int, default=26, help="--arch cut: backbone layers kept")
    ap.add_argument("--experts", type=int, default=8, help="--arch cut: routed experts per layer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/v41_bounded_replay")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        model = build(args.arch, DTYPES[args.dtype], torch.device(args.device), args.layers, args.experts, args.seed)
        print(f"built {args.arch}: {model.cfg.n_layers} layers, hidden {model.cfg.dim}, "
              f"split at layer {model.split} ({time.perf_counter() - t0:.1f}s)", flush=True)
        keeps = args.keep or ([17, 32, 140] if args.arch == "tiny" else [140])
        for keep in keeps:
            need = model.cfg.window_size + 1
            if keep < need:
                print(f"--keep {keep}: compact replay needs keep_tokens >= window + 1 = {need}", file=sys.stderr)
                return 2
        warm = Run(model, 2 * model.cfg.window_size, None)   # first-call costs stay out of the timings
        warm.prefill(list(range(3, 3 + 2 * model.cfg.window_size)), args.chunk)
        rows = []
        for n in args.prompts:
            for keep in keeps:
                r = measure(model, n, keep, args.decode, args.chunk, args.seed)
                rows.append(r)
                print(json.dumps(r), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"arch": args.arch, "device": args.device, "dtype": args.dtype, "layers": model.cfg.n_layers,
            "hidden": model.cfg.dim, "routed_experts": model.cfg.n_routed_experts, "split_layer": model.split,
            "numerics": "reference", "wall_s": time.perf_counter() - t0}
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"setup": meta, "rows": rows}, f, indent=1)
    text = f"# V4.1 bounded replay (compact) vs off\n\n{json.dumps(meta)}\n\n" + table(rows)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
