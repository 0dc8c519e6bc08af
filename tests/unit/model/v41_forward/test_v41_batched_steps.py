"""A step of several sequences equals the same sequences stepped one at a time (V4.1 engine path).

The eager attention runs every span of a step at once: one compressor pass and one cache write per
kv source, one window gather / insert / ring write and one sparse-attention call per layer, and one
indexer launch for all short spans (keys of the sequences gathered back to back, each row limited to
its own sequence's blocks). These tests step four sequences (contexts on both sides of the window,
of the candidate coverage and of ratio-2 group boundaries; shuffled pages) through batched decode
steps and a mixed step (one long prefill chunk among decode rows), and compare with the same steps
run one sequence at a time on a copy of the state: outputs, every byte of the state, and every
index source's selection. Both the PyTorch path and the path routed through the registry ops
(references, with the model's tie rule pinned: the op contract leaves exact ties open).
"""
from __future__ import annotations

import copy

import pytest
import torch

from redknot.kernels import KernelSet
from redknot.models.deepseek_v41.kernel_ops import SMALL_SPAN, V41Ops
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights
from redknot.models.deepseek_v41.state import allocate_state
from redknot.models.deepseek_v41.state_layout import create_state_layout
from redknot.step.metadata import StepMetadata
from v41_forward import v41util

PROMPTS = (9, 30, 45, 61)     # below/above the window (16), the top-8 and the candidate coverage (3 x 4)
MAX_TOKENS = 100


class Many:
    """Sequences on one paged state (slot i+1, pages shuffled and interleaved between sequences)."""

    def __init__(self, model: DeepseekV41, n: int, block_size: int = 4):
        self.model = model
        self.layout = create_state_layout(model.cfg, block_size=block_size, max_backtrack=0)
        per = self.layout.blocks_for(MAX_TOKENS)
        self.state = allocate_state(model.cfg, self.layout, num_slots=n + 2, num_blocks=n * per + 2,
                                    device=model.device, dtype=model.dtype)
        perm = torch.randperm(n * per + 2, generator=torch.Generator().manual_seed(3)).tolist()
        self.blocks = [perm[i::n][:per] for i in range(n)]
        self.lens = [0] * n

    def step(self, chunks):
        """chunks: {sequence: ids}, one step -> (pre-head rows [T, D], {layer: selections [T, K]}, plus the
        candidate blocks on the routed path)."""
        seqs = sorted(chunks)
        meta = StepMetadata.build([list(chunks[s]) for s in seqs], [self.lens[s] for s in seqs],
                                  [s + 1 for s in seqs], [self.blocks[s] for s in seqs],
                                  list(range(sum(len(chunks[s]) for s in seqs))), device=self.model.device)
        x = self.model.forward(meta, self.state)
        for s in seqs:
            self.lens[s] += len(chunks[s])
        slots = self.model.last_slots
        out = {k: v.clone() for k, v in slots.record.items()}
        if slots.cand_blocks is not None:   # the routed path's published candidate blocks
            out["candidate blocks"] = slots.cand_blocks.clone()
        return x, out


def _model(routed: bool, device="cpu"):
    cfg = v41util.test_config()
    tensors = {k: v.to(device) for k, v in v41util.random_weights(cfg, 0).items()}
    tmap = v41util.token_map_for(cfg)
    ops = V41Ops(KernelSet(default="reference"), route_all=True) if routed else None
    return DeepseekV41(cfg, Weights(tensors, torch.float64, keep=True), tmap, int(tmap[cfg.engram_pad_id]),
                       Numerics("bf16", torch.float64), device=device, ops=ops)


def _prefilled(model, prompts=PROMPTS):
    many = Many(model, len(prompts))
    for s, n in enumerate(prompts):
        many.step({s: v41util.tokens(n, seed=s)})
    return many


def _same_state(a, b) -> None:
    """Cache bytes equal; the fp64 ratio-2 carry-over rows (raw projections: a GEMM over more rows may
    sum in another order) equal up to rounding."""
    for x, y in zip(a.state.tensors(), b.state.tensors()):
        if x.is_floating_point():
            assert float((x - y).abs().max()) <= 1e-12 * max(1.0, float(y.abs().max()))
        else:
            assert torch.equal(x, y)


def _check(model, steps, prompts=PROMPTS):
    """Run ``steps`` (lists of {sequence: ids}) batched on one copy and one sequence at a time on another."""
    batched = _prefilled(model, prompts)
    single = copy.deepcopy(batched)
    single.model = batched.model
    for chunks in steps:
        got, got_sel = batched.step(chunks)
        rows, sel = [], {}
        for s in sorted(chunks):
            x, rec = single.step({s: chunks[s]})
            rows.append(x)
            for k, v in rec.items():
                sel.setdefault(k, []).append(v)
        want = torch.cat(rows)
        assert float((got - want).abs().max()) <= 1e-12 * float(want.abs().max())
        assert got_sel.keys() == sel.keys()
        for k in sel:
            assert torch.equal(got_sel[k], torch.cat(sel[k])), k
        _same_state(batched, single)


@pytest.fixture(params=["pytorch", "registry"])
def model(request):
    return _model(request.param == "registry")


def test_batched_decode_steps_equal_one_sequence_at_a_time(model):
    steps = [{s: [100 + 7 * i + s] for s in range(len(PROMPTS))} for i in range(5)]   # groups close, rings wrap
    _check(model, steps)


def test_a_mixed_step_equals_one_sequence_at_a_time(model):
    long = v41util.tokens(SMALL_SPAN + 4, seed=9)          # longer than a shared indexer launch takes
    steps = [{0: long, 1: [5], 2: [6], 3: [7, 8, 9]},        # a prefill chunk, decode rows, a 3-row verify
             {0: [11], 2: [12], 3: [13]}]                    # a subset of the sequences
    _check(model, steps)


def test_short_contexts_share_the_candidate_source_launch(model):
    """Contexts within the candidate coverage (3 blocks x 4 entries): the candidate source's top-k shares
    the launch and publishes every block with a visible entry, as its op would."""
    _check(model, [{s: [60 + 3 * i + s] for s in range(3)} for i in range(2)], prompts=(2, 5, 9))


def _counted_calls(model, monkeypatch):
    calls = {}
    for op in ("indexer_topk_mx", "indexer_source_mx", "cache_insert_mx", "sparse_attention_mx"):
        impl = getattr(model.ops, op)

        def counted(*a, _op=op, _impl=impl, **kw):
            calls[_op] = calls.get(_op, 0) + 1
            return _impl(*a, **kw)
        monkeypatch.setattr(model.ops, op, counted)
    return calls


def test_the_indexer_shares_one_launch_across_short_spans(monkeypatch):
    """The routed decode step makes one ``indexer_topk_mx`` call per index source that is not the
    candidate source, and one cache insert per cache and layer, whatever the batch."""
    model = _model(True)
    many = _prefilled(model)
    calls = _counted_calls(model, monkeypatch)
    many.step({s: [40 + s] for s in range(len(PROMPTS))})
    cfg = model.cfg
    cand = cfg.candidate_source_layer
    assert calls["indexer_topk_mx"] == sum(1 for i in cfg.index_source_layers if i != cand)
    assert calls["indexer_source_mx"] == len(PROMPTS)     # its op takes no block list: one per sequence
    assert calls["sparse_attention_mx"] == cfg.n_layers
    # window: one per layer; kv sources: index keys + entries, when a group completes somewhere
    assert cfg.n_layers <= calls["cache_insert_mx"] <= cfg.n_layers + 2 * len(cfg.kv_source_layers)
    short = _prefilled(model, (2, 5, 9))
    calls.clear()
    short.step({s: [40 + s] for s in range(3)})
    assert calls["indexer_topk_mx"] == len(cfg.index_source_layers) and "indexer_source_mx" not in calls


@pytest.mark.gpu
@pytest.mark.parametrize("routed", [False, True])
def test_batched_steps_on_cuda(routed):
    """The same on a CUDA device (per-step index tensors through pinned memory, no host sync)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = _model(routed, "cuda")
    _check(model, [{s: [100 + 7 * i + s] for s in range(len(PROMPTS))} for i in range(3)])
    _check(model, [{0: v41util.tokens(SMALL_SPAN + 4, seed=9), 1: [5], 2: [6], 3: [7, 8, 9]}])
