"""One rank of a test world, started by torchrun (``python -m torch.distributed.run``).

Reads a JSON spec (argv[1]) of scenarios; for each one every rank builds the engine
with that parallel layout (``build_engine`` makes a ``ParallelLLM``), rank 0 drives the
requests through the public API and the other ranks serve. Each rank records the
logits rows it computed per request; rank 0 also writes the outputs and the
per-rank metrics. Results go to ``<out>/rank<r>.pt``.
"""
from __future__ import annotations

import json
import sys

import torch

from redknot.config.schema import (Accelerator, EngineConfig, FeaturesConfig, HardwareConfig, ModelConfig,
                                   SchedulerConfig, SyntheticModelConfig)
from redknot.engine import LLM, SamplingParams, build_engine
from redknot.parallel import serve


def build(spec: dict, sc: dict) -> LLM:
    features = FeaturesConfig(async_scheduling=False)
    features.dspark.method = "mtp" if sc.get("dspark", False) else "none"
    features.dspark.adaptive = False  # random MTP weights: verify every draft anyway
    features.batch_invariant.enabled = sc["batch_invariant"]
    par = features.parallel
    par.dp, par.ep, par.cp = sc["dp"], sc["ep"], sc["cp"]
    if par.cp > 1:
        features.swa_replay.mode = "off"  # context parallel prefills whole prompts on every layer
    par.eplb.enabled = sc.get("eplb", False)
    par.eplb.num_redundant_experts = sc.get("redundant", 0)
    par.eplb.rebalance_interval = sc.get("interval", 1000)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=spec["budget"], long_prefill_chunk=spec["chunk"],
                            block_size=16)
    engine = EngineConfig(scheduler=sched, seed=0, cache_dir=spec["cache_dir"])
    model = ModelConfig(name="parallel-test", max_position=spec["max_len"],
                        sliding_window=spec["arch"]["sliding_window"],
                        synthetic=SyntheticModelConfig(seed=0, architecture=dict(spec["arch"])))
    return build_engine(model, hardware_for(spec), features, engine)


def hardware_for(spec: dict) -> HardwareConfig:
    """CPU (gloo), or with ``spec["cuda"]`` one CUDA device per rank (NCCL), reference kernels, fp32."""
    if not spec.get("cuda"):
        return HardwareConfig()
    return HardwareConfig(name="cuda-reference", accelerator=Accelerator.cuda, cuda_graphs=False)


def record(llm, store: dict) -> None:
    """Keep the logits rows this rank computes, per request (the DP leader's copy is enough)."""
    runner = llm.runner
    runner.record_logits = True
    real = runner.execute

    def spy(batch):
        out = real(batch)
        for rid, rows in (out.logits or {}).items():
            store.setdefault(rid, []).append(rows.clone())
        return out

    runner.execute = spy


def drive(llm, sc: dict, prompts: dict, max_tokens: int) -> dict:
    """Rank 0: staggered adds (half now, half after two steps), optional abort, step to the end."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    names = list(prompts)
    first, later = names[:len(names) // 2 + 1], names[len(names) // 2 + 1:]
    for rid in first:
        llm.add_request(rid, prompts[rid], params)
    done, steps = {}, 0
    while llm.has_unfinished_requests() or later:
        if steps == 2:
            for rid in later:
                llm.add_request(rid, prompts[rid], params)
            later = []
            if sc.get("abort"):
                llm.abort(sc["abort"])
        if steps == 3 and sc.get("rebalance_now"):
            llm.parallel.request_rebalance()
        for out in llm.step():
            if out.finished:
                done[out.req_id] = {"tokens": out.token_ids, "reason": out.finish_reason}
        steps += 1
    return done


def drive_runner(llm, sc: dict, prompts: dict, max_tokens: int) -> dict:
    """Rank 0: the harness's runner (per-rank admission) over the prompts."""
    from redknot.bench.runner import CaseJob, Runner
    from redknot.bench.suite import CaseEntry

    jobs = [CaseJob(CaseEntry(case_id=rid, dataset="test", kind="test", row_index=i, row_id=rid, source="",
                              source_sha256="", question="", answers=(), metric="exact", first_line_only=False,
                              max_new_tokens=max_tokens, num_tokens=len(ids), ids_sha256="", gold_spans=(),
                              gold_truncated=False, depths=(), distractors=(), num_filler_blocks=0), ids)
            for i, (rid, ids) in enumerate(prompts.items())]
    runner = Runner(llm, lambda n: SamplingParams(max_tokens=n, ignore_eos=True), sc["admission"], sc["dp"])
    done = {}
    runner.run(jobs, lambda o: done.__setitem__(o.entry.case_id, {
        "tokens": o.output.token_ids, "reason": o.output.finish_reason, "dp_rank": o.dp_rank, "status": o.status}))
    return done


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    torch.set_num_threads(1)
    results = {}
    rank = None
    for sc in spec["scenarios"]:
        llm = build(spec, sc)
        rank = llm.parallel.layout.rank
        logits: dict = {}
        record(llm, logits)
        entry = {"logits": logits}
        if rank == 0:
            drive_fn = drive_runner if sc.get("admission") else drive
            entry["outputs"] = drive_fn(llm, sc, spec["prompts"], spec["max_tokens"])
            entry["owner"] = dict(llm.parallel.dp.router.owner_history)
            entry["peak_active"] = list(llm.parallel.dp.router.peak_active)
            entry["metrics"] = llm.parallel.rank_metrics()
            stats = llm.stats()
            entry["stats"] = {"finished": stats.num_requests_finished, "drafts": stats.num_draft_proposed}
        else:
            serve(llm)
        entry["placements"] = [list(p.phys_to_logical) for p in llm.parallel.ep.placements()] if llm.parallel.ep else []
        llm.close()
        llm.parallel.destroy()
        results[sc["name"]] = entry
    torch.save(results, f"{spec['out']}/rank{rank}.pt")


if __name__ == "__main__":
    main()
