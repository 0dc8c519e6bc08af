"""The DSpark draft's block forward through :class:`DraftGraphs` (one graph per batch tier).

On a CPU the graphs are recorded by :class:`HostGraphCapture` (recorded ATen ops replayed on the captured
tensors, as a CUDA graph replays kernels): a replay must read the static buffers and the rings as they are
at replay time, the first replay of a tier is checked against eager execution (a stale capture is caught
and drafting goes eager), and the engine's drafter drafts the same blocks with the graphs as without. The
``gpu`` tests capture real CUDA graphs."""
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch
from spec_testutil import features

from redknot.config.schema import Accelerator, DType, EngineConfig, HardwareConfig, ModelConfig, SchedulerConfig
from redknot.bench.typed import load_yaml_option
from redknot.engine import SamplingParams
from redknot.engine.cuda_graphs import CapturedStep, HostGraphCapture
from redknot.models.deepseek_v41.dspark_draft import V41DSparkDraft
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights
from redknot.speculative.draft_graphs import DraftGraphs, batch_tier, draft_tiers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from v41_forward.v41util import random_weights, token_map_for  # noqa: E402
from v41_forward.v41util import test_config as v41_config  # noqa: E402

CONF = Path(__file__).resolve().parents[3] / "conf" / "model" / "tiny-v41.yaml"
SLOTS = 5   # ring slots: 4 requests + the spare (padding) slot


def _draft(device: str = "cpu", dtype=torch.float32):
    cfg = v41_config(n_mtp_layers=2, dspark_block_size=3, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0))
    tensors = {k: v.to(device) for k, v in random_weights(cfg, 0, include_draft=True).items()}
    num = Numerics("reference", dtype)
    tmap = token_map_for(cfg)
    model = DeepseekV41(cfg, Weights({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, dtype, keep=True),
                        tmap, int(tmap[cfg.engram_pad_id]), num, device=device)
    draft = V41DSparkDraft(cfg, Weights({k: v for k, v in tensors.items() if k.startswith("mtp.")}, dtype, keep=True),
                           num, device=device).attach(model)
    gen = torch.Generator(device=device).manual_seed(1)
    rings = [torch.randn(SLOTS, cfg.window_size, cfg.head_dim, generator=gen, device=device).to(dtype)
             for _ in range(cfg.n_mtp_layers)]
    return model, draft, rings


def _batch(b: int, seed: int, device: str = "cpu") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(3, 1000, (b,), generator=gen)
    positions = torch.randint(0, 60, (b,), generator=gen)
    slots = torch.randperm(SLOTS - 1, generator=gen)[:b]
    return anchors.to(device), positions.to(device), slots.to(device)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return float((got.float() - want.float()).abs().max()) <= tol * float(want.float().abs().max())


def test_batch_tiers():
    assert draft_tiers(1) == [1] and draft_tiers(4) == [1, 2, 4] and draft_tiers(6) == [1, 2, 4, 6]
    assert batch_tier(3, [1, 2, 4, 6]) == 4 and batch_tier(6, [1, 2, 4, 6]) == 6 and batch_tier(7, [1, 2, 4]) is None


def test_replay_reads_the_buffers_and_rings_of_replay_time():
    """Every batch size replays its tier with padding rows on the spare slot and equals the eager block
    forward of the same requests; the rings and the requests change between replays and the replay
    follows (nothing of the capture-time values is baked in); a batch above the tiers runs eagerly."""
    model, draft, rings = _draft()
    graphs = DraftGraphs(draft, rings, False, max_num_seqs=3, padding_slot=SLOTS - 1, capture=HostGraphCapture())
    assert graphs.status.startswith("off: not captured")
    graphs.capture()
    assert graphs.status.startswith("on:") and sorted(graphs.graphs) == [1, 2, 3]
    for seed, b in enumerate((3, 2, 1, 3, 2)):
        if seed == 3:   # new context K/V in every ring, in place (as the drafter writes them)
            for ring in rings:
                ring.copy_(torch.randn(ring.shape, generator=torch.Generator().manual_seed(9)))
        a, p, s = _batch(b, seed)
        h, base = graphs.forward_block(a, p, s)
        want_h, want_base = draft.forward_block(a, p, rings, s)
        assert h.shape == want_h.shape and base.shape == want_base.shape
        assert _close(h, want_h, 1e-5) and _close(base, want_base, 1e-5), (seed, b)
    assert graphs.num_replays == 5 and set(graphs.checks) == {1, 2, 3}
    assert all(c.startswith("ok") for c in graphs.checks.values()), graphs.checks
    a, p, s = _batch(4, 7)
    assert graphs.tier_of(4) is None
    h, _ = graphs.forward_block(a, p, s)   # above the tiers: eager
    assert graphs.num_replays == 5 and _close(h, draft.forward_block(a, p, rings, s)[0], 1e-6)


class _StaleCapture(HostGraphCapture):
    """A faulty capture: its replay does nothing, so the outputs keep their capture-time values."""

    def capture(self, fn, pool=None) -> CapturedStep:
        got = super().capture(fn, pool)
        return CapturedStep(lambda: None, got.outputs, got.pool)


def test_a_stale_capture_is_caught_at_the_first_replay():
    model, draft, rings = _draft()
    graphs = DraftGraphs(draft, rings, False, max_num_seqs=2, padding_slot=SLOTS - 1, capture=_StaleCapture())
    graphs.capture()
    a, p, s = _batch(2, 3)
    h, base = graphs.forward_block(a, p, s)
    want_h, want_base = draft.forward_block(a, p, rings, s)
    assert graphs.checks[2].startswith("mismatch") and graphs.status.startswith("off: the replay of batch tier 2")
    assert torch.equal(h, want_h) and torch.equal(base, want_base)   # the step drafts from the eager result
    assert graphs.tier_of(1) is None   # off for good: every later step drafts eagerly


def test_a_failed_capture_keeps_the_smaller_tiers():
    class Failing(HostGraphCapture):
        def capture(self, fn, pool=None):
            if fn()[0].shape[0] >= 2:
                raise RuntimeError("out of memory")
            return super().capture(fn, pool)
    model, draft, rings = _draft()
    graphs = DraftGraphs(draft, rings, False, max_num_seqs=4, padding_slot=SLOTS - 1, capture=Failing())
    graphs.capture()
    assert sorted(graphs.graphs) == [1] and "batches above 1 draft eagerly" in graphs.status
    assert graphs.tier_of(1) == 1 and graphs.tier_of(2) is None
    with pytest.raises(ValueError, match="padding_slot=9 is not a ring slot"):
        DraftGraphs(draft, rings, False, max_num_seqs=4, padding_slot=9, capture=HostGraphCapture())


# ---------------------------------------------------------------------- the engine's drafter
def _llm(tmp_path, cuda: bool = False, graphs: bool = False, dtype: DType = DType.float32):
    from redknot.engine import LLM

    model = load_yaml_option(CONF, ModelConfig)
    model.max_position = 512
    hardware = HardwareConfig()
    if cuda:
        hardware = HardwareConfig(name="cuda-test", accelerator=Accelerator.cuda, dtype=dtype,
                                  kv_cache_dtype=dtype, cuda_graphs=graphs, memory_utilization=0.5,
                                  cuda_graph_max_len=512)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, long_prefill_chunk=32, block_size=16)
    return LLM(model, hardware, features(dspark=True, max_draft=3, keep_tokens=16 + 3 + 1),
               EngineConfig(scheduler=sched, seed=0, cache_dir=str(tmp_path)))


def _drafts(llm, prompts: Dict[str, List[int]]):
    """Greedy outputs and every block the drafter drafted, in drafting order: (outputs, [(tokens,
    confidences)])."""
    drafter = llm.runner.speculator.drafter
    seen = []
    real = drafter.draft_blocks

    def spy(reqs):
        out = real(reqs)
        seen.extend((tuple(out[r.req_id].token_ids), torch.tensor(out[r.req_id].confidences)) for r in reqs)
        return out
    drafter.draft_blocks = spy
    try:
        done = llm.generate([prompts[r] for r in prompts], SamplingParams(max_tokens=20, ignore_eos=True))
    finally:
        del drafter.draft_blocks
    return [list(o.token_ids) for o in done], seen


def _prompts() -> Dict[str, List[int]]:
    return {f"p{k}": [(31 * i + 11 * k) % 120000 + 3 for i in range(n)] for k, n in enumerate((7, 29, 12))}


def test_engine_drafter_drafts_the_same_blocks_through_graphs(seeded_model_cache):
    """tiny-v41 with DSpark (fp32, CPU): the drafter with its block forward in (host-recorded) graphs
    drafts the blocks the eager drafter drafts, step by step, and the greedy output is unchanged."""
    llm = _llm(seeded_model_cache)
    try:
        eager_out, eager_drafts = _drafts(llm, _prompts())
        spec = llm.runner.speculator
        graphs = spec.use_draft_graphs(HostGraphCapture(), 4, llm.runner.padding_slot)
        spec.capture_draft_graphs()
        assert graphs.status.startswith("on:"), graphs.status
        out, drafts = _drafts(llm, _prompts())
    finally:
        llm.close()
    assert out == eager_out
    assert graphs.num_replays > 0 and len(drafts) == len(eager_drafts) > 0
    assert all(c.startswith("ok") for c in graphs.checks.values()), graphs.checks
    for (toks, conf), (toks0, conf0) in zip(drafts, eager_drafts):
        assert toks == toks0
        assert torch.allclose(conf, conf0, atol=1e-5)


# ---------------------------------------------------------------------- CUDA
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_draft_graph_replays_equal_eager(dtype):
    """Real CUDA graphs (fp64: PyTorch math; bf16: through the Triton ops): every tier's first replay is
    checked ok, and later replays follow new requests and rewritten rings. The replay equals the same
    padded call run eagerly (same kernels, same inputs). Padding rows change the GEMMs' row counts (cuBLAS
    picks kernels by row count), so the last bits of a real row may change, and the draft's FP8 activation
    rounding can turn a last-bit difference into an FP8 step (the random draft carries it on): in fp64 the
    replay also equals the unpadded eager call (to 1e-9), at bf16 that difference is printed."""
    from redknot.engine.cuda_graphs import CudaGraphCapture
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    model, draft, rings = _draft("cuda", dtype)
    if dtype == torch.bfloat16:
        ops = V41Ops.create(KernelSet(default="triton"))
        model.ops, model.w.ops, draft.w.ops = ops, ops, ops
    graphs = DraftGraphs(draft, rings, False, max_num_seqs=4, padding_slot=SLOTS - 1, capture=CudaGraphCapture())
    graphs.capture()
    assert graphs.status.startswith("on:"), graphs.status
    padding = []
    for seed, b in enumerate((3, 4, 1, 2, 3)):
        if seed == 3:
            for ring in rings:
                ring.copy_(torch.randn(ring.shape, device="cuda").to(dtype))
        a, p, s = _batch(b, seed, "cuda")
        h, base = graphs.forward_block(a, p, s)
        h, base = h.clone(), base.clone()
        padded_h, padded_base = graphs._step_fn(graphs.tier_of(b))()    # the buffers still hold this step
        assert _close(h, padded_h[:b], 1e-3) and _close(base, padded_base[:b], 1e-3), (seed, b)
        want_h, want_base = draft.forward_block(a, p, rings, s)
        padding.append(float((base - want_base).norm() / want_base.norm()))
        if dtype == torch.float64:
            assert _close(h, want_h, 1e-9) and _close(base, want_base, 1e-9), (seed, b, graphs.check_errors)
    assert graphs.num_replays == 5
    assert all(c.startswith("ok") for c in graphs.checks.values()), graphs.checks
    print({"checks": graphs.check_errors, "padding_rel_errors": padding})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_engine_drafts_through_graphs(tmp_path):
    """hardware.cuda_graphs=true with DSpark on tiny-v41 (fp64, the checks-only dtype: no fp32 rounding for
    the FP8 activation grid to amplify): the runner captures the drafter's graphs at warm-up, drafting
    replays them (every first replay checked ok), and the drafted blocks equal those of the same engine
    without CUDA graphs. The verify steps of the graph engine run eagerly here, so the comparison isolates
    drafting (verify graphs have their own tests)."""
    on = _llm(tmp_path / "on", cuda=True, graphs=True, dtype=DType.float64)
    off = _llm(tmp_path / "off", cuda=True, graphs=False, dtype=DType.float64)
    try:
        graphs = on.runner.speculator.drafter.graphs
        assert graphs is not None and off.runner.speculator.drafter.graphs is None
        assert graphs.status.startswith("on:"), graphs.status
        on.runner.verify_graphs = None
        out, drafts = _drafts(on, _prompts())
        ref_out, ref_drafts = _drafts(off, _prompts())
    finally:
        on.close()
        off.close()
    assert graphs.num_replays > 0
    assert all(c.startswith("ok") for c in graphs.checks.values()), graphs.checks
    assert out == ref_out
    assert [t for t, _ in drafts] == [t for t, _ in ref_drafts]
