"""Sections of ``benchmarks/e2e_cut.py``: the cut model, a multi-slot driver over its paged state, the
parity, prefill and decode measurements. Results accumulate in ``Run.results``; ``e2e_report`` prints them."""
from __future__ import annotations

import gc
import random
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

import torch

from e2e_report import decode_floor, report, save_partial  # noqa: F401  (report: used by e2e_cut)
from redknot.kernels import KernelSet
from redknot.models.deepseek_v4.cost import CostModel
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.single import SingleSequence
from redknot.models.deepseek_v4.state import V4State
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.models.deepseek_v4.synthetic import TINY_ARCHITECTURE, randomize_, synthetic_config
from redknot.step.metadata import StepMetadata
from redknot.kernels.capture import cuda_graph

HF_PREFILL_S = {8192: 0.451, 32768: 1.63, 65536: 4.24, 131072: 12.7}  # transformers, same cut (performance.md)
HF_DECODE_S = {8192: 0.0187}
SLOT_FIELDS = ("swa", "kv_rows", "gate_rows", "idx_kv_rows", "idx_gate_rows")  # [S, ...] per-sequence storage
BLOCK_FIELDS = ("entries", "idx_keys")  # [NB, ...] paged storage
DECODE_WARM, DECODE_TIMED = 2, 8  # 8 steps: CSA windows (ratio 4) close in a quarter of them


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton interpreter)"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


class Run:
    """Arguments, device, clock and collected results of one benchmark run."""

    def __init__(self, args, dev: torch.device):
        self.args, self.dev = args, dev
        self.t0 = time.perf_counter()
        self.results: Dict[str, list] = {k: [] for k in ("tiny", "parity", "prefill", "decode", "ops", "skipped",
                                                         "errors")}
        self.logits: Dict[tuple, torch.Tensor] = {}
        self.warmed: set = set()   # the indexer's prefill tuning classes already met (``prefill_sweep``)
        self.results["env"] = [dict(device=device_name(dev), torch=torch.__version__, smoke=bool(args.smoke))]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def over_budget(self, what: str) -> bool:
        if self.elapsed() > self.args.budget_s:
            self.results["skipped"].append(what)
            self.log(f"SKIP {what}: time budget ({self.args.budget_s:.0f} s) spent")
            return True
        return False

    def section(self, name: str, fn: Callable[[], Optional[int]]) -> int:
        if self.over_budget(name):
            return 0
        self.log(f"== {name}")
        try:
            return int(fn() or 0)
        except Exception as exc:  # one broken section is reported; the others still run
            traceback.print_exc()
            self.results["errors"].append(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            free(self.dev)
            return 1
        finally:
            save_partial(self)

    def timed(self, fn: Callable[[], object]) -> tuple:
        sync(self.dev)
        t = time.perf_counter()
        out = fn()
        sync(self.dev)
        return out, time.perf_counter() - t


class OpTimer:
    """Stands in for a KernelSet and times every registry op call (CUDA events; host clock on the CPU)."""

    def __init__(self, ks: KernelSet, dev: torch.device):
        self._ks, self._dev = ks, dev
        self.marks: Dict[str, list] = {}

    def __getattr__(self, op: str):
        fn = getattr(self._ks, op)
        if not callable(fn):  # the kernel set's own attributes (``choice``, ``default``): as they are
            return fn

        def timed(*a, **k):
            if self._dev.type == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn(*a, **k)
                e.record()
            else:
                s, out, e = time.perf_counter(), fn(*a, **k), time.perf_counter()
            self.marks.setdefault(op, []).append((s, e))
            return out
        return timed

    def totals_ms(self) -> Dict[str, tuple]:
        sync(self._dev)
        cuda = self._dev.type == "cuda"
        return {op: (sum(s.elapsed_time(e) if cuda else (e - s) * 1e3 for s, e in m), len(m))
                for op, m in self.marks.items()}


class CutDriver:
    """Sequences over one paged state: sequence i uses slot i; ``fork`` copies sequence 0 into the others
    (shared prefix blocks, private copies of the blocks a decode step may still write, copied slots)."""

    def __init__(self, model: DeepseekV4, num_seqs: int, max_tokens: int, fork_steps: int = 0, block_size: int = 256):
        cfg = model.cfg
        self.model = model
        self.layout = StateLayout.create(cfg, block_size=block_size, kv_bytes=torch.empty((), dtype=model.dtype
                                                                                          ).element_size())
        self.fork_reach = max(cfg.ratios) if cfg.ratios else 1
        self.nb0 = self.layout.blocks_for(max_tokens)
        per_fork = (self.fork_reach + fork_steps) // block_size + 2  # >= the count of _tail_blocks
        self.state = V4State.allocate(cfg, self.layout, num_seqs, self.nb0 + (num_seqs - 1) * per_fork,
                                      model.device, model.dtype)
        self.tables: List[List[int]] = [list(range(self.nb0))]
        self.ctx: List[int] = [0]

    def _tail_blocks(self, ctx: int, steps: int) -> tuple:
        """(first block a step at ctx.. may write: a window closing at ctx+j starts >= ctx - ratio + 1, count)."""
        bs = self.layout.block_size
        first = max(0, ctx - self.fork_reach) // bs
        return first, (max(ctx + steps, 1) - 1) // bs - first + 1

    def meta(self, tokens: Sequence[Sequence[int]], seqs: Sequence[int]) -> StepMetadata:
        # Tables padded to a multiple of 16 blocks: Triton specialises kernels on strides divisible by 16, so
        # every context then runs the same compiled kernels (the padding entries are never read).
        tables = [t + [t[-1]] * (-len(t) % 16) for t in (self.tables[s] for s in seqs)]
        return StepMetadata.build([list(t) for t in tokens], [self.ctx[s] for s in seqs], list(seqs), tables,
                                  device=self.model.device)

    def run(self, meta: StepMetadata, seqs: Sequence[int]) -> torch.Tensor:
        """One step; -> fp32 logits of each sequence's last row."""
        streams = self.model(meta, self.state)
        for s, n in zip(seqs, meta.num_tokens_per_seq):
            self.ctx[s] += n
        return self.model.compute_logits(streams[meta.logits_indices])

    def prefill(self, ids: Sequence[int], chunk: int, on_chunk: Optional[Callable] = None) -> torch.Tensor:
        logits = None
        for a in range(0, len(ids), chunk):
            logits = self.run(self.meta([ids[a:a + chunk]], [0]), [0])
            if on_chunk is not None:
                on_chunk(a)
        return logits

    @torch.no_grad()
    def fork(self, copies: int, steps: int) -> None:
        ctx = self.ctx[0]
        first, count = self._tail_blocks(ctx, steps)
        src = self.tables[0][first:first + count]
        nxt = self.nb0
        for i in range(1, copies + 1):
            priv = list(range(nxt, nxt + count))
            nxt += count
            for st in self.state.layers:
                for name in BLOCK_FIELDS:
                    t = getattr(st, name)
                    if t is not None:
                        t[priv] = t[src]
                for name in SLOT_FIELDS:
                    t = getattr(st, name)
                    if t is not None:
                        t[i] = t[0]
            self.tables.append(self.tables[0][:first] + priv)
            self.ctx.append(ctx)


def cut_model(run: Run, dtype: torch.dtype) -> DeepseekV4:
    """The 3-layer cut of ``benchmarks/model_reference.py`` with seed-0 synthetic weights (the same draws in
    every dtype, so the bf16 model is the rounding of the fp32 one)."""
    from model_reference import cut_config
    cfg = cut_config(run.args.smoke, 16 if run.args.smoke else 256)
    if run.args.smoke:  # interpreter-sized: a short top-k list and sliding window
        cfg = cfg.with_overrides({"index_topk": 16, "sliding_window": 32})
    model, secs = run.timed(lambda: DeepseekV4(cfg, dtype, device=run.dev, with_mtp=False))
    _, secs2 = run.timed(lambda: randomize_(model, seed=0))
    fused = 0 if getattr(run.args, "unfused_projections", False) else model.fuse_projections()
    run.log(f"cut model {dtype}: {model.num_parameters() / 1e9:.2f} B parameters, built in {secs + secs2:.1f} s; "
            f"projection groups save {fused} linear launches a step")
    return model


def build_cut(run: Run, dtype: torch.dtype) -> DeepseekV4:
    model = cut_model(run, dtype)
    model.set_kernels(KernelSet(default=run.args.backend))
    # Compile, and tune launch shapes on a full-size prefill chunk; then decode steps of 2 and 1 sequences,
    # the first at a position that closes a CSA and an HCA window (the compressors' decode-time shapes).
    # A full chunk first: the sweep's first context is then timed without the compilations and tuning of a
    # chunk one row longer than the warm-up's below.
    n = min(max(8192, run.args.chunk), max(list(run.args.prefill) + list(run.args.decode) or [8192]))
    full = CutDriver(model, 1, n)
    full.prefill(random_ids(n, model.cfg.vocab_size, 2), min(run.args.chunk, n))
    del full
    n -= 1
    warm = CutDriver(model, 2, n + 4, fork_steps=2)
    warm.prefill(random_ids(n, model.cfg.vocab_size, 1), min(run.args.chunk, n))
    warm.fork(1, 2)
    warm.run(warm.meta([[5], [6]], [0, 1]), [0, 1])
    warm.run(warm.meta([[7]], [0]), [0])
    sync(run.dev)
    if run.args.backend != "reference":
        run.warmed |= _entry_classes(model.cfg, n + 1, min(run.args.chunk, n + 1))
    run.log("warm-up done (Triton kernels compiled, launch shapes tuned)")
    return model


def random_ids(n: int, vocab: int, seed: int) -> List[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def tiny_greedy(run: Run) -> int:
    """Greedy tokens of the tiny fp32 model: Triton kernels on the run's device vs the reference on the CPU
    (first launch shapes, untuned: this is a correctness check)."""
    from redknot.kernels.triton._common import ConfigTuner
    ConfigTuner.enabled = False
    try:
        return _tiny_greedy(run)
    finally:
        ConfigTuner.enabled = True


def _tiny_greedy(run: Run) -> int:
    cfg = synthetic_config(TINY_ARCHITECTURE, quantize_fp8=False)
    ref = DeepseekV4(cfg, torch.float32, device="cpu", kernels=KernelSet(), with_mtp=False)
    randomize_(ref, seed=0)
    fast = DeepseekV4(cfg, torch.float32, device=run.dev, kernels=KernelSet(default=run.args.backend), with_mtp=False)
    fast.load_state_dict(ref.state_dict())
    fast.fuse_projections()  # the engine's model: build_model fuses the projection groups
    lengths, new = ((150,), 2) if run.args.smoke else ((300, 517, 700), 8)
    out = {}
    for name, model in (("reference", ref), ("triton", fast)):
        out[name] = [_greedy(model, random_ids(n, cfg.vocab_size, n), new, chunk=128 if i == 1 else n)
                     for i, n in enumerate(lengths)]
    equal = out["reference"] == out["triton"]
    run.results["tiny"].append(dict(prompts=list(lengths), new_tokens=new, equal=equal, **out))
    run.log(f"tiny greedy: {'equal' if equal else 'DIFFERENT'} ({len(lengths)} prompts x {new} tokens)")
    return 0 if equal else 1


def _greedy(model: DeepseekV4, ids: List[int], new: int, chunk: int) -> List[int]:
    seq = SingleSequence(model, len(ids) + new, shuffle_blocks=1)
    for a in range(0, len(ids), chunk):
        _, logits = seq.step(ids[a:a + chunk])
    toks = [int(logits[-1].argmax())]
    for _ in range(new - 1):
        _, logits = seq.step([toks[-1]])
        toks.append(int(logits[-1].argmax()))
    return toks


def _rows_logits(run: Run, model: DeepseekV4, ids: List[int]) -> tuple:
    """One prefill step of ``ids``; -> (fp32 logits of 64 spread rows on the CPU, seconds)."""
    n = len(ids)
    rows = sorted({int(round(i * (n - 1) / 63)) for i in range(64)})
    drv = CutDriver(model, 1, n)
    meta = drv.meta([ids], [0])
    meta = StepMetadata.build([ids], [0], [0], [meta.block_tables[0].tolist()], rows, device=run.dev)
    logits, secs = run.timed(lambda: drv.run(meta, [0]))
    return logits.cpu(), secs


def parity_bf16(run: Run, model: DeepseekV4) -> None:
    for n in run.args.parity:
        ids = random_ids(n, model.cfg.vocab_size, n)
        for name, ks in (("reference", KernelSet()), ("triton", KernelSet(default=run.args.backend))):
            model.set_kernels(ks)
            run.logits[(n, name)], secs = _rows_logits(run, model, ids)
            run.results["parity"].append(dict(n=n, path=name, seconds=secs))
        model.set_kernels(KernelSet(default=run.args.backend))
        run.log(f"parity {n}: row error triton vs reference "
                f"{row_err(run.logits[(n, 'triton')], run.logits[(n, 'reference')]):.2e}")
        free(run.dev)


def parity_truth(run: Run) -> None:
    if run.dev.type == "cuda":
        free_b, _ = torch.cuda.mem_get_info(run.dev)
        need = 4.0 * 21e9 * (0.01 if run.args.smoke else 1.0) + 8 * 2**30  # fp32 cut + activations
        if free_b < need:
            raise RuntimeError(f"fp32 truth needs ~{need / 2**30:.0f} GiB free, {free_b / 2**30:.0f} GiB are")
    model = cut_model(run, torch.float32)
    model.set_kernels(KernelSet())
    for n in run.args.parity:
        if (n, "triton") not in run.logits or run.over_budget(f"fp32 truth {n}"):
            continue
        truth, _ = _rows_logits(run, model, random_ids(n, model.cfg.vocab_size, n))
        ref, fast = run.logits[(n, "reference")], run.logits[(n, "triton")]
        e_ref, e_fast = row_err(ref, truth), row_err(fast, truth)
        tol = 1.5 * e_ref + 5e-3
        run.results["parity"].append(dict(n=n, path="check", row_err_triton_vs_ref=row_err(fast, ref),
                                          top1_triton_vs_ref=top1(fast, ref), row_err_ref_vs_fp32=e_ref,
                                          row_err_triton_vs_fp32=e_fast, top1_triton_vs_fp32=top1(fast, truth),
                                          tol=tol, ok=e_fast <= tol))
        run.log(f"parity {n}: vs fp32 truth: reference bf16 {e_ref:.2e}, triton bf16 {e_fast:.2e} (tol {tol:.2e})")
    del model
    free(run.dev)


def row_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of ||a - b|| / ||b||."""
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=-1) / b.norm(dim=-1)).mean())


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


def prefill_sweep(run: Run, model: DeepseekV4, decode: bool = True) -> None:
    """Chunked prefill at each context; at the decode contexts, fork and time decode steps too."""
    cost = CostModel(model.cfg)
    bmax = max(run.args.batches)
    # eager, op-timed and graph steps (synced one by one, then back to back)
    steps = len(run.args.batches) * (2 * (DECODE_WARM + DECODE_TIMED) + DECODE_TIMED + 3)
    decode_at = set(run.args.decode) if decode else set()
    for n in run.args.prefill + [c for c in sorted(decode_at) if c not in run.args.prefill]:
        if run.over_budget(f"prefill {n}"):
            continue
        free(run.dev)
        if run.dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(run.dev)
        decode = n in decode_at
        drv = CutDriver(model, bmax if decode else 1, n + (steps if decode else 0), fork_steps=steps)
        ids = random_ids(n, model.cfg.vocab_size, n)
        new_classes = set() if run.args.backend == "reference" else _entry_classes(model.cfg, n, run.args.chunk)
        new_classes -= run.warmed
        if new_classes:
            # the indexer tunes prefill chunks per stream length: an untimed pass first, so the timed one below
            # neither times candidates nor compiles; it rewrites the same state with the same values
            run.warmed |= new_classes
            _, secs = run.timed(lambda: drv.prefill(ids, run.args.chunk))
            drv.ctx[0] = 0
            run.log(f"prefill {n}: untimed pass for indexer classes {sorted(new_classes)} ({secs:.1f} s)")
        chunk_s: List[float] = []
        mark = [time.perf_counter()]

        def on_chunk(_a):
            sync(run.dev)
            now = time.perf_counter()
            chunk_s.append(now - mark[0])
            mark[0] = now
        _, secs = run.timed(lambda: drv.prefill(ids, run.args.chunk, on_chunk))
        peak = torch.cuda.max_memory_allocated(run.dev) / 2**30 if run.dev.type == "cuda" else float("nan")
        pre = cost.prefill(n)
        run.results["prefill"].append(dict(
            n=n, chunk=run.args.chunk, seconds=secs, tflops=pre.total / secs / 1e12, floor_s=pre.floor_s(),
            roof=pre.floor_s() / secs, hf_s=HF_PREFILL_S.get(n), speedup=HF_PREFILL_S[n] / secs if n in
            HF_PREFILL_S else None, peak_gib=peak, first_chunk_s=chunk_s[0], last_chunk_s=chunk_s[-1], in_sweep=
            n in run.args.prefill))
        run.log(f"prefill {n}: {secs:.3f} s ({100 * pre.floor_s() / secs:.1f}% of floor), peak {peak:.1f} GiB")
        if n >= 131072 or n == max(run.args.prefill, default=-1) or getattr(run.args, "profile_prefill", 0):
            _chunk_breakdown(run, drv, ids, n, chunk_s[-1])
        if decode:
            drv.fork(bmax - 1, steps)
            for b in run.args.batches:
                _decode(run, drv, b, n, cost)
        del drv
    free(run.dev)


def _entry_classes(cfg, n: int, chunk: int) -> set:
    """The indexer's prefill tuning classes a chunked prefill to ``n`` meets (``indexer.prefill_entry_class`` of the
    longest stream of each chunk: entries of the CSA ratio up to the chunk's end)."""
    from redknot.kernels.triton.indexer import prefill_entry_class
    return {prefill_entry_class(min(a + chunk, n) // cfg.csa_ratio) for a in range(0, n, chunk)}


def _chunk_breakdown(run: Run, drv: CutDriver, ids: List[int], n: int, chunk_s: float) -> None:
    """Re-run the last chunk (same positions: the state is rewritten with the same values) with op timing;
    with ``--profile-prefill N`` then N more runs of it under torch.profiler (device time per kernel)."""
    last = ids[(len(ids) - 1) // run.args.chunk * run.args.chunk:]
    drv.ctx[0] -= len(last)
    _timed_step(run, drv, [last], [0], f"prefill chunk {len(last)} at {n}")
    steps = getattr(run.args, "profile_prefill", 0)
    if not steps:
        return
    from step_profile_v41 import format_views, step_views

    start = drv.ctx[0] - len(last)
    drv.ctx[0] = start
    meta = drv.meta([last], [0])

    def chunk():
        drv.run(meta, [0])
        drv.ctx[0] = start
    views = step_views(chunk, None, run.dev, steps, chunk_s * 1e3)
    drv.ctx[0] = start + len(last)
    run.results.setdefault("prefill_profile", []).append(dict(n=n, chunk=len(last), view=views.get("eager")))
    for line in format_views(views, f"V4 cut, prefill chunk {len(last)} at {n}", "Prefill chunk profile")[:60]:
        run.log(line)


def _timed_step(run: Run, drv: CutDriver, tokens, seqs, label: str) -> None:
    model = drv.model
    ks = model.ks
    timer = OpTimer(ks, run.dev)
    model.set_kernels(timer)
    meta = drv.meta(tokens, seqs)
    try:
        _, secs = run.timed(lambda: drv.run(meta, seqs))
    finally:
        model.set_kernels(ks)
    totals = timer.totals_ms()
    for op, (ms, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        run.results["ops"].append(dict(case=label, op=op, ms=ms, calls=calls, share=ms / (secs * 1e3)))
    other = secs * 1e3 - sum(ms for ms, _ in totals.values())
    run.results["ops"].append(dict(case=label, op="(outside ops)", ms=other, calls=0, share=other / (secs * 1e3)))


def _decode(run: Run, drv: CutDriver, batch: int, n: int, cost: CostModel) -> None:
    seqs = list(range(batch))
    rng = random.Random(batch * 7 + n)
    times = []
    for i in range(DECODE_WARM + DECODE_TIMED):
        meta = drv.meta([[rng.randrange(3, drv.model.cfg.vocab_size)] for _ in seqs], seqs)
        logits, secs = run.timed(lambda: drv.run(meta, seqs))
        if i >= DECODE_WARM:
            times.append(secs)
    step = sum(times) / len(times)  # the mean: steps that close compressor windows cost more
    floor = decode_floor(cost, n, batch)
    hf = HF_DECODE_S.get(n) if batch == 1 else None
    run.results["decode"].append(dict(n=n, batch=batch, step_s=step, median_s=sorted(times)[len(times) // 2],
                                      min_s=min(times), max_s=max(times), floor_s=floor, roof=floor / step, hf_s=hf,
                                      speedup=hf / step if hf else None, tokens_per_s=batch / step))
    run.log(f"decode {n} b{batch}: {step * 1e3:.2f} ms/step ({100 * floor / step:.1f}% of floor)")
    _timed_step(run, drv, [[rng.randrange(3, drv.model.cfg.vocab_size)] for _ in seqs], seqs, f"decode b{batch} at {n}")
    if run.dev.type == "cuda":
        _graph_decode(run, drv, seqs, rng, run.results["decode"][-1])


def _graph_decode(run: Run, drv: CutDriver, seqs: List[int], rng: random.Random, row: dict) -> None:
    """The same decode steps replayed from one captured CUDA graph (tensor-only metadata in static
    buffers, as the engine captures them); the first replay is compared with an eager step."""
    model, vocab = drv.model, drv.model.cfg.vocab_size
    live = drv.meta([[3] for _ in seqs], seqs)
    static = StepMetadata(input_ids=live.input_ids.clone(), positions=live.positions.clone(),
                          query_start_loc=live.query_start_loc, seq_slots=live.seq_slots,
                          block_tables=live.block_tables.clone(), logits_indices=live.logits_indices,
                          num_tokens_per_seq=[1] * len(seqs), context_lens=list(live.context_lens), tensor_only=True)
    forward = lambda: model.compute_logits(model(static, drv.state)[static.logits_indices])  # noqa: E731
    forward()  # warm-up and launch-shape tuning at the captured shapes (rewrites the same positions)
    sync(run.dev)
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        out = forward()
    graph.replay()
    eager = model.compute_logits(model(live, drv.state)[live.logits_indices])
    err = row_err(out, eager)
    for s in seqs:
        drv.ctx[s] += 1
    times = []
    for i in range(DECODE_WARM + DECODE_TIMED):
        static.input_ids.copy_(torch.tensor([rng.randrange(3, vocab) for _ in seqs]))
        static.positions.copy_(torch.tensor([drv.ctx[s] for s in seqs]))
        _, secs = run.timed(graph.replay)
        for s in seqs:
            drv.ctx[s] += 1
        if i >= DECODE_WARM:
            times.append(secs)
    step = sum(times) / len(times)
    # Back to back, as a serving loop runs steps: each step's inputs go in by device-side copies from tensors made
    # beforehand, and nothing waits for a step to end before the next replay starts (one sync after the last)
    ids = torch.tensor([[rng.randrange(3, vocab) for _ in seqs] for _ in range(DECODE_TIMED)], device=run.dev)
    pos = torch.tensor([[drv.ctx[s] + i for s in seqs] for i in range(DECODE_TIMED)], device=run.dev)

    def back_to_back():
        for i in range(DECODE_TIMED):
            static.input_ids.copy_(ids[i], non_blocking=True)
            static.positions.copy_(pos[i], non_blocking=True)
            graph.replay()
    _, secs = run.timed(back_to_back)
    for s in seqs:
        drv.ctx[s] += DECODE_TIMED
    b2b = secs / DECODE_TIMED
    row.update(graph_step_s=step, graph_roof=row["floor_s"] / step, graph_row_err=err, graph_b2b_s=b2b,
               graph_b2b_roof=row["floor_s"] / b2b)
    run.log(f"decode {row['n']} b{len(seqs)} in a CUDA graph: {step * 1e3:.2f} ms/step "
            f"({100 * row['floor_s'] / step:.1f}% of floor; first replay vs eager row err {err:.2e}); "
            f"back to back {b2b * 1e3:.2f} ms/step ({100 * row['graph_b2b_roof']:.1f}%)")
    if getattr(run.args, "profile_graph", 0):
        _replay_profile(run, graph, row, step)
    side_tokens = getattr(run.args, "side_stream_tokens", 0)
    if side_tokens:
        _side_stream_ab(run, forward, graph, out, side_tokens, row)
    del graph


def _replay_profile(run: Run, graph, row: dict, step_s: float) -> None:
    """``--profile-graph N``: N replays of the captured step under torch.profiler (``step_profile_v41``'s replay
    view: device time per kernel, busy time against the replay's wall time), logged as a table and kept in the
    row (``replay_view``)."""
    from step_profile_v41 import format_views, step_views

    views = step_views(None, graph.replay, run.dev, run.args.profile_graph, step_s * 1e3)
    row["replay_view"] = views.get("replay")
    for line in format_views(views, f"V4 cut, decode b{row['batch']} at {row['n']}, graph replay")[:60]:
        run.log(line)


def _side_stream_ab(run: Run, forward: Callable[[], torch.Tensor], graph, out: torch.Tensor, side_tokens: int,
                    row: dict) -> None:
    """The same step captured again with the shared expert on the side stream (``hardware.side_stream_max_tokens``
    = ``side_tokens``): its replay against ``graph``'s on the same static inputs (bit for bit), then both timed in
    three alternating rounds (best of each). The replays rewrite the same positions, so the state is unchanged."""
    from graph_timing import alternate_best_ms, capture_on_side_stream

    side, side_out = capture_on_side_stream(forward, side_tokens)
    graph.replay()
    want = out.clone()
    side.replay()
    sync(run.dev)
    same = bool(torch.equal(side_out, want))
    best = alternate_best_ms({"one": graph, "side": side}, DECODE_TIMED)
    row.update(side_stream_tokens=side_tokens, side_same_bits=same, one_stream_best_s=best["one"] / 1e3,
               side_stream_best_s=best["side"] / 1e3)
    floor_ms = row["floor_s"] * 1e3
    run.log(f"decode {row['n']} b{row['batch']}: side stream (up to {side_tokens} rows) {best['side']:.3f} ms/step "
            f"({100 * floor_ms / best['side']:.1f} % of floor) against one stream {best['one']:.3f} "
            f"({100 * floor_ms / best['one']:.1f} %), best of 3 alternating rounds; same bits: {same}")
    del side
