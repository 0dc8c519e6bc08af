"""What both DSpark benchmark cuts (``dspark.py``: V4-0731, ``dspark_v41.py``: V4.1) time with: a median of
synchronised calls, one drafting step, the verification maths and the scheduler, and the run's clock
(phases and ``--budget-s``) and tuner log."""
from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import torch

from redknot.sample import SamplingRow
from redknot.sample.params import SamplingParams
from redknot.speculative.draft_sampling import MarkovSampler
from redknot.speculative.profile import time_once_ms
from redknot.speculative.rejection import block_sample, speculative_sample
from redknot.speculative.schedule import CostModel, CostTable, VerifyScheduler


def timed_ms(device: torch.device, fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(time_once_ms(device, fn) for _ in range(repeats))


@torch.no_grad()
def draft_step(d, drafter, sampler, batch: int, context: int, forward=None) -> None:
    """One drafting step of ``batch`` requests: the stages' block forward (the block attention of
    ``features.dspark.block_attention``; ``forward(anchors, positions, slots)``: a replayed one), the
    Markov chain, the confidences (read back)."""
    device = d.device
    # a different anchor per request: identical rows would all route to the same experts
    anchors = 7 + torch.arange(batch, dtype=torch.long, device=device)
    positions = torch.full((batch,), context, dtype=torch.long, device=device)
    slots = torch.arange(batch, dtype=torch.long, device=device)
    if forward is None:
        h, base = d.forward_block(anchors, positions, drafter.rings, slots, drafter.causal)
    else:
        h, base = forward(anchors, positions, slots)
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=1.0), seed=i, output_index=0) for i in range(batch)]
    blocks = MarkovSampler(sampler, "greedy").sample(base, d.markov_bias, anchors, rows, [context + 1] * batch)
    tokens = torch.tensor([b.token_ids for b in blocks], device=device)
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
    torch.sigmoid(d.confidence_logits(h, prev)).tolist()


def bench_verify_math(bench, batch: int, q: int, repeats: int) -> Dict[str, float]:
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



class Clock:
    """Seconds since the run started, phases timed with the device synchronised (each printed as it
    ends, so a run stopped from outside still says where its time went), and ``--budget-s``: a case
    that would start past it is skipped with the reason instead of the run being killed."""

    def __init__(self, device: torch.device, budget_s: float):
        self.device, self.budget_s = device, budget_s
        self.t0 = time.perf_counter()
        self.phases: Dict[str, float] = {}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str):
        self.sync()
        t = time.perf_counter()
        yield
        self.sync()
        self.phases[name] = round(time.perf_counter() - t, 2)
        print(json.dumps({"phase": name, "s": self.phases[name], "at_s": round(self.now(), 1)}), flush=True)

    def skip(self, need_s: float = 0.0) -> Optional[str]:
        """The reason to skip a case expected to take ``need_s`` seconds, or None to run it."""
        if self.now() + need_s <= self.budget_s:
            return None
        more = f"~{need_s:.0f} s more would pass" if need_s else "past"
        return f"skipped: at {self.now():.0f} s, {more} --budget-s {self.budget_s:g}"


class TunerLog:
    """Seconds the kernels' launch-configuration tuners (``ConfigTuner``: every candidate compiled and
    timed on the first call of a problem class) spend, per tuner: the part of a first call that is not
    the step's own work."""

    def __init__(self):
        from redknot.kernels.triton._common import ConfigTuner

        self.cls, self.orig = ConfigTuner, ConfigTuner.pick
        self.seconds: Dict[str, float] = {}
        self.classes: Dict[str, int] = {}
        log = self

        def pick(tuner, key, run, device):
            if key in tuner.choices:
                return log.orig(tuner, key, run, device)
            t = time.perf_counter()
            try:
                return log.orig(tuner, key, run, device)
            finally:
                log.seconds[tuner.name] = log.seconds.get(tuner.name, 0.0) + time.perf_counter() - t
                log.classes[tuner.name] = log.classes.get(tuner.name, 0) + 1
        ConfigTuner.pick = pick

    def close(self) -> None:
        self.cls.pick = self.orig

    def summary(self) -> Dict[str, Dict[str, float]]:
        return {k: {"classes": self.classes[k], "s": round(v, 2)} for k, v in sorted(self.seconds.items())}


def timed_cell(clock: Clock, fn: Callable[[], object], repeats: int, warmup: int, cap_s: float) -> Dict:
    """Median ms of up to ``repeats`` calls after ``warmup`` (the first warm-up call's seconds reported:
    it compiles and tunes new shapes), stopping early once the cell has spent ``cap_s`` seconds (at
    least one timed call)."""
    t = time.perf_counter()
    first_s = None
    for i in range(warmup):
        s = time_once_ms(clock.device, fn) / 1e3
        first_s = s if i == 0 else first_s
    times: List[float] = []
    while len(times) < repeats and (not times or time.perf_counter() - t < cap_s):
        times.append(time_once_ms(clock.device, fn))
    out = {"ms": round(statistics.median(times), 3), "n": len(times)}
    if first_s is not None:
        out["first_s"] = round(first_s, 2)
    return out
