#!/usr/bin/env python3
"""Where tiny-v41 (fp32) greedy decoding through CUDA graphs parts from eager decoding, and why.

Three scenarios, the three engine-level GPU tests that compare the paths:

* ``decode``  -- the engine with ``hardware.cuda_graphs`` off vs on (decode graphs, no DSpark);
  ``tests/unit/model/v41_forward/test_v41_tensor_step.py::test_gpu_engine_decodes_tiny_v41_in_cuda_graphs``.
* ``verify``  -- DSpark verify steps in graphs (oracle drafts) vs plain eager greedy;
  ``tests/unit/speculative/test_verify_graphs.py::test_gpu_engine_verifies_in_cuda_graphs``.
* ``schedule`` -- the hand-scheduled verify steps of
  ``test_verify_graphs.py::test_gpu_verify_replay_equals_eager_and_taps`` (SCHEDULE).

For the two engine scenarios the tokens of both runs are compared: the first divergent token of each
request with both runs' top-1 / top-2 logit gap there. Then, along the graph run, every graph step is
probed from the state before it, three ways: the tensor-only step run uncaptured on the same padded
buffers, the engine's eager step (op by op, the span kernels) and the replay itself (what the run
keeps). Per step: max |logits diff| per real row (replay vs uncaptured: a capture fault; uncaptured vs
eager: the two paths), whether the argmax differs, the smallest top-1/top-2 gap, the real state bytes
that differ after the step, and per index-source layer the rows whose top-k selection differs between
the tensor step and the eager step, with the scores (the tensor step's) of the entries only one side
picked and the number of exact ties at the selection boundary. A selection that differs between
entries of equal score is a tie rule; one whose boundary scores are a rounding apart is a near-tie;
one whose scores differ clearly is a bug.

Every scenario runs once per ``--dtypes`` pass: float32 (the tests' dtype) and float64 (no fp32 rounding:
what is left there is structure, not rounding).

    python benchmarks/graphs_divergence_v41.py --out $OUT      # H200, about 2-3 minutes
    python benchmarks/graphs_divergence_v41.py --device cpu --scenarios schedule_fresh --dtypes float32
    python benchmarks/graphs_divergence_v41.py --device cpu --scenarios perturb --dtypes float32  # amplification
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "unit" / "speculative")]

from redknot.bench.typed import load_yaml_option  # noqa: E402
from redknot.config.schema import (Accelerator, DType, EngineConfig, FeaturesConfig, HardwareConfig,  # noqa: E402
                                   ModelConfig, SchedulerConfig)

CONF = ROOT / "conf" / "model" / "tiny-v41.yaml"
DTYPE = DType.float32   # the pass being run (main sets it): the engines' hardware.dtype and kv_cache_dtype


# ---------------------------------------------------------------------- selection spy
class Spy:
    """Records, per index-source layer, the tensor step's top-k, the scores it selected from (and the
    candidate list those scores index, where the layer scores a list) while ``on``."""

    def __init__(self):
        import redknot.kernels.triton.step_indexer_mx as si
        import redknot.models.deepseek_v41.tensor_step as ts
        import redknot.models.deepseek_v41.tensor_step_sources as tss

        self.on = False
        self.rec: Dict[int, dict] = {}
        self.last = None
        orig_index, orig_kernel, orig_torch = ts._index, si.step_index_scores, tss._index_scores_torch
        spy = self

        def kernel_scores(*a, **k):   # the Triton step kernels' scores ([T, C] over ``entries`` when given)
            out = orig_kernel(*a, **k)
            ent = k.get("entries")
            spy.last = (out.detach().float().clone(), None if ent is None else ent.clone())
            return out

        def torch_scores(*a, **k):    # the PyTorch step's scores [T, n_max]
            out = orig_torch(*a, **k)
            spy.last = (out.detach().float().clone(), None)
            return out

        def index(layer, u, qr, rows, state, shared):
            spy.last = None
            orig_index(layer, u, qr, rows, state, shared)
            if not spy.on:
                return
            sc, cand = spy.last if spy.last is not None else (None, None)
            spy.rec[layer.layer] = {"topk": shared["topk"].clone(), "scores": sc, "cand": cand}
        ts._index, si.step_index_scores, tss._index_scores_torch = index, kernel_scores, torch_scores

        # Sub-layer outputs of both paths (attention input/output, MoE output), per layer.
        import redknot.models.deepseek_v41.attention as at
        import redknot.models.deepseek_v41.model as mm

        self.acts: Dict[tuple, torch.Tensor] = {}
        orig_attn, orig_call = ts._attention, at.AttentionLayer.__call__
        orig_moe_t, orig_moe_e = ts._moe, mm.moe_forward

        def keep(name, layer, t):
            if spy.on:
                spy.acts[(name, layer)] = t.detach().float().clone()

        def attn_t(layer, u, rows, state, shared):
            keep("attn_in", layer.layer, u)
            out = orig_attn(layer, u, rows, state, shared)
            keep("attn_out", layer.layer, out)
            return out

        def attn_e(self_, u, *a, **k):
            keep("attn_in", self_.layer, u)
            out = orig_call(self_, u, *a, **k)
            keep("attn_out", self_.layer, out)
            return out

        def moe_t(u, w, layer, cfg, num):
            out = orig_moe_t(u, w, layer, cfg, num)
            keep("moe_out", layer, out)
            return out

        def moe_e(u, w, layer, cfg, num):
            out = orig_moe_e(u, w, layer, cfg, num)
            keep("moe_out", layer, out)
            return out
        ts._attention, at.AttentionLayer.__call__, ts._moe, mm.moe_forward = attn_t, attn_e, moe_t, moe_e
        # The eager PyTorch indexer keeps the scores it selected from when its Slots hold a dict.
        mm.Slots = lambda: at.Slots(scores={})

    @contextlib.contextmanager
    def recording(self):
        self.rec, self.acts, self.on = {}, {}, True
        try:
            yield self.rec
        finally:
            self.on = False


def compare_acts(tens: Dict[tuple, torch.Tensor], eager: Dict[tuple, torch.Tensor], n: int) -> List[str]:
    """Per layer and sub-layer: max |diff| over the real rows (where both paths computed all of them)."""
    out = []
    for key in sorted(tens, key=lambda k: (k[1], ["attn_in", "attn_out", "moe_out"].index(k[0]))):
        e = eager.get(key)
        if e is None:
            continue
        t = tens[key][:n]
        if e.shape[0] != n:
            out.append(f"L{key[1]}.{key[0]}: eager has {e.shape[0]} rows")
            continue
        d = (t - e).abs().amax().item()
        out.append(f"L{key[1]}.{key[0]} {d:.2g}")
    return out


def _score(rec: dict, r: int, e: int) -> Optional[float]:
    sc = rec["scores"]
    if sc is None:
        return None
    if rec["cand"] is not None:
        hit = (rec["cand"][r] == e).nonzero()
        return float(sc[r, hit[0, 0]]) if hit.numel() else None
    return float(sc[r, e]) if 0 <= e < sc.shape[1] else None


def compare_selections(eager: Dict[int, torch.Tensor], tens: Dict[int, dict], n: int,
                       eager_scores: Optional[Dict[int, torch.Tensor]] = None) -> List[dict]:
    """Rows (of the first ``n``) whose selection differs, per index-source layer, ascending layers; the
    scores are the tensor step's (``eager_scores``: the eager step's too, where it kept them)."""
    eager_scores = eager_scores or {}
    out = []
    for layer in sorted(tens):
        rec = tens[layer]
        if layer not in eager:
            out.append({"layer": layer, "note": "no eager record"})
            continue
        ea, te = eager[layer][:n].cpu(), rec["topk"][:n].cpu()
        sc = rec["scores"]
        for r in range(n):
            a, b = set(ea[r].tolist()) - {-1}, set(te[r].tolist()) - {-1}
            if a == b:
                continue
            only_e = {e: _score(rec, r, e) for e in sorted(a - b)}
            only_t = {e: _score(rec, r, e) for e in sorted(b - a)}
            row = {"layer": layer, "row": r, "n_eager": len(a), "n_tensor": len(b),
                   "eager_only": only_e, "tensor_only": only_t}
            es = eager_scores.get(layer)
            if es is not None and r < es.shape[0]:
                def e_score(e):
                    return float(es[r, e]) if 0 <= e < es.shape[1] else None
                row["eager_scores"] = {"eager_only": {e: e_score(e) for e in only_e},
                                       "tensor_only": {e: e_score(e) for e in only_t}}
            if sc is not None:
                picked = [_score(rec, r, e) for e in b]
                picked = [s for s in picked if s is not None]
                if picked:
                    kth = min(picked)
                    row["kth_score"] = kth
                    row["ties_at_kth"] = int((sc[r] == kth).sum())
                    fin = [v for v in list(only_e.values()) + list(only_t.values()) if v is not None]
                    if fin:
                        row["boundary_gap"] = max(fin) - min(fin)
                        row["rel_gap"] = row["boundary_gap"] / max(abs(kth), 1e-30)
            out.append(row)
    return out


# ---------------------------------------------------------------------- helpers
def top2_gap(row: torch.Tensor):
    v, i = row.float().topk(2)
    return {"top1": int(i[0]), "top2": int(i[1]), "gap": float(v[0] - v[1])}


def real_state(runner) -> Dict[str, torch.Tensor]:
    st = runner.state
    out = {f"window{i}": w[:-1] for i, w in enumerate(st.windows)}
    for k, src in st.sources.items():
        out[f"src{k}.entries"], out[f"src{k}.keys"] = src.entries[:-1], src.keys[:-1]
        if src.kv_rows is not None:
            out[f"src{k}.kv_rows"], out[f"src{k}.gate_rows"] = src.kv_rows[:-1], src.gate_rows[:-1]
    if st.engram_ids is not None:
        out["engram_ids"] = st.engram_ids[:-1]
    return out


def state_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, str]:
    out = {}
    for k in a:
        x, y = a[k], b[k]
        if x.dtype in (torch.uint8, torch.long, torch.int32):
            rows = (x != y).reshape(x.shape[0] * x.shape[1], -1).any(-1) if x.dim() > 2 else (x != y)
            cnt = int(rows.sum())
            if cnt:
                out[k] = f"{cnt} rows differ"
        else:
            d = (x.float() - y.float()).abs().max().item() if x.numel() else 0.0
            if d > 0:
                out[k] = f"max {d:.3g}"
    return out


def snapshot(runner) -> List[torch.Tensor]:
    return [t.clone() for t in runner.state.tensors()]


def restore(runner, saved: List[torch.Tensor]) -> None:
    for t, s in zip(runner.state.tensors(), saved):
        t.copy_(s)


def row_maxdiff(a: torch.Tensor, b: torch.Tensor) -> List[float]:
    return [float(f"{float(v):.2g}") for v in (a.double() - b.double()).abs().amax(-1).cpu()]


def probe_step(runner, spy: Spy, inputs, uncaptured, replay, n: int, label: str, log: list) -> object:
    """The step from the same state three ways; returns what ``replay()`` returns (the run keeps it)."""
    model = runner.model
    before = snapshot(runner)
    with spy.recording() as tens:
        lg_u = uncaptured()
    tens, acts_u = dict(tens), dict(spy.acts)
    after_u = {k: v.clone() for k, v in real_state(runner).items()}
    restore(runner, before)
    with spy.recording():
        _, lg_e = runner.eager_forward(inputs)
    lg_e, acts_e = lg_e.clone(), dict(spy.acts)
    eager_rec = dict(model.last_slots.record) if model.last_slots is not None else {}
    eager_rec = {k: v.clone() for k, v in eager_rec.items()}
    eager_sc = getattr(model.last_slots, "scores", None) or {}
    eager_sc = {k: v.float().clone() for k, v in eager_sc.items()}
    after_e = {k: v.clone() for k, v in real_state(runner).items()}
    alone = eager_alone(runner, inputs, lg_e, before)
    restore(runner, before)
    got = replay()
    lg_g = (got[1] if isinstance(got, tuple) else got)[:n].clone()
    after_g = real_state(runner)
    gaps = [top2_gap(r)["gap"] for r in lg_e]
    entry = {
        "step": label, "rows": n,
        "replay_vs_uncaptured": row_maxdiff(lg_g, lg_u[:n]),
        "eager_alone_vs_batch": alone,
        "uncaptured_vs_eager": row_maxdiff(lg_u[:n], lg_e),
        "argmax_differs_rows": [i for i in range(n) if int(lg_u[i].argmax()) != int(lg_e[i].argmax())],
        "min_top12_gap_eager": round(min(gaps), 6),
        "state_uncaptured_vs_eager": state_diff(after_u, after_e),
        "state_replay_vs_uncaptured": state_diff(after_g, after_u),
        "selection_diffs": compare_selections(eager_rec, tens, n, eager_sc),
        "sublayers_uncaptured_vs_eager": compare_acts(acts_u, acts_e, n),
    }
    log.append(entry)
    return got


def eager_alone(runner, inputs, lg_batch: torch.Tensor, before: List[torch.Tensor]) -> List[float]:
    """Each request's rows run eagerly on their own (from the same state) against the batched eager step:
    the rounding a batch's composition alone moves a row by (per real row, max |logits diff|)."""
    from redknot.engine.inputs import build_step_inputs
    from redknot.engine.messages import SchedulerOutput

    srs = inputs.sched.requests
    if len(srs) < 2 or inputs.meta is None or lg_batch.shape[0] != inputs.meta.num_tokens:
        return []
    out, at = [], 0
    for sr in srs:
        n = sr.num_tokens
        restore(runner, before)
        one = build_step_inputs(SchedulerOutput(inputs.sched.step_id, [sr]))
        one.meta.input_ids.copy_(inputs.meta.input_ids[at:at + n].to(one.meta.input_ids.device))
        _, lg = runner.eager_forward(one)
        out += row_maxdiff(lg, lg_batch[at:at + n])
        at += n
    return out


def print_entry(e: dict) -> None:
    ue = e["uncaptured_vs_eager"]
    print(f"  step {e['step']}: rows {e['rows']} max|dlogits| uncaptured-vs-eager max {max(ue):.3g} "
          f"per row {ue}; replay-vs-uncaptured max {max(e['replay_vs_uncaptured']):.3g}; "
          f"argmax differs rows {e['argmax_differs_rows']}; min top1-top2 gap {e['min_top12_gap_eager']}")
    if e["eager_alone_vs_batch"]:
        print(f"    eager, each request alone vs batched: per row {e['eager_alone_vs_batch']}")
    print(f"    sub-layers uncaptured vs eager (max |diff|): {', '.join(e['sublayers_uncaptured_vs_eager'])}")
    if e["state_uncaptured_vs_eager"]:
        print(f"    state uncaptured vs eager: {e['state_uncaptured_vs_eager']}")
    if e["state_replay_vs_uncaptured"]:
        print(f"    state replay vs uncaptured: {e['state_replay_vs_uncaptured']}")
    for s in e["selection_diffs"][:6]:
        print(f"    selection differs: {json.dumps(s, default=float)}")
    if len(e["selection_diffs"]) > 6:
        print(f"    ... {len(e['selection_diffs']) - 6} more rows with differing selections")


def first_divergence(name: str, off_tok, on_tok, off_lg, on_lg) -> dict:
    out = {"request": name, "len": len(off_tok)}
    for i, (a, b) in enumerate(zip(off_tok, on_tok)):
        if a != b:
            out.update(index=i, off_token=a, on_token=b)
            if off_lg is not None and i < len(off_lg) and i < len(on_lg):
                out["off_gap"], out["on_gap"] = top2_gap(off_lg[i]), top2_gap(on_lg[i])
                out["logits_maxdiff_here"] = float((off_lg[i] - on_lg[i]).abs().max())
                if i:
                    out["logits_maxdiff_prev"] = float((off_lg[i - 1] - on_lg[i - 1]).abs().max())
            return out
    out["index"] = None
    if off_lg is not None:
        m = min(len(off_lg), len(on_lg))
        out["logits_maxdiff_all"] = float((off_lg[:m] - on_lg[:m]).abs().max()) if m else 0.0
    return out


def _logit_rows(logits: Dict[str, list]) -> Dict[str, torch.Tensor]:
    return {rid: torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]) for rid, rows in logits.items()}


# ---------------------------------------------------------------------- scenario: decode graphs
def decode_scenario(device: str, cache: str, spy: Spy, report: dict) -> None:
    import random

    from llm_testutil import run_all

    from redknot.engine import LLM, SamplingParams

    model = load_yaml_option(CONF, ModelConfig)
    model.max_position = 512
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 60))] for i in range(5)}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runs, logs = [], []
    for graphs in (False, True):
        hw = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=DTYPE,
                            kv_cache_dtype=DTYPE, cuda_graphs=graphs, memory_utilization=0.5,
                            cuda_graph_max_len=512)
        if device == "cpu":
            hw = HardwareConfig(dtype=DTYPE, kv_cache_dtype=DTYPE)
        features = FeaturesConfig()
        features.dspark.method = "none"
        eng = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, block_size=16),
                           cache_dir=cache)
        llm = LLM(model, hw, features, eng)
        dg = llm.runner.graphs
        if graphs and dg is not None and dg.graphs:
            _probe_decode_graphs(llm.runner, dg, spy, logs)
        got, lg = run_all(llm, prompts, params, record_logits=True)
        runs.append(({k: v.token_ids for k, v in got.items()}, _logit_rows(lg)))
        if graphs:
            report[f"decode_status@{DTYPE.value}"] = llm.stats().cuda_graphs
        llm.close()
    _report_runs("decode", prompts, runs, logs, report)


def _probe_decode_graphs(runner, dg, spy: Spy, logs: list) -> None:
    model = runner.model
    orig_run = dg.run
    count = [0]

    def run(inputs):
        meta = inputs.meta
        n = meta.num_seqs
        bs = next(s for s in dg.sizes if s >= n)

        def uncaptured():
            dg.input_ids[:n].copy_(meta.input_ids)
            dg.positions[:n].copy_(meta.positions)
            dg.seq_slots[:n].copy_(meta.seq_slots)
            dg.seq_slots[n:bs].fill_(runner.padding_slot)
            width = meta.block_tables.shape[1]
            dg.block_tables[:n, :width].copy_(meta.block_tables)
            dg.block_tables[:n, width:].fill_(runner.padding_block)
            dg.block_tables[n:bs].fill_(runner.padding_block)
            dg.positions[n:bs].zero_()
            m = dg._meta(bs, [0] * bs)
            return model.compute_logits(model.forward(m, runner.state)[m.logits_indices])
        count[0] += 1
        return probe_step(runner, spy, inputs, uncaptured, lambda: orig_run(inputs), n,
                          f"{count[0]} (batch {n} -> graph {bs})", logs)
    dg.run = run


def perturb_scenario(device: str, cache: str, spy: Spy, report: dict, rel: float = 1e-7, layer: int = 2) -> None:
    """How far this model carries a last-bit difference: the decode scenario's engine run eagerly twice,
    the second time with the streams entering ``layer`` multiplied by (1 + rel * N(0, 1)) in every step
    (fp32 rounding is ~6e-8 relative). Per request: the first differing token, the reference's top-1/top-2
    gap there and the logits differences per token up to it."""
    import random

    from llm_testutil import run_all

    from redknot.engine import LLM, SamplingParams

    model = load_yaml_option(CONF, ModelConfig)
    model.max_position = 512
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(3, 2000) for _ in range(rng.randrange(4, 60))] for i in range(5)}
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    runs = []
    for noisy in (False, True):
        hw = HardwareConfig(dtype=DTYPE, kv_cache_dtype=DTYPE)
        if device == "cuda":
            hw = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=DTYPE, kv_cache_dtype=DTYPE,
                                memory_utilization=0.5)
        features = FeaturesConfig()
        features.dspark.method = "none"
        eng = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, block_size=16),
                           cache_dir=cache)
        llm = LLM(model, hw, features, eng)
        if noisy:
            gen = torch.Generator(device=llm.runner.device).manual_seed(1)

            def hook(i, h, rows):
                if i == layer:
                    h.mul_(1 + rel * torch.randn(h.shape, generator=gen, dtype=h.dtype, device=h.device))
            llm.runner.model.tap_hook = hook
        got, lg = run_all(llm, prompts, params, record_logits=True)
        runs.append(({k: v.token_ids for k, v in got.items()}, _logit_rows(lg)))
        llm.close()
    (a_tok, a_lg), (b_tok, b_lg) = runs
    name = f"perturb@{DTYPE.value}"
    print(f"\n== {name}: streams entering layer {layer} perturbed by {rel:g} (relative), eager both times ==")
    out = []
    for rid in prompts:
        d = first_divergence(rid, a_tok[rid], b_tok[rid], a_lg[rid], b_lg[rid])
        m = d["index"] + 1 if d["index"] is not None else len(a_tok[rid])
        d["per_token"] = [float(f"{float(v):.2g}") for v in (a_lg[rid][:m] - b_lg[rid][:m]).abs().amax(-1)]
        out.append(d)
        print(f"  {json.dumps(d, default=float)}")
    report[name] = out


# ---------------------------------------------------------------------- scenarios: verify graphs
_LLMS: Dict[tuple, object] = {}


def _verify_llm(cache: str, dspark: bool, device: str, graphs: bool, fresh: bool = False):
    """The engines of test_verify_graphs.py, shared across scenarios as its module fixture shares them
    (the GPU replay test runs on the engine the engine test left its state in); ``fresh``: a new one."""
    from test_verify_graphs import _make

    key = (dspark, graphs, DTYPE)
    if fresh or key not in _LLMS:
        llm = _make(cache, dspark, cuda=device == "cuda", graphs=graphs, dtype=DTYPE)
        if device == "cpu" and dspark and graphs:
            from redknot.engine.cuda_graphs import HostGraphCapture

            llm.runner.graph_max_len = 256
            llm.runner.use_verify_graphs(HostGraphCapture()).capture()
        if fresh:
            return llm
        _LLMS[key] = llm
    return _LLMS[key]


def _probe_verify_graphs(runner, graphs, spy: Spy, logs: list) -> None:
    orig_run = graphs.__dict__.setdefault("_unprobed_run", graphs.run)
    count = [0]

    def run(inputs):
        meta = inputs.meta
        n = meta.num_tokens

        def uncaptured():
            tier = graphs._fill(meta)
            with torch.no_grad():
                return graphs._step_fn(tier)()[1]
        count[0] += 1
        tier = next(t for t in graphs.tiers if t >= n)
        counts = list(meta.num_tokens_per_seq)
        return probe_step(runner, spy, inputs, uncaptured, lambda: orig_run(inputs), n,
                          f"{count[0]} (counts {counts} -> tier {tier})", logs)
    graphs.run = run


def verify_scenario(device: str, cache: str, spy: Spy, report: dict) -> None:
    from spec_testutil import oracle_hook, record_logits
    from test_verify_graphs import GREEDY

    prompts = {f"g{k}": [(29 * i + 7 * k) % 120000 + 3 for i in range(n)] for k, n in enumerate((6, 33, 70, 12))}
    off = _verify_llm(cache, False, device, False)
    on = _verify_llm(cache, True, device, True)
    graphs = on.runner.verify_graphs
    logs: list = []
    ref, ref_lg = record_logits(off, prompts, GREEDY)
    _probe_verify_graphs(on.runner, graphs, spy, logs)
    on.runner.speculator.draft_hook = oracle_hook(prompts, ref)
    try:
        got, got_lg = record_logits(on, prompts, GREEDY)
    finally:
        on.runner.speculator.draft_hook = None
    report[f"verify_status@{DTYPE.value}"] = graphs.status
    report[f"verify_checks@{DTYPE.value}"] = dict(graphs.checks)
    runs = [({k: v.token_ids for k, v in ref.items()}, ref_lg), ({k: v.token_ids for k, v in got.items()}, got_lg)]
    _report_runs("verify", prompts, runs, logs, report)


def schedule_scenario(device: str, cache: str, spy: Spy, report: dict, fresh: bool = False) -> None:
    """``fresh``: on a new engine; else on the shared one (after ``verify``, as in the test module)."""
    from test_verify_graphs import SCHEDULE, Requests

    llm = _verify_llm(cache, True, device, True, fresh=fresh)
    runner = llm.runner
    graphs = runner.verify_graphs
    graphs.check_first_replay = False
    logs: list = []
    _probe_verify_graphs(runner, graphs, spy, logs)
    reqs = Requests(llm, prompts=[13, 6, 21, 30])
    name = f"{'schedule_fresh' if fresh else 'schedule'}@{DTYPE.value}"
    print(f"\n== {name} (test_gpu_verify_replay_equals_eager_and_taps; "
          f"{'a new engine' if fresh else 'the engine the verify scenario ran on'}) ==")
    for ids, counts, kept in SCHEDULE:
        inputs = reqs.inputs(ids, counts)
        print(f"  requests {ids} start positions {[reqs.lens[b] for b in ids]} counts {counts}")
        graphs.run(inputs)
        for b, k in zip(ids, kept):
            reqs.lens[b] += k
    graphs.check_first_replay = True
    for e in logs:
        print_entry(e)
    report[name] = logs
    if fresh:
        llm.close()


def _report_runs(name: str, prompts, runs, logs: list, report: dict) -> None:
    (off_tok, off_lg), (on_tok, on_lg) = runs
    name = f"{name}@{DTYPE.value}"
    print(f"\n== {name}: graphs off vs on ==")
    div = []
    for rid in prompts:
        d = first_divergence(rid, off_tok[rid], on_tok[rid], off_lg.get(rid), on_lg.get(rid))
        div.append(d)
        print(f"  {json.dumps(d, default=float)}")
    print(f"  -- graph steps probed from the graph run's state ({len(logs)}); first 3 and every step with a "
          "selection difference, an argmax difference or |dlogits| > 1e-4:")
    for i, e in enumerate(logs):
        if i < 3 or e["selection_diffs"] or e["argmax_differs_rows"] or max(e["uncaptured_vs_eager"]) > 1e-4:
            print_entry(e)
    report[name] = {"first_divergence": div, "steps": logs}


def main() -> None:
    global DTYPE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for divergence.json (default: print only)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtypes", default="float32,float64",
                    help="passes over the scenarios, one per hardware.dtype (float64: no fp32 rounding)")
    ap.add_argument("--scenarios", default="verify,schedule,schedule_fresh,decode,perturb",
                    help="comma list of verify, schedule (on the verify scenario's engine), schedule_fresh, decode, "
                         "perturb (eager twice, the second with perturbed streams)")
    ap.add_argument("--perturb-rel", type=float, default=1e-7)
    ap.add_argument("--perturb-layer", type=int, default=2)
    args = ap.parse_args()
    spy = Spy()
    report: dict = {"device": args.device}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as cache:
        for dt in args.dtypes.split(","):
            DTYPE = DType(dt)
            for s in args.scenarios.split(","):
                t = time.time()
                {"decode": decode_scenario, "verify": verify_scenario, "schedule": schedule_scenario,
                 "schedule_fresh": lambda *a: schedule_scenario(*a, fresh=True),
                 "perturb": lambda *a: perturb_scenario(*a, rel=args.perturb_rel, layer=args.perturb_layer),
                 }[s](args.device, cache, spy, report)
                print(f"  ({s}@{dt}: {time.time() - t:.1f} s)")
            for llm in _LLMS.values():
                llm.close()
            _LLMS.clear()
    print(f"total {time.time() - t0:.1f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "divergence.json").write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
