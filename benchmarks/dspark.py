#!/usr/bin/env python3
"""DSpark (V4-Flash-0731 draft stages) on a real-dimension cut: what drafting, verifying and
scheduling cost per step (timings only).

The cut: V4-Flash width (D=4096, 64 heads of 512, q_lora 1024, indexer 64x128 top-512, window
128, real vocabulary) with 3 target layers (SWA, CSA, HCA like real layers 1-3, tapped by the
draft as 0731 taps layers 40-42) and the three DSpark stages of §2.3 at real width (rank-256
Markov head, confidence head); 8 routed experts per layer and stage instead of 256 (6 active)
so the seeded weights fit a quick start. Weights are random: acceptance is never measured.

Per batch size (1 and 32, contexts of ``--context`` tokens, prefilled first):

* draft ms per step: the stages' block forward + the Markov chain + confidences;
* verify ms at 1..g+1 tokens per request: the target forward + logits of the verify rows, and
  the verification math (token-wise and block) for sampled requests;
* schedule overhead: budget + global top-B allocation for the batch;
* plain decode step (1 token per request) eager vs CUDA-graph replay; the first replay of every
  captured graph is checked against eager execution (a mismatch is reported and disables graphs);
* the status of variable-length verify graphs.

    python benchmarks/dspark.py --out $OUT            # H200 (sm90-port kernels), about 2-4 minutes
    python benchmarks/dspark.py --smoke --out /tmp/x  # CPU: the same paths at toy width, seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import types
from pathlib import Path
from typing import Callable, Dict, List

import torch

from redknot.cache import CacheSpec
from redknot.config.schema import FeaturesConfig
from redknot.kernels import KernelSet
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.dspark_config import parse_dspark
from redknot.models.deepseek_v4.dspark_draft import DSparkDraft
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.synthetic import randomize_
from redknot.models.registry import load_family
from redknot.sample import Sampler, SamplingRow
from redknot.sample.params import SamplingParams
from redknot.speculative.draft_sampling import MarkovSampler
from redknot.speculative.profile import time_once_ms
from redknot.speculative.rejection import block_sample, speculative_sample
from redknot.speculative.schedule import CostModel, CostTable, VerifyScheduler
from redknot.speculative.varlen import VerifyGraphs
from redknot.step.metadata import StepMetadata

DSPARK_KEYS = dict(dspark_block_size=5, dspark_target_layer_ids=[0, 1, 2], dspark_markov_rank=256,
                   dspark_noise_token_id=128799, n_mtp_layers=3)
ARCH_CUT = dict(num_hidden_layers=3, compress_ratios=[0, 4, 128], num_hash_layers=2, n_routed_experts=8,
                num_nextn_predict_layers=0, **DSPARK_KEYS)
ARCH_SMOKE = dict(ARCH_CUT, hidden_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32, q_lora_rank=64,
                  o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=32, index_topk=16,
                  moe_intermediate_size=64, compress_rate_hca=16, compress_ratios=[0, 4, 16], dspark_markov_rank=16)


def timed_ms(device: torch.device, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(time_once_ms(device, fn) for _ in range(repeats))


class Bench:
    """Target + draft + state on one device, ``batch`` requests prefilled to ``context`` tokens."""

    def __init__(self, arch: Dict, device: torch.device, kernels: KernelSet, max_batch: int, context: int):
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
        features = FeaturesConfig()
        features.dspark.method, features.dspark.draft_sampling = "dspark", "greedy"
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

    @torch.no_grad()
    def draft_step(self, batch: int) -> None:
        d, device = self.draft, self.device
        anchors = torch.full((batch,), 7, dtype=torch.long, device=device)
        positions = torch.full((batch,), self.context, dtype=torch.long, device=device)
        slots = torch.arange(batch, dtype=torch.long, device=device)
        h, base = d.forward_block(anchors, positions, self.drafter.rings, slots)
        rows = [SamplingRow(f"r{i}", SamplingParams(temperature=1.0), seed=i, output_index=0) for i in range(batch)]
        blocks = MarkovSampler(self.sampler, "greedy").sample(base, d.markov_bias, anchors, rows,
                                                              [self.context + 1] * batch)
        tokens = torch.tensor([b.token_ids for b in blocks], device=device)
        prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        torch.sigmoid(d.confidence_logits(h, prev)).tolist()


def bench_verify_math(bench: Bench, batch: int, q: int, repeats: int) -> Dict[str, float]:
    vocab, device = bench.cfg.vocab_size, bench.device
    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.randn(batch, q, vocab, generator=gen, device=device).softmax(-1)
    qd = torch.randn(batch, q - 1, vocab, generator=gen, device=device).softmax(-1)
    drafts = [qd[b].argmax(-1).tolist() for b in range(batch)]
    noise = torch.empty(q, vocab, device=device).exponential_(generator=gen)
    coins = [0.5] * (q - 1)
    out = {}
    for name, fn in (("token", speculative_sample), ("block", block_sample)):
        out[name] = timed_ms(device, lambda: [fn(p[b], qd[b], drafts[b], coins, noise) for b in range(batch)], repeats)
    return out


def bench_schedule(batch: int, block: int, repeats: int) -> float:
    costs = CostModel(CostTable({n: 1.0 + 0.05 * n for n in range(1, 200)}), CostTable({1: 0.5, 32: 2.0}))
    sched = VerifyScheduler(True, "profile", 0, staleness=2, block=block, costs=costs)
    gen = torch.Generator().manual_seed(0)
    conf = {f"r{i}": torch.rand(block, generator=gen).tolist() for i in range(batch)}
    limits = {r: block for r in conf}
    return timed_ms(torch.device("cpu"), lambda: sched.lengths(conf, limits, batch, batch), repeats)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for dspark_bench.json")
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU")
    ap.add_argument("--context", type=int, default=None, help="prefilled tokens per request (4096; smoke 300)")
    ap.add_argument("--kernels", default=None, help="kernel backend (cuda: triton, cpu: reference)")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
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
    bench = Bench(ARCH_SMOKE if args.smoke else ARCH_CUT, device, kernels, max(batches), context)
    report: Dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "kernels": backend,
                    "context": context, "block_size": bench.dcfg.block_size, "stages": bench.dcfg.num_stages,
                    "routed_experts_per_layer": bench.cfg.n_routed_experts, "build_and_prefill_s":
                    round(time.perf_counter() - t_start, 1),
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dspark_bench.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
