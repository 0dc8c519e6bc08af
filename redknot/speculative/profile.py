"""Start-up profiling of the verify and draft costs (``features.dspark.budget=profile``).

Verify cost by target tokens: the target forward + logits of a step whose n tokens are spread
over min(n, max_num_seqs) requests, timed at every tier the verify steps use
(:func:`redknot.speculative.schedule.profile_sizes`). With verify graphs captured
(:class:`redknot.speculative.varlen.VerifyGraphs`) a size a tier holds is timed as what the engine runs
then, the replay of that tier's graph; sizes above the last captured tier (or every size without
graphs) as the eager forward, and the table's capture limit is the last captured tier. Draft cost by
requests: the drafter's work for R requests. Rows go to the engine's spare slot and block (the ones padding rows of
captured graphs use), so no request's state is touched. Each size is timed ``repeats`` times
and the median kept; the contexts are short (one block), so long-context attention cost is
under-counted: a ``budget=file`` table measured on the real workload is the better input there.
"""
from __future__ import annotations

import time
from typing import Callable, List

import torch

from redknot.speculative.schedule import CostModel, CostTable, profile_costs, profile_sizes
from redknot.step.metadata import StepMetadata


def time_once_ms(device: torch.device, fn: Callable[[], object]) -> float:
    """Milliseconds of one call of ``fn``; on CUDA the device is synchronised before and after, so
    the time covers the kernels ``fn`` queued and not only their launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - t0)


def _verify_meta(runner, n: int, max_num_seqs: int, max_query: int) -> StepMetadata:
    """A verify step of n rows over min(n, max_num_seqs) requests, all on the spare slot and block."""
    reqs = min(n, max_num_seqs)
    counts = [n // reqs + (1 if i < n % reqs else 0) for i in range(reqs)]
    context = max(0, runner.layout.block_size - max_query)  # the query rows stay inside the spare block
    tokens: List[List[int]] = [[1] * c for c in counts]
    return StepMetadata.build(tokens, [context] * reqs, [runner.padding_slot] * reqs,
                              [[runner.padding_block]] * reqs, logits_indices=list(range(n)), device=runner.device)


def verify_graphs_on(runner):
    """The runner's captured verify graphs when they serve steps (else None)."""
    graphs = getattr(runner, "verify_graphs", None)
    return graphs if graphs is not None and graphs.disabled_reason is None and graphs.graphs else None


def _verify_step(runner, n: int, max_num_seqs: int, max_query: int) -> Callable[[], None]:
    """The work of a verify step of n rows as the engine would run it: the replay of its tier's graph
    when verify graphs serve it (padding is physical: the tier's cost), else the eager forward + logits."""
    meta = _verify_meta(runner, n, max_num_seqs, max_query)
    graphs = verify_graphs_on(runner)
    if graphs is not None and graphs.fits(meta):
        return lambda: graphs.replay_only(meta)

    @torch.no_grad()
    def run() -> None:
        streams = runner.model.forward(meta, runner.state)
        runner.model.compute_logits(streams[meta.logits_indices])
    return run


def profile_cost_model(runner, speculator, max_num_seqs: int, max_tokens: int, repeats: int = 5,
                       coarse: bool = False) -> CostModel:
    """The verify and draft cost tables of this engine (see the module docstring); ``coarse``:
    fewer sizes (eager decode, where no graph pads a step to a tier)."""
    device = runner.device
    max_draft = speculator.cfg.max_draft
    sizes = profile_sizes(max_num_seqs, max_draft, max_tokens, coarse)
    drafter = speculator.drafter
    _verify_step(runner, 1, max_num_seqs, max_draft + 1)()  # first calls pay one-off set-up costs
    drafter.dry_run(1, runner.padding_slot, runner.padding_block)
    verify = profile_costs(lambda n: time_once_ms(device, _verify_step(runner, n, max_num_seqs, max_draft + 1)),
                           sizes, repeats)
    req_sizes = sorted({1, max_num_seqs} if coarse else {min(s, max_num_seqs) for s in sizes})
    draft = profile_costs(
        lambda r: time_once_ms(device, lambda: drafter.dry_run(r, runner.padding_slot, runner.padding_block)),
        req_sizes, repeats)
    graphs = verify_graphs_on(runner)
    limit = sizes[-1] if graphs is None else min(sizes[-1], graphs.tiers[-1])  # eager above the last tier
    return CostModel(CostTable(verify, limit), CostTable(draft))
