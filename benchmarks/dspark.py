#!/usr/bin/env python3
"""DSpark on real-dimension cuts of DeepSeek-V4-Flash-0731 and DeepSeek-V4.1-Flash: what drafting,
verifying and scheduling cost per step (timings only).

``--model v4`` (default) -- the V4-0731 cut: V4-Flash width (D=4096, 64 heads of 512, q_lora 1024,
indexer 64x128 top-512, window 128, real vocabulary) with 3 target layers (SWA, CSA, HCA like real
layers 1-3, tapped by the draft as 0731 taps layers 40-42) and the three DSpark stages of §2.3 at
real width (rank-256 Markov head, confidence head); 8 routed experts per layer and stage instead of
256 (6 active) so the seeded weights fit a quick start. Per batch size (1 and 32, contexts of
``--context`` tokens, prefilled first):

* draft ms per step: the stages' block forward + the Markov chain + confidences;
* verify ms at 1..g+1 tokens per request: the target forward + logits of the verify rows, and
  the verification math (token-wise and block) for sampled requests;
* schedule overhead: budget + global top-B allocation for the batch;
* plain decode step (1 token per request) eager vs CUDA-graph replay; the first replay of every
  captured graph is checked against eager execution (a mismatch is reported and disables graphs);
* the status of variable-length verify graphs (off for V4: its tensor-only step is one token per
  sequence).

``--model v41`` -- the V4.1 cut: real widths (dim 5120, 64 heads x 512, 384 experts top-6 in FP8 /
MXFP4 random bytes), five layers with the roles of the real schedule (ratio-2 kv/index source with
Engram, ratio-2 consumer, ratio-1 kv and candidate source, ratio-1 consumer, candidate index source)
and the three DSpark stages at real width (128 experts top-3, rank-256 Markov head), tapping the
inputs of layers 2, 3, 4 (as V4.1 taps the inputs of 37-39). Per batch (1 and 32): draft ms per
step, and verify ms at 1..g+1 tokens per request eager (the engine's span path) vs replayed from
``VerifyGraphs`` (one CUDA graph per total-token tier, the taps refilled on replay); the first replay
of every tier is checked (``VerifyGraphs.checks`` / ``check_errors``: logits and taps) against the same
padded step run eagerly (a capture fault) and against the engine's unpadded eager step (the padding
difference), and the replay also against the tensor-only step run unpadded and uncaptured. The
``padding_probe`` says which of the step's GEMM-like ops give a row a result that depends on the row
count of the call (what a tier's padding rows change). ``draft_block_b*``: the draft's block forward
eager and replayed from the engine's draft graphs (``DraftGraphs``, first replay checked), and the whole
drafting step with the block forward replayed, and the
verification maths and schedule overhead per step. The random stored weights are made on the device in
their stored formats; request 0 is prefilled (2048 tokens by default, one chunk) and copied to the other
slots. ``--budget-s`` counts from the start, build included: a case that would start past it is skipped
with the reason in its place (the batch-1 row first, so a short budget still gives one whole row). Every
phase is printed with its device-synchronised seconds as it ends (``phases_s``), and ``tuning_s`` says
how long the kernels' launch-configuration tuners took on first calls (compiles included).
``--model both`` runs the two.

``features.dspark.block_attention`` (``--block-attention``) reaches both drafts' block forward.

    python benchmarks/dspark.py --out $OUT                 # H200, V4-0731 cut, about 2-4 minutes
    python benchmarks/dspark.py --model v41 --out $OUT     # H200, V4.1 cut, at most --budget-s (140) + a case
    python benchmarks/dspark.py --smoke --model both --out /tmp/x  # CPU: the same paths at toy width
"""
from __future__ import annotations

import argparse
import json
import time
import types
from pathlib import Path
from typing import Dict, List

import torch
from dspark_common import bench_schedule, bench_verify_math, draft_step, timed_ms   # benchmarks/: the script's dir
from dspark_v41 import Bench41, bench_v41  # noqa: F401  (Bench41: the GPU tests build the V4.1 cut from here)

from redknot.cache import CacheSpec
from redknot.config.schema import FeaturesConfig
from redknot.kernels import KernelSet
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.dspark_config import parse_dspark
from redknot.models.deepseek_v4.dspark_draft import DSparkDraft
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.synthetic import randomize_
from redknot.models.registry import load_family
from redknot.sample import Sampler
from redknot.speculative.varlen import VerifyGraphs
from redknot.step.metadata import StepMetadata

DSPARK_KEYS = dict(dspark_block_size=5, dspark_target_layer_ids=[0, 1, 2], dspark_markov_rank=256,
                   dspark_noise_token_id=128799, n_mtp_layers=3)
ARCH_CUT = dict(num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=2, n_routed_experts=8,
                num_nextn_predict_layers=0, **DSPARK_KEYS)
ARCH_SMOKE = dict(ARCH_CUT, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32, q_lora_rank=64,
                  o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=16,
                  moe_intermediate_size=64, compress_rate_hca=16, compress_ratios=[0, 4, 16], dspark_markov_rank=16)


class Bench:
    """Target + draft + state on one device, ``batch`` requests prefilled to ``context`` tokens."""

    def __init__(self, arch: Dict, device: torch.device, kernels: KernelSet, max_batch: int, context: int,
                 features: FeaturesConfig):
        hf = V4Config.flash().to_hf_dict()
        hf.update(arch)
        self.cfg = V4Config.from_hf_dict(hf)
        self.dcfg = parse_dspark(hf)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.device, self.dtype, self.context = device, dtype, context
        t0 = time.perf_counter()
        self.model = DeepseekV4(self.cfg, dtype, device=device, kernels=kernels)
        randomize_(self.model, seed=0)
        self.draft = DSparkDraft(self.cfg, self.dcfg, dtype, device=device)
        randomize_(self.draft, seed=1)
        self.draft.attach(self.model)
        family = load_family("deepseek_v4")
        self.layout = family.state_layout(self.cfg, block_size=256, max_backtrack=self.dcfg.block_size,
                                          kv_bytes=torch.empty((), dtype=dtype).element_size())
        per_req = -(-(context + 64) // 256)
        self.num_slots, self.num_blocks = max_batch + 1, max_batch * per_req + 1
        self.state = family.allocate_state(self.cfg, self.layout, num_slots=self.num_slots,
                                           num_blocks=self.num_blocks, device=device, dtype=dtype)
        self.tables = [list(range(i * per_req, (i + 1) * per_req)) for i in range(max_batch)]
        from redknot.speculative.dspark_drafter import DSparkDrafter
        self.sampler = Sampler(device)
        self.drafter = DSparkDrafter(self.draft, self.state, self.sampler, features, max_model_len=context + 64)
        self.build_s = time.perf_counter() - t0
        self._prefill(max_batch)

    @torch.no_grad()
    def _prefill(self, batch: int) -> None:
        gen = torch.Generator().manual_seed(0)
        for b in range(batch):
            ids = torch.randint(3, self.cfg.vocab_size, (self.context,), generator=gen).tolist()
            for start in range(0, self.context, 1024):
                chunk = ids[start:start + 1024]
                meta = StepMetadata.build([chunk], [start], [b], [self.tables[b]], device=self.device)
                streams = self.model.forward(meta, self.state)
                keep = list(range(max(0, len(chunk) - self.draft.window), len(chunk)))
                self.drafter.write_context(streams.shape[0], [b] * len(keep), [start + i for i in keep], keep)

    def meta(self, batch: int, q: int) -> StepMetadata:
        tokens = [[5] * q for _ in range(batch)]
        rows = list(range(batch * q))
        return StepMetadata.build(tokens, [self.context] * batch, list(range(batch)), self.tables[:batch],
                                  logits_indices=rows, device=self.device)

    @torch.no_grad()
    def verify_forward(self, meta: StepMetadata) -> torch.Tensor:
        return self.model.compute_logits(self.model.forward(meta, self.state)[meta.logits_indices])

    def draft_step(self, batch: int) -> None:
        draft_step(self.draft, self.drafter, self.sampler, batch, self.context)


def bench_graphs(bench: Bench, batches: List[int], repeats: int) -> Dict:
    """Plain decode steps (1 token per request): eager vs replay; first replay checked vs eager."""
    from redknot.engine.cuda_graphs import DecodeGraphs
    layout = bench.layout
    runner = types.SimpleNamespace(
        model=bench.model, state=bench.state, kernels=bench.model.ks, device=bench.device, dtype=bench.dtype,
        cache_spec=CacheSpec.from_layout(layout), padding_slot=bench.num_slots - 1,
        padding_block=bench.num_blocks - 1,
        eager_logits=lambda inputs: bench.verify_forward(inputs.meta))
    graphs = DecodeGraphs(runner, max_batch=max(batches), max_len=bench.context + 64)
    result = {"sizes": graphs.sizes}
    t0 = time.perf_counter()
    graphs.capture()
    result["capture_s"] = time.perf_counter() - t0
    checks = {}
    for bs in graphs.sizes:  # the first replay of every captured graph, against eager
        inputs = types.SimpleNamespace(meta=bench.meta(bs, 1))
        if graphs.disabled_reason is None:
            graphs.run(inputs)
        checks[bs] = "ok" if graphs.disabled_reason is None else graphs.disabled_reason
    result["first_replay_vs_eager"] = checks
    for bs in batches:
        inputs = types.SimpleNamespace(meta=bench.meta(bs, 1))
        result[f"eager_ms_b{bs}"] = timed_ms(bench.device, lambda: bench.verify_forward(inputs.meta), repeats)
        if graphs.disabled_reason is None:
            result[f"graph_ms_b{bs}"] = timed_ms(bench.device, lambda: graphs.run(inputs), repeats)
    result["status"] = graphs.status
    return result


def bench_v4(args, cuda: bool, device: torch.device, features: FeaturesConfig) -> Dict:
    backend = args.kernels or ("triton" if cuda else "reference")
    try:
        kernels = KernelSet(backend)
    except Exception as err:  # a missing optional package: measure with the reference ops, and say so
        print(f"kernel backend {backend!r} unavailable ({err}); using reference", flush=True)
        backend, kernels = "reference", KernelSet("reference")
    context = args.context or (4096 if cuda else 300)
    repeats = args.repeats or (20 if cuda else 3)
    batches = [1, 32] if cuda else [1, 4]
    torch.manual_seed(0)
    t_start = time.perf_counter()
    bench = Bench(ARCH_SMOKE if args.smoke or not cuda else ARCH_CUT, device, kernels, max(batches), context,
                  features)
    report: Dict = {"model": "v4-0731", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "kernels": backend, "context": context, "block_size": bench.dcfg.block_size,
                    "stages": bench.dcfg.num_stages, "routed_experts_per_layer": bench.cfg.n_routed_experts,
                    "block_attention": features.dspark.block_attention,
                    "build_and_prefill_s": round(time.perf_counter() - t_start, 1),
                    "note": "random weights: timings only, acceptance is not measured"}
    print(json.dumps(report), flush=True)
    g = bench.dcfg.block_size
    for b in batches:
        row: Dict = {"batch": b, "draft_ms": timed_ms(device, lambda: bench.draft_step(b), repeats)}
        for q in range(1, g + 2):
            meta = bench.meta(b, q)
            row[f"verify_ms_q{q}"] = timed_ms(device, lambda: bench.verify_forward(meta), repeats)
        row["verify_math_ms_q6"] = bench_verify_math(bench, b, g + 1, max(3, repeats // 4))
        row["schedule_ms"] = bench_schedule(b, g, repeats)
        print(json.dumps(row), flush=True)
        report[f"batch_{b}"] = row
    report["decode_graphs"] = bench_graphs(bench, batches, repeats) if cuda else "off: no CUDA device"
    report["varlen_verify_graphs"] = VerifyGraphs(types.SimpleNamespace(model=bench.model), max(batches), g).status
    report["total_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps({k: report[k] for k in ("decode_graphs", "varlen_verify_graphs", "total_s")}), flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for dspark_bench.json")
    ap.add_argument("--model", default="v4", choices=("v4", "v41", "both"),
                    help="v4: the V4-Flash-0731 cut (default); v41: the V4.1-Flash cut with verify graphs")
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU")
    ap.add_argument("--context", type=int, default=None,
                    help="prefilled tokens per request (v4 4096, v41 2048; smoke 300/40)")
    ap.add_argument("--kernels", default=None, help="kernel backend (cuda: triton, cpu: reference)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="--model v41: seconds from the start (build and prefill included) after which the "
                         "remaining cases are skipped, each with the reason in the table")
    ap.add_argument("--block-attention", default=FeaturesConfig().dspark.block_attention,
                    help="features.dspark.block_attention of the drafts (bidirectional | causal)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)   # toy shapes: a second thread only contends with whatever else runs
    features = FeaturesConfig()
    features.dspark.method, features.dspark.draft_sampling = "dspark", "greedy"
    features.dspark.block_attention = args.block_attention   # a bad value is refused by the drafter
    report: Dict = {}
    if args.model in ("v4", "both"):
        report["v4"] = bench_v4(args, cuda, device, features)
    if args.model in ("v41", "both"):
        report["v41"] = bench_v41(args, cuda, device, features)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dspark_bench.json").write_text(json.dumps(report if args.model == "both" else report[args.model],
                                                      indent=1))


if __name__ == "__main__":
    main()
