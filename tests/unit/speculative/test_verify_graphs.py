"""DSpark's variable-length verify steps of DeepSeek-V4.1 (model=tiny-v41) through :class:`VerifyGraphs`:
the static buffers padded to a total-token tier, the logits, pre-head rows and taps as outputs of the
recorded step, the first-replay check against eager, and the runner routing decode and verify steps
through them.

CUDA graphs do not exist on a CPU, so here the steps are recorded by :class:`HostGraphCapture`: it runs
the step once while recording every ATen op with its tensors and replays those ops, never the step's
Python; a step that read anything but the static buffers replays its capture-time values, as a real
graph would (the first tests show that the stand-in behaves so). The ``gpu`` tests capture real graphs.
"""
from pathlib import Path
from typing import List

import pytest
import torch
from spec_testutil import features, oracle_hook, record_logits

from redknot.bench.typed import load_yaml_option
from redknot.config.schema import Accelerator, DType, EngineConfig, HardwareConfig, ModelConfig, SchedulerConfig
from redknot.engine import SamplingParams
from redknot.engine.cuda_graphs import HostGraphCapture
from redknot.engine.inputs import build_step_inputs
from redknot.engine.messages import ScheduledRequest, SchedulerOutput
from redknot.models.family import DSPARK
from redknot.speculative.varlen import VerifyGraphs

CONF = Path(__file__).resolve().parents[3] / "conf" / "model" / "tiny-v41.yaml"
GAMMA = 3                 # drafts verified per request: 1..GAMMA+1 rows each
MAX_SEQS = 4
WINDOW = 16
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
LOGITS_ATOL = 2e-4        # fp32: the tensor-only step and the eager step round differently (engine tests' bound)
STATE_TOL = 1e-4


def _make(cache: str, dspark: bool, cuda: bool = False, graphs: bool = False, seqs: int = MAX_SEQS,
          dtype: DType = DType.float32):
    from redknot.engine import LLM

    model = load_yaml_option(CONF, ModelConfig)
    model.max_position = 512
    hardware = HardwareConfig(dtype=dtype, kv_cache_dtype=dtype)
    if cuda:
        hardware = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=dtype,
                                  kv_cache_dtype=dtype, cuda_graphs=graphs, memory_utilization=0.5,
                                  cuda_graph_max_len=512)
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=max(64, seqs * (GAMMA + 1)),
                            long_prefill_chunk=32, block_size=16)
    eng = EngineConfig(scheduler=sched, seed=0, cache_dir=cache)
    return LLM(model, hardware, features(dspark=dspark, max_draft=GAMMA, keep_tokens=WINDOW + GAMMA + 1), eng)


@pytest.fixture(scope="module")
def v41(seeded_model_cache):
    cache = seeded_model_cache
    made = {}

    def make(dspark: bool, cuda: bool = False, graphs: bool = False, seqs: int = MAX_SEQS,
             dtype: DType = DType.float32):
        key = (dspark, cuda, graphs, seqs, dtype)
        if key not in made:
            made[key] = _make(cache, dspark, cuda, graphs, seqs, dtype)
        return made[key]
    yield make
    for llm in made.values():
        llm.close()


def _host_graphs(llm) -> VerifyGraphs:
    """The runner's verify graphs recorded by the host stand-in (every tier), first-replay check on."""
    runner = llm.runner
    runner.graph_max_len = 256
    graphs = runner.use_verify_graphs(HostGraphCapture())
    graphs.capture()
    assert graphs.status.startswith("on:"), graphs.status
    return graphs


# ---------------------------------------------------------------------- the stand-in itself
def test_host_capture_replays_recorded_ops_not_python():
    """A replay recomputes from what the buffers hold now; a value taken from a Python object or a
    fresh tensor at capture stays what it was then (exactly what a CUDA graph does)."""
    buf = torch.arange(4, dtype=torch.float32)
    dest = torch.zeros(6)
    index = torch.tensor([1, 3, 5, 0])
    per_step = {"k": 1.0}

    def step():
        y = buf * 2 + torch.tensor(per_step["k"])          # a Python value: baked at capture
        dest.index_copy_(0, index, y)                      # a state write through a static index buffer
        return (y, dest[index].sum(dim=0, keepdim=True))
    got = HostGraphCapture().capture(step)
    buf.copy_(torch.tensor([10.0, 20.0, 30.0, 40.0]))
    index.copy_(torch.tensor([0, 1, 2, 3]))
    per_step["k"] = 100.0
    dest.zero_()
    got.replay()
    want = torch.tensor([21.0, 41.0, 61.0, 81.0])          # k stays 1.0
    assert torch.equal(got.outputs[0], want)
    assert torch.equal(dest[:4], want) and torch.equal(dest[4:], torch.zeros(2))
    assert got.outputs[1].item() == want.sum().item()


def test_host_capture_refuses_host_reads():
    buf = torch.ones(3)
    with pytest.raises(RuntimeError, match="reads a device value on the host"):
        HostGraphCapture().capture(lambda: (buf * float(buf.sum()),))
    with pytest.raises(RuntimeError, match="reads a device value on the host"):
        HostGraphCapture().capture(lambda: (buf[buf > 0],))


# ---------------------------------------------------------------------- steps by hand
class Requests:
    """MAX_SEQS requests driven by hand through the runner: slots 0.., their own blocks."""

    def __init__(self, llm, prompts: List[int], seed: int = 0):
        self.runner = llm.runner
        per = self.runner.cache_spec.blocks_for(256)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
        gen = torch.Generator().manual_seed(seed)
        self.seqs = [torch.randint(3, 120000, (256,), generator=gen).tolist() for _ in prompts]
        self.lens = [0] * len(prompts)
        self.step_id = 0
        self.draft = llm.runner.family.draft_models(llm.runner.model)[DSPARK]
        self.forward(list(range(len(prompts))), prompts)

    def inputs(self, reqs: List[int], counts: List[int]):
        srs = []
        for b, n in zip(reqs, counts):
            tok = self.seqs[b][self.lens[b]:self.lens[b] + n]
            srs.append(ScheduledRequest(f"r{b}", b, self.tables[b], self.lens[b], tok, num_logits=n,
                                        draft_token_ids=tok[1:], seq_len=self.lens[b] + 1))
        self.step_id += 1
        return build_step_inputs(SchedulerOutput(self.step_id, srs))

    def forward(self, reqs: List[int], counts: List[int]):
        out = self.runner.eager_forward(self.inputs(reqs, counts))
        for b, n in zip(reqs, counts):
            self.lens[b] += n
        return out


def real_state(runner) -> List[torch.Tensor]:
    """Every state tensor without the spare slot's rows and the spare block's pages (padding writes there)."""
    st = runner.state
    out = [w[:-1] for w in st.windows]
    for src in st.sources.values():
        out += [src.entries[:-1], src.keys[:-1]] + [t[:-1] for t in (src.kv_rows, src.gate_rows) if t is not None]
    if st.engram_ids is not None:
        out.append(st.engram_ids[:-1])
    return out


def _assert_state_close(a: List[torch.Tensor], b: List[torch.Tensor], what: str, tol: float = STATE_TOL) -> None:
    for x, y in zip(a, b):
        if x.dtype in (torch.uint8, torch.long, torch.int32):
            assert torch.equal(x, y), what
        else:
            assert (x.double() - y.double()).abs().max().item() <= tol, what


# Rows per request per step (1..GAMMA+1 each) and how many of them are kept (the rest is rejected and
# rolled back: the next step starts right after the kept rows). Totals 10, 16, 1, 3, 7, 4 -> tiers 12, 16,
# 1, 3, 8, 4.
SCHEDULE = [([0, 1, 2, 3], [1, 4, 2, 3], [1, 2, 2, 1]),
            ([0, 1, 2, 3], [4, 4, 4, 4], [4, 1, 3, 2]),
            ([2], [1], [1]),
            ([3, 0], [2, 1], [1, 1]),
            ([1, 3, 0], [3, 3, 1], [3, 2, 1]),
            ([0, 1, 2, 3], [1, 1, 1, 1], [1, 1, 1, 1])]


def _replay_equals_eager(runner, graphs, reqs, inputs, n: int, step: int, logits_atol: float = LOGITS_ATOL,
                         tol: float = 1e-4, state_tol: float = STATE_TOL) -> None:
    """One verify step replayed from its tier, then the same step run eagerly from the state before it:
    logits, pre-head rows, DSpark taps and the requests' state must agree."""
    before = [t.clone() for t in runner.state.tensors()]
    streams, logits = (v.clone() for v in graphs.run(inputs))
    taps = reqs.draft.last_taps(n).clone()
    after_graph = [t.clone() for t in real_state(runner)]
    for t, b in zip(runner.state.tensors(), before):
        t.copy_(b)
    eager_streams, eager_logits = runner.eager_forward(inputs)
    torch.testing.assert_close(logits, eager_logits, atol=logits_atol, rtol=0, msg=f"step {step}")
    torch.testing.assert_close(streams, eager_streams, atol=tol, rtol=tol, msg=f"step {step}")
    torch.testing.assert_close(taps, reqs.draft.last_taps(n), atol=tol, rtol=tol, msg=f"step {step}")
    _assert_state_close(after_graph, real_state(runner), f"step {step}", state_tol)


def _replay_is_the_padded_step(runner, graphs, reqs, inputs, n: int, step: int) -> None:
    """One verify step replayed from its tier, then the same padded step run uncaptured (the recorded
    callable on the same static buffers) from the state before it: the same kernels on the same inputs,
    so logits, pre-head rows, taps and every real state byte are bitwise equal; a value baked in at
    capture, a buffer the graph does not read or a race would show here."""
    before = [t.clone() for t in runner.state.tensors()]
    streams, logits = (v.clone() for v in graphs.run(inputs))
    tier = min(t for t in graphs.tiers if t >= n)
    taps = [h[:n].clone() for h in graphs.graphs[tier].outputs[2:]]
    after_graph = [t.clone() for t in real_state(runner)]
    for t, b in zip(runner.state.tensors(), before):
        t.copy_(b)
    assert graphs._fill(inputs.meta) == tier
    with torch.no_grad():
        got = graphs._step_fn(tier)()
    assert len(got) == 2 + len(taps) and taps, (len(got), len(taps))
    for name, a, b in [("logits", logits, got[1][:n]), ("rows", streams, got[0][:n])] + \
            [(f"tap {i}", h, g[:n]) for i, h, g in zip(graphs.tap_layers, taps, got[2:])]:
        assert torch.equal(a, b), (step, name, (a.double() - b.double()).abs().max().item())
    _assert_state_close(after_graph, real_state(runner), f"step {step}", 0.0)


def test_verify_steps_through_graphs_equal_eager(v41):
    """Mixed per-request lengths 1..GAMMA+1 over six tiers: the replayed step's logits, pre-head rows,
    taps (as the drafter reads them) and every real state byte equal the eager step's, each step
    starting from the same state (rejected rows of the previous step left in it, as verification
    leaves them)."""
    llm = v41(True)
    graphs = _host_graphs(llm)
    graphs.check_first_replay = False          # compare the replay itself, not the checked eager result
    runner = llm.runner
    reqs = Requests(llm, prompts=[13, 6, 21, 30])
    tiers = set()
    try:
        for step, (ids, counts, kept) in enumerate(SCHEDULE):
            inputs = reqs.inputs(ids, counts)
            assert graphs.can_run(inputs), counts
            n = sum(counts)
            before = [t.clone() for t in runner.state.tensors()]
            replays = graphs.num_replays
            streams, logits = runner._forward(inputs)
            assert graphs.num_replays == replays + 1
            tiers.add(min(t for t in graphs.tiers if t >= n))
            taps = reqs.draft.last_taps(n).clone()
            streams, logits = streams.clone(), logits.clone()
            after_graph = [t.clone() for t in real_state(runner)]
            for t, b in zip(runner.state.tensors(), before):
                t.copy_(b)
            eager_streams, eager_logits = runner.eager_forward(inputs)
            eager_taps = reqs.draft.last_taps(n)
            assert logits.shape == eager_logits.shape == (n, runner.vocab_size)
            torch.testing.assert_close(logits, eager_logits, atol=LOGITS_ATOL, rtol=0, msg=f"step {step}")
            torch.testing.assert_close(streams, eager_streams, atol=1e-4, rtol=1e-4, msg=f"step {step}")
            torch.testing.assert_close(taps, eager_taps, atol=1e-4, rtol=1e-4, msg=f"step {step}")
            _assert_state_close(after_graph, real_state(runner), f"step {step}")
            for b, k in zip(ids, kept):  # verification kept k rows; the rest are rolled back
                reqs.lens[b] += k
    finally:
        graphs.check_first_replay = True
        runner.verify_graphs = None
    assert tiers == {12, 16, 1, 3, 8, 4}


def test_a_step_reading_per_step_python_values_fails(v41):
    """Negative control of the stand-in: a captured step that takes its rows from the step it was
    captured with (a per-step Python object) instead of the static buffers replays that step's rows,
    and the first-replay check reports the mismatch and turns the graphs off."""
    llm = v41(True)
    runner = llm.runner
    graphs = _host_graphs(llm)
    reqs = Requests(llm, prompts=[9, 17, 5, 11], seed=3)
    try:
        captured_with = reqs.inputs([0, 1], [2, 2])          # 4 rows: tier 4

        class Leaky(VerifyGraphs):
            def _step_fn(self, tier):
                meta = captured_with.meta

                def step():
                    x = runner.family.varlen_forward(runner.model, runner.state, input_ids=meta.input_ids,
                                                     positions=meta.positions, query_start_loc=meta.query_start_loc,
                                                     seq_slots=meta.seq_slots, block_tables=meta.block_tables)
                    return (x, runner.model.compute_logits(x))
                return step
        leaky = Leaky(runner, MAX_SEQS, GAMMA, capture=HostGraphCapture(), max_len=256)
        leaky._allocate()
        leaky.graphs[4] = leaky.capturer.capture(leaky._step_fn(4))
        leaky.graphs.update({t: graphs.graphs[t] for t in graphs.tiers if t != 4})
        reqs.forward([0, 1], [2, 2])                           # the capture step happened; move on
        inputs = reqs.inputs([2, 3], [3, 1])                   # another step of 4 rows
        assert leaky.can_run(inputs)
        leaky.run(inputs)
        assert leaky.checks[4].startswith("mismatch: logits"), leaky.checks
        assert leaky.status.startswith("off: replay of tier 4 disagreed with eager execution"), leaky.status
        assert not leaky.can_run(inputs)
    finally:
        runner.verify_graphs = None


def test_first_replay_check_serves_eager_and_catches_a_stale_replay(v41):
    """A tier whose replay leaves its outputs stale is caught on its first replay: the step returns the
    eager result, the graphs go off and the status names the tier and the error."""
    llm = v41(True)
    runner = llm.runner
    graphs = _host_graphs(llm)
    reqs = Requests(llm, prompts=[12, 7, 25, 3], seed=5)
    try:
        ok = reqs.inputs([0, 1], [1, 2])                       # tier 3: a good replay passes the check
        graphs.run(ok)
        assert graphs.checks[3].startswith("ok"), graphs.checks
        reqs.lens[0] += 1
        reqs.lens[1] += 2
        graphs.graphs[8].replay = lambda: None                 # tier 8 replays nothing
        inputs = reqs.inputs([0, 1, 2], [3, 2, 2])
        before = [t.clone() for t in runner.state.tensors()]
        streams, logits = graphs.run(inputs)
        for t, b in zip(runner.state.tensors(), before):
            t.copy_(b)
        want = runner.eager_forward(inputs)[1]
        torch.testing.assert_close(logits, want, atol=0, rtol=0)
        assert graphs.checks[8].startswith("mismatch"), graphs.checks
        assert graphs.status.startswith("off: replay of tier 8 disagreed"), graphs.status
    finally:
        runner.verify_graphs = None


def test_padding_difference_is_reported_and_a_capture_fault_is_not_excused(v41, monkeypatch):
    """The first-replay check compares the replay with the same padded step run eagerly (a capture
    fault: graphs off) and with the unpadded eager step (padding changes the row count of every GEMM,
    and a library GEMM may round by row count). Stand-in for such a GEMM: logits that depend on the
    step's row count. On a padded tier the difference is reported and the graphs stay on; where the
    step fills its tier, a tensor-only step that differs from the eager one is a fault; a replay that
    recomputes nothing is a fault on any tier."""
    llm = v41(True)
    runner = llm.runner
    model = runner.model
    plain = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda x: plain(x) + 1e-2 * x.shape[0])
    graphs = _host_graphs(llm)
    reqs = Requests(llm, prompts=[11, 4, 19, 8], seed=9)
    try:
        padded = reqs.inputs([0, 1], [3, 4])                   # 7 rows -> tier 8
        streams, logits = graphs.run(padded)
        assert graphs.status.startswith("on:"), graphs.status
        assert graphs.checks[8].startswith("ok (row error 0 "), graphs.checks
        errs = graphs.check_errors[8]
        assert errs["rows"] == 7 and max(errs["capture"].values()) == 0.0, errs
        assert errs["padding"]["logits"] > 1e-4 and errs["padding_rows_over_tol"] == 7, errs
        assert "padding 7 -> 8 rows" in graphs.checks[8]
        # the replay's rows are served (the padded step's numbers, not the unpadded eager ones)
        torch.testing.assert_close(logits, plain(streams) + 1e-2 * 8, atol=1e-5, rtol=0)
        reqs.lens[0] += 3
        reqs.lens[1] += 4
        # A tensor-only step that differs from the eager span path: a fault where nothing is padded.
        eager = runner.eager_forward
        monkeypatch.setattr(runner, "eager_forward", lambda inputs: (lambda s, lg: (s, lg + 1e-2))(*eager(inputs)))
        full = reqs.inputs([0, 1], [4, 4])                     # 8 rows: tier 8 filled -> no padding
        graphs.checks.pop(8)
        graphs.run(full)
        monkeypatch.setattr(runner, "eager_forward", eager)
        assert graphs.checks[8].startswith("mismatch: logits"), graphs.checks
        assert "no padding" in graphs.checks[8]
        assert graphs.status.startswith("off: replay of tier 8 disagreed with eager execution"), graphs.status
    finally:
        runner.verify_graphs = None
    monkeypatch.setattr(model, "compute_logits", plain)
    graphs = _host_graphs(llm)
    try:
        graphs.graphs[12].replay = lambda: None                # tier 12 replays nothing
        reqs.lens[0] += 4
        reqs.lens[1] += 4
        inputs = reqs.inputs([0, 1, 2], [4, 3, 4])             # 11 rows -> tier 12 (padded)
        before = [t.clone() for t in runner.state.tensors()]
        _, logits = graphs.run(inputs)
        assert graphs.checks[12].startswith("mismatch: logits"), graphs.checks
        assert "replay vs the same padded step" in graphs.checks[12]
        assert graphs.status.startswith("off: replay of tier 12 disagreed with eager execution of the same "
                                        "padded step"), graphs.status
        for t, b in zip(runner.state.tensors(), before):
            t.copy_(b)
        torch.testing.assert_close(logits, runner.eager_forward(inputs)[1], atol=0, rtol=0)  # eager served
    finally:
        runner.verify_graphs = None


BIG_SEQS = 48   # 48 requests x (GAMMA + 1) rows: tiers up to 192


def test_verify_steps_above_128_rows_through_graphs_equal_eager(v41):
    """Steps of 129..192 rows (48 requests) through the tier-192 graph, 63 and 32 of its rows padding:
    the replay's logits, rows, taps and every real state byte equal the eager step's, each step from the
    same state; the first-replay check passes."""
    llm = v41(True, seqs=BIG_SEQS)
    runner = llm.runner
    runner.graph_max_len = 256
    graphs = runner.use_verify_graphs(HostGraphCapture())
    assert graphs.tiers[-1] == BIG_SEQS * (GAMMA + 1) == 192 and 128 in graphs.tiers
    graphs.capture([192])
    assert graphs.status.startswith("on:"), graphs.status
    reqs = Requests(llm, prompts=[5 + (7 * i) % 23 for i in range(BIG_SEQS)], seed=11)
    ids = list(range(BIG_SEQS))
    try:
        steps = [[1] * 21 + [4] * 27,                                # 129 rows
                 [4] * 32 + [2] * 16]                                # 160 rows
        for step, counts in enumerate(steps):
            inputs = reqs.inputs(ids, counts)
            n = sum(counts)
            assert graphs.can_run(inputs) and n > 128
            graphs.check_first_replay = False
            _replay_equals_eager(runner, graphs, reqs, inputs, n, step)
            graphs.check_first_replay = True
            for b, c in zip(ids, counts):   # keep one row per request, the rest is rolled back
                reqs.lens[b] += 1
        graphs.run(reqs.inputs(ids, [4] * 32 + [2] * 16))           # the checked first replay
        assert graphs.checks[192].startswith("ok"), graphs.checks
        assert graphs.check_errors[192]["rows"] == 160 and graphs.status.startswith("on:")
    finally:
        runner.verify_graphs = None


class _FailingCapture(HostGraphCapture):
    """The host stand-in, refusing its ``fail_at``-th capture (as a CUDA capture refuses a host read)."""

    def __init__(self, fail_at: int):
        self.fail_at, self.calls = fail_at, 0

    def capture(self, fn, pool=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(fn, pool)


def test_a_failed_tier_keeps_the_smaller_tiers(v41):
    """Tiers are captured smallest first; the one that fails and those above it are left to the eager
    path (the status says so), the smaller ones replay; a failure of the first tier turns graphs off."""
    llm = v41(True)
    runner = llm.runner
    runner.graph_max_len = 256
    try:
        graphs = runner.use_verify_graphs(_FailingCapture(fail_at=6))   # tiers 1 2 3 4 6 | 8 fails
        graphs.capture()
        assert sorted(graphs.graphs) == graphs.tiers == [1, 2, 3, 4, 6]
        assert graphs.status.endswith("steps above 6 tokens run eagerly: the capture of tier 8 failed "
                                      "(operation not permitted when stream is capturing)"), graphs.status
        reqs = Requests(llm, prompts=[10, 8, 14, 5], seed=7)
        assert graphs.can_run(reqs.inputs([0, 1], [3, 3]))
        assert not graphs.can_run(reqs.inputs([0, 1], [4, 3]))
        off = runner.use_verify_graphs(_FailingCapture(fail_at=1))
        off.capture()
        assert off.status.startswith("off: capture failed (operation not permitted"), off.status
    finally:
        runner.verify_graphs = None


def _replay_spy(graphs: VerifyGraphs) -> List[int]:
    """Tiers replayed from now on, in order (each captured step's replay wrapped)."""
    seen: List[int] = []
    for tier, got in graphs.graphs.items():
        got.replay = (lambda t, f: lambda: (seen.append(t), f())[1])(tier, got.replay)
    return seen


def test_cost_profile_times_the_verify_graphs_that_run(v41, monkeypatch):
    """With verify graphs captured the start-up profile times, for every size, the replay of the tier
    that size runs in (no eager forward of the target); sizes above the last captured tier are timed
    eagerly and the table's capture limit is that tier. Real requests' state is untouched."""
    from redknot.speculative.profile import profile_cost_model
    from redknot.speculative.schedule import profile_sizes

    llm = v41(True)
    runner = llm.runner
    forwards: List[int] = []
    plain = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda meta, state: (forwards.append(meta.num_tokens),
                                                                      plain(meta, state))[1])
    Requests(llm, prompts=[7, 12, 3, 9], seed=13)
    state = [t.clone() for t in real_state(runner)]
    forwards.clear()
    try:
        graphs = _host_graphs(llm)
        seen = _replay_spy(graphs)
        sizes = profile_sizes(MAX_SEQS, GAMMA, 64)
        assert sizes == graphs.tiers == [1, 2, 3, 4, 6, 8, 12, 16]
        costs = profile_cost_model(runner, runner.speculator, MAX_SEQS, 64, repeats=2)
        assert forwards == [] and graphs.num_replays == 0 and not graphs.checks
        assert seen == [1] + [t for t in sizes for _ in range(2)]          # the warm-up call, then each size
        assert costs.verify.capture_limit == 16 and costs.verify.sizes == sizes
        runner.verify_graphs = None
        partial = runner.use_verify_graphs(_FailingCapture(fail_at=6))     # tiers 1..6 captured, 8.. eager
        partial.capture()
        seen = _replay_spy(partial)
        costs = profile_cost_model(runner, runner.speculator, MAX_SEQS, 64, repeats=1)
        assert seen == [1, 1, 2, 3, 4, 6] and forwards == [8, 12, 16]
        assert costs.verify.capture_limit == 6
    finally:
        runner.verify_graphs = None
    _assert_state_close(state, real_state(runner), "the profile wrote a request's state")
    forwards.clear()
    costs = profile_cost_model(runner, runner.speculator, MAX_SEQS, 64, repeats=1)   # no graphs: eager
    assert forwards == [1] + sizes and costs.verify.capture_limit == 16


# ---------------------------------------------------------------------- through the engine
def _greedy_through_graphs(off, on, prompts, logits_atol: float = LOGITS_ATOL) -> VerifyGraphs:
    graphs = on.runner.verify_graphs
    ref, ref_lg = record_logits(off, prompts, GREEDY)
    spec = on.runner.speculator
    spec.draft_hook = oracle_hook(prompts, ref)
    replays = graphs.num_replays
    try:
        got, got_lg = record_logits(on, prompts, GREEDY)
    finally:
        spec.draft_hook = None
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids, rid
        n = len(ref[rid].token_ids)
        torch.testing.assert_close(got_lg[rid][:n], ref_lg[rid][:n], atol=logits_atol, rtol=0)
    accepted = sum(o.metrics.num_draft_accepted for o in got.values())
    proposed = sum(o.metrics.num_draft_proposed for o in got.values())
    assert accepted > 0 and proposed > accepted, (accepted, proposed)  # accepted in part, rolled back in part
    assert graphs.status.startswith("on:"), graphs.status
    assert all(c.startswith("ok") for c in graphs.checks.values()), graphs.checks
    # replays past the checked first ones served the step from the graph itself
    assert graphs.num_replays - replays >= len(graphs.checks) + 4, (graphs.num_replays, graphs.checks)
    on.scheduler.cache.assert_empty()
    return graphs


def test_greedy_with_dspark_through_graphs_equals_plain_greedy(v41):
    """A mixed batch with chunked prefill: every decode and verify step replays a recorded tier (the
    drafter fed from the replayed taps), greedy tokens and logits equal plain greedy decoding, blocks
    accepted in part and rolled back in part."""
    on = v41(True)
    graphs = _host_graphs(on)
    try:
        prompts = {f"m{k}": [(53 * i + 101 * k) % 120000 + 3 for i in range(n)] for k, n in enumerate((5, 19, 40, 70))}
        _greedy_through_graphs(v41(False), on, prompts)
        assert on.stats().cuda_graphs == graphs.status
    finally:
        on.runner.verify_graphs = None


def test_v4_verify_steps_run_in_graphs(engines):
    """DeepSeek-V4 (0731 layout, DSpark) has a variable-length tensor-only step (varlen_step.py): its verify
    graphs capture every tier, the engine's decode and verify steps replay them with every first replay
    checked against eager, and greedy output equals plain greedy (test_verify_graphs_v4.py compares the
    steps themselves)."""
    from spec_testutil import run_all

    llm = engines(arch="dspark")
    runner = llm.runner
    try:
        graphs = _host_graphs(llm)
        assert runner.cuda_graphs_status == graphs.status and sorted(graphs.graphs) == graphs.tiers
        prompts = {f"e{k}": [(7 * i + 3 * k) % 60 + 2 for i in range(n)] for k, n in enumerate((3, 21, 9))}
        want = run_all(engines(arch="dspark", dspark=False), prompts, GREEDY)
        got = run_all(llm, prompts, GREEDY)
        assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in want.items()}
        assert sum(o.metrics.num_draft_accepted for o in got.values()) > 0
        assert graphs.checks and all(c.startswith("ok") for c in graphs.checks.values()), graphs.checks
        assert graphs.num_replays >= len(graphs.checks) + 4, (graphs.num_replays, graphs.checks)
        assert graphs.status.startswith("on:"), graphs.status
    finally:
        runner.verify_graphs = None


# ---------------------------------------------------------------------- CUDA
# The engine-level GPU comparisons of the graph path with the eager path run in fp64. In fp32 the two paths
# round differently on a GPU (the tensor-only step pads to a tier, runs every expert on every row and
# scores every addressable entry; cuBLAS picks its kernels, and so its summation order, by shape), and this
# random-weight model turns a last-bit difference into a visible one: its activations are rounded to FP8,
# the indexer's queries and keys to FP4, the caches to FP8/FP4 on insert, so a value next to a rounding
# boundary lands on the other side, and a flipped cache entry is read by every later step. On a CPU, streams
# perturbed by 1e-7 (relative) before layer 2 moved later logits (std 1) by up to 0.36 for many steps and
# flipped a greedy token (`python benchmarks/graphs_divergence_v41.py --device cpu --scenarios perturb
# --dtypes float32`; without --device cpu it measures the GPU paths themselves). In
# fp64 nothing rounds near a boundary, so tokens, logits and state bytes must agree exactly or to 1e-9;
# in fp32 the replay must equal the same padded step run uncaptured, bit for bit.
F64_TOL = 1e-9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_engine_verifies_in_cuda_graphs(v41):
    """hardware.cuda_graphs=true with DSpark on tiny-v41 (fp64): the runner captures every tier at start,
    decode and verify steps replay them, greedy equals plain greedy (no DSpark, eager) token for token."""
    on = v41(True, cuda=True, graphs=True, dtype=DType.float64)
    assert on.runner.verify_graphs is not None and on.runner.graphs is None
    prompts = {f"g{k}": [(29 * i + 7 * k) % 120000 + 3 for i in range(n)] for k, n in enumerate((6, 33, 70, 12))}
    _greedy_through_graphs(v41(False, cuda=True, dtype=DType.float64), on, prompts, logits_atol=F64_TOL)
    assert on.stats().num_cuda_graph_steps > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_verify_replay_equals_eager_and_taps(v41):
    """Real CUDA graphs (fp64): every scheduled verify step's replay against the eager step (logits,
    pre-head rows, taps, state), as the host test does."""
    _walk_schedule_on_gpu(v41(True, cuda=True, graphs=True, dtype=DType.float64),
                          lambda runner, graphs, reqs, inputs, n, step: _replay_equals_eager(
                              runner, graphs, reqs, inputs, n, step, F64_TOL, F64_TOL, F64_TOL))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_verify_replay_is_the_padded_step_fp32(v41):
    """Real CUDA graphs in fp32: every scheduled verify step's replay equals the same padded step run
    uncaptured, bit for bit (logits, pre-head rows, taps, state)."""
    _walk_schedule_on_gpu(v41(True, cuda=True, graphs=True), _replay_is_the_padded_step)


def _walk_schedule_on_gpu(llm, check) -> None:
    """Real CUDA graphs: ``check(runner, graphs, reqs, inputs, n, step)`` on every step of SCHEDULE (first-replay
    check off, so the replay itself is compared), each step keeping only its kept rows."""
    runner = llm.runner
    graphs = runner.verify_graphs
    assert graphs.status.startswith("on:"), graphs.status
    graphs.check_first_replay = False
    reqs = Requests(llm, prompts=[13, 6, 21, 30])
    try:
        for step, (ids, counts, kept) in enumerate(SCHEDULE):
            check(runner, graphs, reqs, reqs.inputs(ids, counts), sum(counts), step)
            for b, k in zip(ids, kept):
                reqs.lens[b] += k
    finally:
        graphs.check_first_replay = True
