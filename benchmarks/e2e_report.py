"""Floors and the printed / saved tables of ``benchmarks/e2e_cut.py``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

from redknot.models.deepseek_v4.cost import H200, CostModel


def decode_floor(cost: CostModel, context: int, batch: int) -> float:
    """Bandwidth/compute floor of one decode step of ``batch`` sequences at ``context``: the cost model's
    batch-1 bytes, plus the routed experts the extra tokens activate (uniform routing: E·(1-(1-k/E)^B)
    distinct experts per layer), every sequence's own cache reads, and the lm_head weights once."""
    cfg = cost.cfg
    one = cost.decode(context, weight_bytes=2.0, kv_bytes=2.0)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = e * (1.0 - (1.0 - k / e) ** batch)
    expert_bytes = 3.0 * cfg.hidden_size * cfg.moe_intermediate_size * 2.0
    head = cfg.vocab_size * cfg.hidden_size * 2.0
    nbytes = one.weight_bytes + len(cfg.layer_types) * (distinct - k) * expert_bytes + batch * one.kv_bytes + head
    flops = batch * (one.flops + 2.0 * cfg.vocab_size * cfg.hidden_size)
    return max(nbytes / H200.hbm_bytes_per_s, flops / H200.bf16_flops)


def _x(v, fmt: str, none: str = "—") -> str:
    return none if v is None else format(v, fmt)


def _speedup(v) -> str:
    return f"{v:7.1f}x" if v else "—"


def tables(res: dict) -> List[str]:
    lines = [f"# {res['env'][0]}"]
    for t in res["tiny"]:
        lines.append(f"tiny model (fp32, every layer type): greedy tokens, triton on the device vs reference on the "
                     f"CPU, prompts {t['prompts']} x {t['new_tokens']} tokens: {'EQUAL' if t['equal'] else 'DIFFERENT'}")
    checks = [p for p in res["parity"] if p["path"] == "check"]
    secs = {(p["n"], p["path"]): p["seconds"] for p in res["parity"] if "seconds" in p}
    if secs:
        lines += ["", "parity (bf16 cut, one prefill step, logits of 64 rows; row = mean ||a-b||/||b||; "
                      "criterion: triton vs fp32 <= 1.5 x reference vs fp32 + 5e-3)",
                  f"{'tokens':>7} {'ref s':>7} {'triton s':>8} {'row t-vs-r':>10} {'top1 t-r':>8} "
                  f"{'row r-vs-fp32':>13} {'row t-vs-fp32':>13} {'tol':>9} ok"]
        for n in sorted({n for n, _ in secs}):
            c = next((p for p in checks if p["n"] == n), None)
            lines.append(f"{n:>7} {_x(secs.get((n, 'reference')), '7.3f')} {_x(secs.get((n, 'triton')), '8.3f')} "
                         + (f"{c['row_err_triton_vs_ref']:10.2e} {100 * c['top1_triton_vs_ref']:7.1f}% "
                            f"{c['row_err_ref_vs_fp32']:13.2e} {c['row_err_triton_vs_fp32']:13.2e} {c['tol']:9.2e} "
                            f"{'ok' if c['ok'] else 'FAIL'}" if c else "(no fp32 truth)"))
    if res["prefill"]:
        lines += ["", f"prefill (chunked; floor = cost model at {H200.bf16_flops / 1e12:.0f} TFLOP/s bf16; "
                      "HF = transformers on the same cut)",
                  f"{'context':>7} {'chunk':>6} {'time s':>8} {'TFLOP/s':>8} {'floor s':>8} {'% roof':>7} "
                  f"{'HF s':>6} {'speedup':>8} {'peak GiB':>8} {'last chunk ms':>13}"]
        for p in res["prefill"]:
            lines.append(f"{p['n']:>7} {p['chunk']:>6} {p['seconds']:8.3f} {p['tflops']:8.1f} {p['floor_s']:8.3f} "
                         f"{100 * p['roof']:6.1f}% {_x(p['hf_s'], '6.2f'):>6} {_speedup(p['speedup']):>8} "
                         f"{p['peak_gib']:8.1f} {1e3 * p['last_chunk_s']:13.1f}")
    if res["decode"]:
        lines += ["", f"decode step (mean of 8 steps, eager and replayed from a CUDA graph, each step synced; b2b: 8 "
                      f"replays back to back, inputs copied on the device; floor = weights + caches read once at "
                      f"{H200.hbm_bytes_per_s / 1e12:.2f} TB/s)",
                  f"{'context':>7} {'batch':>5} {'step ms':>8} {'min-max ms':>13} {'floor ms':>8} {'% roof':>7} "
                  f"{'tok/s':>8} {'HF ms':>6} {'speedup':>8} {'graph ms':>8} {'% roof':>7} {'graph err':>9} "
                  f"{'b2b ms':>7} {'% roof':>7}"]
        for d in res["decode"]:
            spread = f"{1e3 * d.get('min_s', d['step_s']):.1f}-{1e3 * d.get('max_s', d['step_s']):.1f}"
            lines.append(f"{d['n']:>7} {d['batch']:>5} {1e3 * d['step_s']:8.2f} {spread:>13} {1e3 * d['floor_s']:8.3f} "
                         f"{100 * d['roof']:6.1f}% {d['tokens_per_s']:8.0f} {_x(d['hf_s'] and 1e3 * d['hf_s'], '6.1f'):>6} "
                         f"{_speedup(d['speedup']):>8} {_x(d.get('graph_step_s') and 1e3 * d['graph_step_s'], '8.2f'):>8} "
                         f"{_x(d.get('graph_roof') and 100 * d['graph_roof'], '6.1f'):>6}% "
                         f"{_x(d.get('graph_row_err'), '9.2e'):>9} "
                         f"{_x(d.get('graph_b2b_s') and 1e3 * d['graph_b2b_s'], '7.2f'):>7} "
                         f"{_x(d.get('graph_b2b_roof') and 100 * d['graph_b2b_roof'], '6.1f'):>6}%")
    if res["ops"]:
        lines += ["", "time per registry op in one step (CUDA events; share of the step's wall time)"]
        for case in dict.fromkeys(o["case"] for o in res["ops"]):
            ops = [o for o in res["ops"] if o["case"] == case]
            lines.append(f"  {case}: " + ", ".join(f"{o['op']} {o['ms']:.2f} ms ({100 * o['share']:.0f}%, "
                                                    f"{o['calls']}x)" for o in ops))
    lines += [f"# skipped (budget): {res['skipped']}"] if res["skipped"] else []
    lines += [f"# ERROR {e}" for e in res["errors"]]
    return lines


def tuned_lines() -> List[str]:
    """The launch shape each Triton kernel class chose, and every candidate's median ms."""
    try:
        from redknot.kernels.triton import attention, fp8, gemv_bf16, indexer
    except ImportError:
        return []
    lines = []
    for tuner in (attention.ATTN_TUNER, attention.ATTN_DECODE_TUNER, attention.ATTN_PREFILL_TUNER,
                  indexer.INDEXER_TUNER, fp8.GEMM_TUNER, gemv_bf16.LINEAR_SMALL_TUNER, gemv_bf16.MOE_SMALL_TUNER,
                  gemv_bf16.GROUPED_SMALL_TUNER):
        for key, best in tuner.choices.items():
            cands = ", ".join(f"{_short(c)} {ms:.3f}" for c, ms in tuner.timings.get(key, []))
            fails = len(tuner.failures.get(key, []))
            timed = f" timed as {tuner.timed_as[key]}" if key in tuner.timed_as else ""
            lines.append(f"# tuned {tuner.name} {key}: {_short(best)} [{cands}]{timed}"
                         + (f" ({fails} failed)" if fails else ""))
    return lines


def _short(cfg) -> str:
    """A launch shape as its field values joined by '/', or a named choice (a string) as it is."""
    return cfg if isinstance(cfg, str) else "/".join(f"{v}" for v in vars(cfg).values())


def save_partial(run) -> None:
    """Write what has been measured so far (a run cut short still leaves its numbers)."""
    if run.args.out:
        out = Path(run.args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e.json").write_text(json.dumps(run.results, indent=1, default=str))


def report(run) -> int:
    res = run.results
    lines = tables(res) + tuned_lines() + [f"# total {run.elapsed():.0f} s"]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    if run.args.out:
        out = Path(run.args.out)
        save_partial(run)
        (out / "e2e.txt").write_text(text + "\n")
        rows = ["kind,context,batch,seconds,floor_s,roof,hf_s,speedup,peak_gib,graph_seconds,graph_roof,"
                "graph_b2b_seconds,graph_b2b_roof"]
        rows += [f"prefill,{p['n']},1,{p['seconds']},{p['floor_s']},{p['roof']},{p['hf_s'] or ''},"
                 f"{p['speedup'] or ''},{p['peak_gib']},,,," for p in res["prefill"]]
        rows += [f"decode,{d['n']},{d['batch']},{d['step_s']},{d['floor_s']},{d['roof']},{d['hf_s'] or ''},"
                 f"{d['speedup'] or ''},,{d.get('graph_step_s', '')},{d.get('graph_roof', '')},"
                 f"{d.get('graph_b2b_s', '')},{d.get('graph_b2b_roof', '')}" for d in res["decode"]]
        (out / "e2e.csv").write_text("\n".join(rows) + "\n")
    bad_parity = any(p["path"] == "check" and not p["ok"] for p in res["parity"])
    bad_tiny = any(not t["equal"] for t in res["tiny"])
    return 1 if res["errors"] or bad_parity or bad_tiny else 0
