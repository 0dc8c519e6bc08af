"""DSpark on the real-dimension cut of DeepSeek-V4.1-Flash (``benchmarks/dspark.py --model v41``; see
that module's docstring for the table): the cut and its state, the verify-graph and draft-graph rows, the
padding probe, and the run under ``--budget-s``."""
from __future__ import annotations

import json
import time
import types
from contextlib import nullcontext
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from dspark_common import (Clock, TunerLog, bench_schedule, bench_verify_math, draft_step, timed_cell,
                           timed_ms)
from e2e_v41_cut import copy_sequence

from redknot.cache import CacheSpec
from redknot.config.schema import FeaturesConfig
from redknot.kernels import KernelSet
from redknot.models.registry import load_family
from redknot.sample import Sampler
from redknot.speculative.varlen import VerifyGraphs, row_error, tier_for
from redknot.step.metadata import StepMetadata


# ---------------------------------------------------------------------- V4.1
V41_ROLES = dict(num_hidden_layers=5, compress_ratios=[2, 2, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[0, 2],
                 index_source_layer_ids=[0, 2, 4], candidate_source_layer_id=2, engram_layer_ids=[0],
                 num_nextn_predict_layers=3, dspark_target_layer_ids=[2, 3, 4], engram_vocab_size=10000,
                 engram_compressed_vocab_size=1027)
V41_SMOKE = dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                 q_lora_rank=64, o_lora_rank=64, o_groups=2, n_routed_experts=8, num_experts_per_tok=2,
                 sliding_window=16, index_n_heads=4, index_head_dim=64, index_topk=8, candidate_topk_blocks=3,
                 candidate_block_size=4, engram_n_heads=2, engram_head_dim=32, vocab_size=2048, engram_vocab_size=100,
                 dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
                 dspark_noise_token_id=2047)


def v41_random_tensors(cfg, device):
    """(backbone, draft) tensors as stored, the V4.1 cut's random bytes (``e2e_v41.random_stored``)."""
    from e2e_v41 import random_stored   # benchmarks/ is the script's directory

    return random_stored(cfg, device, include_draft=True)


class Bench41:
    """V4.1 target + DSpark draft + paged state; request 0 prefilled to ``context`` tokens and copied to
    the other ``max_batch - 1`` slots (equal contexts without ``max_batch`` prefills)."""

    def __init__(self, smoke: bool, device: torch.device, backend: str, max_batch: int, context: int,
                 features: FeaturesConfig, clock: Optional["Clock"] = None):
        from redknot.models.deepseek_v41.config import V41Config
        from redknot.models.deepseek_v41.dspark_draft import V41DSparkDraft
        from redknot.models.deepseek_v41.kernel_ops import V41Ops
        from redknot.models.deepseek_v41.model import DeepseekV41
        from redknot.models.deepseek_v41.ref_math import Numerics, Weights
        from redknot.speculative.dspark_drafter import DSparkDrafter

        t0 = time.perf_counter()
        over = dict(V41_ROLES, **(V41_SMOKE if smoke else {}))
        self.cfg = cfg = V41Config().with_overrides(over)
        self.device, self.dtype, self.context = device, torch.bfloat16, context
        self.kernels = KernelSet(default=backend)
        ops = V41Ops.create(self.kernels)   # as the engine builds it (None: PyTorch math, the CPU's path)
        phase = clock.phase if clock is not None else (lambda name: nullcontext())
        with phase("random weights (on the device)"):
            main, draft = v41_random_tensors(cfg, device)
        self.weight_gib = sum(t.numel() * t.element_size() for t in list(main.values()) + list(draft.values())) / 2**30
        with phase("model, draft, state"):
            tmap = (torch.arange(cfg.vocab_size) * 7919) % cfg.engram_compressed_vocab_size
            num = Numerics("reference", self.dtype)
            self.model = DeepseekV41(cfg, Weights(main, self.dtype, keep=True), tmap, int(tmap[cfg.engram_pad_id]),
                                     num, device=device, ops=ops)
            self.draft = V41DSparkDraft(cfg, Weights(draft, self.dtype, keep=True), num,
                                        device=device).attach(self.model)
            self.family = load_family("deepseek_v41")
            g = cfg.dspark_block_size
            self.layout = self.family.state_layout(cfg, block_size=256, max_backtrack=g, kv_bytes=2)
            self.max_len = context + 64
            per = self.layout.blocks_for(self.max_len)
            self.num_slots, self.num_blocks = max_batch + 1, max_batch * per + 1
            self.state = self.family.allocate_state(cfg, self.layout, num_slots=self.num_slots,
                                                    num_blocks=self.num_blocks, device=device, dtype=self.dtype)
            self.tables = [list(range(i * per, (i + 1) * per)) for i in range(max_batch)]
            self.sampler = Sampler(device)
            self.drafter = DSparkDrafter(self.draft, self.state, self.sampler, features, max_model_len=self.max_len)
        self.build_s = time.perf_counter() - t0
        self._prefill(max_batch, phase)
        self.step_id = 0

    @torch.no_grad()
    def _prefill(self, batch: int, phase) -> None:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, self.cfg.vocab_size, (self.context,), generator=gen).tolist()
        chunk = 4096
        for start in range(0, self.context, chunk):
            part = ids[start:start + chunk]
            with phase(f"prefill chunk {start}..{start + len(part)}"):
                meta = StepMetadata.build([part], [start], [0], [self.tables[0]], device=self.device)
                streams = self.model.forward(meta, self.state)
            with phase(f"draft context K/V of chunk {start}"):
                keep = list(range(max(0, len(part) - self.draft.window), len(part)))
                self.drafter.write_context(streams.shape[0], [0] * len(keep), [start + i for i in keep], keep)
        with phase(f"copy request 0 to {batch - 1} slots"):
            self._copy_first(batch)

    def _copy_first(self, batch: int) -> None:
        st = self.state
        for i in range(1, batch):  # request i: a copy of request 0 (slot i, its own blocks)
            copy_sequence(st, i, 0, self.tables[i], self.tables[0])
            for ring in self.drafter.rings:
                ring[i] = ring[0]

    def draft_step(self, batch: int) -> None:
        draft_step(self.draft, self.drafter, self.sampler, batch, self.context)

    def inputs(self, batch: int, q: int):
        """The engine's StepInputs of a verify step: ``batch`` requests, ``q`` rows each, at the context."""
        from redknot.engine.inputs import build_step_inputs
        from redknot.engine.messages import ScheduledRequest, SchedulerOutput

        self.step_id += 1
        reqs = [ScheduledRequest(f"r{b}", b, self.tables[b], self.context, [5 + b] * q, num_logits=q,
                                 draft_token_ids=[5 + b] * (q - 1), seq_len=self.context + 1) for b in range(batch)]
        return build_step_inputs(SchedulerOutput(self.step_id, reqs))

    @torch.no_grad()
    def eager_forward(self, inputs):
        """(pre-head rows, logits) of the step on the model's span path (the runner's eager step)."""
        meta = inputs.to(self.device)
        streams = self.model.forward(meta, self.state)
        return streams, self.model.compute_logits(streams[meta.logits_indices])

    @torch.no_grad()
    def tensor_step_logits(self, inputs) -> torch.Tensor:
        """Logits of the same step through the tensor-only step, unpadded and not captured."""
        meta = inputs.to(self.device)
        x = self.family.varlen_forward(self.model, self.state, input_ids=meta.input_ids, positions=meta.positions,
                                       query_start_loc=meta.query_start_loc, seq_slots=meta.seq_slots,
                                       block_tables=meta.block_tables)
        return self.model.compute_logits(x)

    def runner(self):
        """What :class:`VerifyGraphs` reads of an engine runner."""
        return types.SimpleNamespace(
            model=self.model, family=self.family, state=self.state, device=self.device, dtype=self.dtype,
            kernels=self.kernels, cache_spec=CacheSpec.from_layout(self.layout), padding_slot=self.num_slots - 1,
            padding_block=self.num_blocks - 1, graph_pool=None, eager_forward=self.eager_forward)


@torch.no_grad()
def draft_block_graph(bench: "Bench41", batch: int, capturer, repeats: int) -> Dict:
    """The drafting step for ``batch`` requests eager and through the engine's draft graphs
    (:class:`DraftGraphs`, the tier of ``batch``): the block forward (the stages, the head) eager ms and
    replay ms, the first replay's check (against the same call run eagerly), and the whole drafting
    step (block forward, Markov chain, confidences) with the block forward replayed."""
    from redknot.speculative.draft_graphs import DraftGraphs

    d, device, ctx = bench.draft, bench.device, bench.context
    # a different anchor per request: identical rows would all route to the same experts
    anchors = 7 + torch.arange(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), ctx, dtype=torch.long, device=device)
    slots = torch.arange(batch, dtype=torch.long, device=device)
    rings, causal = bench.drafter.rings, bench.drafter.causal
    out: Dict = {"eager_ms": timed_ms(device, lambda: d.forward_block(anchors, positions, rings, slots, causal),
                                      repeats)}
    graphs = DraftGraphs(d, rings, causal, batch, bench.num_slots - 1, capturer, tiers=[batch])
    t0 = time.perf_counter()
    graphs.capture()
    out["capture_s"] = round(time.perf_counter() - t0, 2)
    if graphs.tier_of(batch) is None:
        out["graph"] = graphs.status
        return out
    graphs.forward_block(anchors, positions, slots)   # the first replay, checked
    out["first_replay"] = {"check": graphs.checks.get(batch), "errors": graphs.check_errors.get(batch)}
    if graphs.tier_of(batch) is None:
        out["graph"] = graphs.status
        return out
    out["graph_ms"] = timed_ms(device, lambda: graphs.forward_block(anchors, positions, slots), repeats)
    out["draft_step_graph_ms"] = timed_ms(device, lambda: draft_step(d, bench.drafter, bench.sampler, batch, ctx,
                                                                     graphs.forward_block), repeats)
    return out


@torch.no_grad()
def padding_probe(bench: "Bench41", pairs=((160, 192), (129, 192), (100, 128))) -> Dict:
    """Which of the step's GEMM-like ops give a row a result that depends on how many rows share the call
    (what a graph tier's padding rows change): per op and (real, padded) row counts, the largest
    |difference| of the real rows between a call on ``padded`` rows and one on the ``real`` rows alone,
    relative to the largest |value| (0: the op is invariant to padding at that size). Random inputs at
    the cut's shapes, the ops the tensor-only step calls."""
    cfg, w, ops, dev = bench.cfg, bench.model.w, bench.model.ops, bench.device
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    top = max(p for _, p in pairs)
    d, e = cfg.dim, cfg.n_routed_experts
    cases: Dict[str, Callable[[int], torch.Tensor]] = {}
    wq_b, wq_b_s = w.tensors.get("layers.0.attn.wq_b.weight"), w.tensors.get("layers.0.attn.wq_b.scale")
    xq = rnd(top, cfg.q_lora_rank)
    if ops is not None and ops.linear_mx is not None and wq_b is not None and wq_b.dtype == torch.float8_e4m3fn:
        cases["linear_mx wq_b (fp8)"] = lambda n: ops.linear_mx(xq[:n], wq_b, wq_b_s, 32, 32)
    xd = rnd(top, d)
    ids = torch.rand(top, e, generator=gen, device=dev).topk(cfg.n_activated_experts, -1).indices
    wts = torch.rand(top, cfg.n_activated_experts, generator=gen, device=dev) + 0.1
    if ops is not None and ops.moe_mx is not None and "layers.0.ffn.experts.0.w1.weight" in w.tensors:
        stacks = ops.stacked_experts(w, "layers.0.ffn", e)
        cases["moe_mx (mxfp4)"] = lambda n: ops.moe_mx(xd[:n], ids[:n], wts[:n], *stacks, cfg.swiglu_limit)
    w_small = rnd(512, d, scale=d ** -0.5)
    cases["bf16 F.linear 512 x dim (compressor / indexer)"] = lambda n: torch.nn.functional.linear(xd[:n], w_small)
    xf, router = xd.float(), rnd(e, d, dtype=torch.float32, scale=d ** -0.5)
    cases["fp32 F.linear experts x dim (router)"] = lambda n: torch.nn.functional.linear(xf[:n], router)
    hx, hfn = rnd(top, cfg.hc_mult * d, dtype=torch.float32), rnd((2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * d,
                                                                 dtype=torch.float32, scale=(cfg.hc_mult * d) ** -0.5)
    cases["fp32 matmul (mHC mixes)"] = lambda n: hx[:n] @ hfn.t()
    g, r = cfg.o_groups, cfg.o_lora_rank
    o, wo_a = rnd(top, g, cfg.n_heads * cfg.head_dim // g), rnd(g, r, cfg.n_heads * cfg.head_dim // g, scale=0.02)
    cases["bf16 einsum (wo_a)"] = lambda n: torch.einsum("ngk,grk->ngr", o[:n], wo_a).reshape(n, -1)
    cases["head (compute_logits)"] = lambda n: bench.model.compute_logits(xd[:n])
    out: Dict[str, Dict[str, float]] = {}
    for name, fn in cases.items():
        row = {}
        for real, padded in pairs:
            a, b = fn(padded)[:real].float(), fn(real).float()
            row[f"{real}_of_{padded}"] = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
        out[name] = row
    return out


def save_partial(args, report: Dict) -> None:
    """The V4.1 table so far (``dspark_v41_partial.json``): what a run stopped from outside leaves."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dspark_v41_partial.json").write_text(json.dumps(report, indent=1, default=str))


def bench_v41(args, cuda: bool, device: torch.device, features: FeaturesConfig) -> Dict:
    """The V4.1 cut's table (module docstring), each case skipped with its reason once the run's
    ``--budget-s`` (counted from the start, build included) is spent. Order: build and prefill, the
    batch-1 row (draft, verify eager and in graphs at 1..g+1 tokens per request), the batch-32 row,
    the draft block eager vs graph, schedule and verification maths, the padding probe."""
    from redknot.engine.cuda_graphs import CudaGraphCapture, HostGraphCapture

    clock = Clock(device, args.budget_s)
    tuners = TunerLog() if cuda else None
    backend = args.kernels or ("triton" if cuda else "reference")
    context = args.context or (2048 if cuda else 40)
    repeats = args.repeats or (10 if cuda else 2)
    cap_s = 3.0 if cuda else 1.0
    batches = [1, 32] if cuda else [1, 3]
    torch.manual_seed(0)
    bench = Bench41(args.smoke or not cuda, device, backend, max(batches), context, features, clock)
    g = bench.cfg.dspark_block_size
    report: Dict = {"model": "v41", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "kernels": backend, "ops": bench.model.ops.choice if bench.model.ops else None,
                    "context": context, "block_size": g, "stages": bench.cfg.n_mtp_layers,
                    "routed_experts": bench.cfg.n_routed_experts,
                    "draft_routed_experts": bench.cfg.dspark_n_routed_experts,
                    "weights_gib": round(bench.weight_gib, 2),
                    "block_attention": features.dspark.block_attention,
                    "build_and_prefill_s": round(clock.now(), 1), "budget_s": args.budget_s,
                    "note": "random weights: timings only, acceptance is not measured"}
    print(json.dumps(report), flush=True)
    report["phases_s"] = clock.phases
    save_partial(args, report)
    capturer = CudaGraphCapture() if cuda else HostGraphCapture()
    verify_report: Dict = {"capture_s": {}, "tiers": {}, "status": {}}
    checks: Dict[int, str] = {}
    errors: Dict[int, Dict] = {}
    vs_tensor_step: Dict[int, str] = {}
    mismatches: List[str] = []
    for b in batches:
        row: Dict = {"batch": b}
        report[f"batch_{b}"] = row
        why = clock.skip()
        if why:
            row["all"] = why
            print(json.dumps(row), flush=True)
            continue
        with clock.phase(f"draft b{b}"):
            row["draft"] = timed_cell(clock, lambda: bench.draft_step(b), repeats, 2, cap_s)
        # One graph set per batch (the tiers its verify steps use, in the engine's tier ladder for
        # max_num_seqs = the largest batch): the batch-1 row completes before the larger tiers capture.
        graphs = VerifyGraphs(bench.runner(), max_num_seqs=max(batches), block=g, capture=capturer,
                              tap_layers=bench.draft.dcfg.target_layer_ids, max_len=bench.max_len)
        needed = sorted({tier_for(b * q, graphs.tiers) for q in range(1, g + 2)})
        # expected: twice the last capture (larger tiers), at least 10 s
        why = clock.skip(max([10.0] + [2 * c for c in verify_report["capture_s"].values()]))
        if why:
            row["verify_graphs"] = f"capture of tiers {needed} {why}"
        else:
            with clock.phase(f"capture tiers {needed}"):
                graphs.capture(needed)
            verify_report["capture_s"][f"b{b}"] = clock.phases[f"capture tiers {needed}"]
            verify_report["tiers"][f"b{b}"] = needed
            verify_report["status"][f"b{b}"] = graphs.status
        for q in range(1, g + 2):
            why = clock.skip(clock.phases.get(f"verify b{b} q{q - 1}", 0.0))   # expected: as long as the last
            if why:
                row[f"verify_q{q}"] = why
                continue
            inputs = bench.inputs(b, q)
            with clock.phase(f"verify b{b} q{q}"):
                row[f"verify_eager_q{q}"] = timed_cell(clock, lambda: bench.eager_forward(inputs),
                                                       max(2, repeats // 3), 1, cap_s)
                if not graphs.can_run(inputs):   # not captured (budget) or capture failed: the status says why
                    row[f"verify_graph_q{q}"] = row.get("verify_graphs") or graphs.status
                    continue
                tier = tier_for(b * q, graphs.tiers)
                if tier not in graphs.checks:
                    graphs.run(inputs)                    # the first replay of the tier: checked against eager
                    if graphs.disabled_reason is not None:   # a mismatch: reported, and the other tiers still run
                        mismatches.append(graphs.disabled_reason)
                        graphs.disabled_reason = None
                    graphs.check_first_replay = False
                    _, logits = graphs.run(inputs)            # the replay itself, against the unpadded tensor step
                    graphs.check_first_replay = True
                    vs_tensor_step[tier] = f"row error {row_error(logits, bench.tensor_step_logits(inputs)):.3g}"
                row[f"verify_graph_q{q}"] = timed_cell(clock, lambda: graphs.run(inputs), repeats, 1, cap_s)
        checks.update(graphs.checks)
        errors.update(graphs.check_errors)
        print(json.dumps(row), flush=True)
        report["phases_s"] = clock.phases
        save_partial(args, report)
    for b in batches:
        key = f"draft_block_b{b}"
        why = clock.skip(5.0)
        if why:
            report[key] = why
        else:
            with clock.phase(key):
                report[key] = draft_block_graph(bench, b, capturer, repeats)
        print(json.dumps({key: report[key]}), flush=True)
        save_partial(args, report)
    for b in batches:
        key = f"verify_math_and_schedule_b{b}"
        why = clock.skip(3.0)
        if why:
            report[key] = why
        else:
            with clock.phase(key):
                report[key] = {"verify_math_ms_q{}".format(g + 1): bench_verify_math(bench, b, g + 1, 3),
                               "schedule_ms": bench_schedule(b, g, repeats)}
        print(json.dumps({key: report[key]}), flush=True)
        save_partial(args, report)
    if cuda or args.smoke:   # which ops round a row differently when padding rows share the call
        why = clock.skip(5.0)
        if why:
            report["padding_probe"] = why
        else:
            with clock.phase("padding probe"):
                report["padding_probe"] = padding_probe(bench)
        print(json.dumps({"padding_probe": report["padding_probe"]}), flush=True)
    verify_report.update(
        first_replay_vs_eager=checks,
        first_replay_errors={t: {"rows": e["rows"], "capture": max(e["capture"].values()),
                                 "padding": max(e["padding"].values())} for t, e in errors.items()},
        first_replay_errors_by_output=errors, first_replay_vs_tensor_step=vs_tensor_step,
        verdict=f"off (the engine would serve eagerly): {mismatches[0]}" if mismatches else "no mismatch")
    report["verify_graphs"] = verify_report
    report["phases_s"] = clock.phases
    if tuners is not None:
        tuners.close()
        report["tuning_s"] = tuners.summary()
    report["total_s"] = round(clock.now(), 1)
    print(json.dumps({"verify_graphs": {k: verify_report[k] for k in verify_report
                                        if k != "first_replay_errors_by_output"},
                      "tuning_s": report.get("tuning_s"), "total_s": report["total_s"]}), flush=True)
    return report
