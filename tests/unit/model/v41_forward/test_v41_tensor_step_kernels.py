"""The tensor-only step with its graph-safe Triton kernels (step attention, paged indexer scores, cache
inserts; Triton's CPU interpreter here) against the same step's PyTorch math, layer by layer on the same
inputs: attention outputs within the kernels' bf16 rounding, identical cache bytes, tie-aware equal
top-k sets and equal candidate masks. Decode and verify rows, padding requests, both numerics."""
from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("triton")

import redknot.models.deepseek_v41.tensor_step as ts
import redknot.models.deepseek_v41.tensor_step_sources as tss
from redknot.kernels import KernelSet
from redknot.kernels.capture import cuda_graph
from redknot.models.deepseek_v41 import fused_rows
from redknot.models.deepseek_v41.kernel_ops import V41Ops
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights
from v41_forward.test_v41_tensor_step import Batch, _real_state
from v41_forward.v41util import random_weights, token_map_for, tokens
from v41_forward.v41util import test_config as tiny_config

ATTENTION_OPS = ("cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx", "indexer_source_mx")


@functools.cache
def _tensors():
    cfg = tiny_config()
    return cfg, random_weights(cfg, 0)


def _model(numerics: str, kernels: bool, device: str = "cpu") -> DeepseekV41:
    cfg, tensors = _tensors()
    tensors = {k: v.to(device) for k, v in tensors.items()}
    tmap = token_map_for(cfg)
    ops = None
    if kernels:  # only the attention ops (the GEMMs stay PyTorch: the comparison is about the step kernels)
        ops = V41Ops(KernelSet(default="triton"))
        for op in list(ops.choice):
            if op not in ATTENTION_OPS:
                setattr(ops, op, None)
                ops.choice[op] = "pytorch"
    return DeepseekV41(cfg, Weights(tensors, torch.bfloat16), tmap, int(tmap[cfg.engram_pad_id]),
                       Numerics(numerics, torch.bfloat16), device=device, ops=ops)


def _tie_aware_equal(a: torch.Tensor, b: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Per row: the selections [T, K] (-1 pad) pick scores of equal values (ties at the cut may differ)."""
    def vals(sel):
        v = torch.where(sel >= 0, scores.gather(1, sel.clamp(min=0)), torch.full(sel.shape, float("nan"), device=sel.device))
        return torch.sort(v.nan_to_num(nan=float("-inf")), dim=1).values
    return ((a >= 0).sum(1) == (b >= 0).sum(1)) & (vals(a) == vals(b)).all(1)


class Twins:
    """Runs every attention / compressor / indexer call of the kernel step also as PyTorch math on a
    copy of the state and the published slots, and records the differences."""

    def __init__(self, monkeypatch):
        self.attn_err, self.bytes_differ, self.topk_rows, self.topk_equal, self.cand_differ = 0.0, 0, 0, 0, 0
        self.all_differ = 0   # bytes differing anywhere, spare slot / block included (see _bytes)
        self.calls = {"attend": 0, "compress": 0, "index": 0, "rotated": 0}
        self.mp = monkeypatch
        self.scores = None
        self.torch_cand, self.cand_layers = None, 0
        self.kernel_attend, self.kernel_compress, self.kernel_index = ts._attend, ts._compress, ts._index
        scores_torch = tss._index_scores_torch

        def keep_scores(*a):
            self.scores = scores_torch(*a)
            return self.scores
        monkeypatch.setattr(tss, "_index_scores_torch", keep_scores)
        monkeypatch.setattr(ts, "_attend", self.attend)
        monkeypatch.setattr(ts, "_compress", self.compress)
        monkeypatch.setattr(ts, "_index", self.index)

    def _torch(self, fn, *args):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ts, "step_kernels", lambda w: False)
            m.setattr(tss, "step_kernels", lambda w: False)   # the compressor's and indexer's own check
            return fn(*args)

    def _bytes(self, a, b):
        """Cache bytes of the real requests: every slot but the spare one, every block but the spare one.
        The spare slot and block are scratch that several rows of one step store into (padding rows,
        every ratio-2 row whose group does not close) and no request reads; on a GPU which of those
        concurrent stores lands is unspecified, so they are counted apart, not compared."""
        for x, y in zip(_real_state(None, a), _real_state(None, b)):
            if x.dtype == torch.uint8:
                self.bytes_differ += int((x != y).sum())
        for x, y in zip(a.tensors(), b.tensors()):
            if x.dtype == torch.uint8:
                self.all_differ += int((x != y).sum())

    def attend(self, layer, q, kv, rows, state, topk, inv, tables):
        self.calls["attend"] += 1
        twin = copy.deepcopy(state)
        want, twin_rotated = self._torch(self.kernel_attend, layer, q, kv, rows, twin, topk, inv, tables)
        got, rotated = self.kernel_attend(layer, q, kv, rows, state, topk, inv, tables)
        assert not twin_rotated
        if rotated:   # the kernel's launch ran the output's inverse RoPE too: rotate the PyTorch output alike
            self.calls["rotated"] += 1
            want = fused_rows.rope(want, layer.w, rows.pos, inv, tables, inverse=True)
        want = want.float()
        self.attn_err = max(self.attn_err, ((got.float() - want).abs().max() / want.abs().max()).item())
        self._bytes(state, twin)
        return got, rotated

    def compress(self, layer, u, rows, state):
        self.calls["compress"] += 1
        twin = copy.deepcopy(state)
        self._torch(self.kernel_compress, layer, u, rows, twin)
        self.kernel_compress(layer, u, rows, state)
        self._bytes(state, twin)

    def index(self, layer, u, qr, rows, state, shared):
        self.calls["index"] += 1
        mine = dict(shared, cand=self.torch_cand)         # the PyTorch step's slots of this forward
        self._torch(self.kernel_index, layer, u, qr, rows, state, mine)
        self.kernel_index(layer, u, qr, rows, state, shared)
        if layer.cfg.is_candidate_source(layer.layer):
            self.torch_cand = mine["cand"]                 # [T, n] bool
            ent = shared["cand_entries"]                   # [T, NB·bs] entry ids, -1
            n = self.torch_cand.shape[1]
            keep = torch.zeros(ent.shape[0], n + 1, dtype=torch.bool, device=ent.device)
            keep.scatter_(1, torch.where((ent >= 0) & (ent < n), ent, n), True)
            self.cand_differ += int((keep[:, :n] != self.torch_cand).sum())
            self.cand_layers += 1
        same = _tie_aware_equal(shared["topk"], mine["topk"], self.scores)
        self.topk_rows += same.numel()
        self.topk_equal += int(same.sum())


def _prefilled(model, n_req: int, prompts):
    """A batch of ``model`` whose prompts were prefilled by the PyTorch path (same state bytes, faster
    than the span kernels under the interpreter)."""
    dev = str(model.device)
    b = Batch(model, n_req, device=dev)
    seqs = [tokens(64, seed=30 + i) for i in range(n_req)]
    pre = [seqs[i][:prompts[i]] for i in range(n_req)]
    _model(model.num.mode, kernels=False, device=dev).forward(b.meta(pre), b.state)
    b.advance(pre)
    return b, seqs


# (tokens per request, padding requests) of successive steps: decode rows with a padding request, verify rows
# of 4 / 3 with a decode row and a padding request, then verify rows without padding
STEPS = (([1, 1, 1], (1,)), ([4, 1, 3], (2,)), ([2, 3, 1], ()))


def _layer_by_layer(numerics: str, monkeypatch, device: str = "cpu", steps=STEPS) -> None:
    model = _model(numerics, kernels=True, device=device)
    assert ts.step_kernels(model.w)
    b, seqs = _prefilled(model, 3, [21, 6, 13])
    tw = Twins(monkeypatch)
    for counts, pads in steps:
        chunks = [seqs[i][b.lens[i]:b.lens[i] + n] for i, n in enumerate(counts)]
        out = ts.tensor_forward(model, b.tensor_step(chunks, pads), b.state)
        assert torch.isfinite(out).all()
        b.advance(chunks)
    assert tw.calls["attend"] == len(steps) * model.cfg.n_layers and tw.calls["index"] > 0 and tw.calls["compress"] > 0
    assert tw.attn_err < 1.5e-2, tw.attn_err     # bf16 probabilities before PV, bf16 output
    assert tw.calls["rotated"] == tw.calls["attend"]   # the output's inverse RoPE ran in the attention's launches
    # rings, pages and keys of the requests: quantised on insert, bit-exact
    assert tw.bytes_differ == 0, (tw.bytes_differ, "in the spare slot / block:", tw.all_differ - tw.bytes_differ)
    assert tw.cand_differ == 0 and tw.cand_layers == len(steps)   # one candidate source layer a step
    assert tw.topk_equal == tw.topk_rows > 0
    # the fused mHC sites and row kernels ran (a kernel that fails to build falls back silently)
    assert ts.fused_mhc(model, out.new_empty(0, dtype=torch.bfloat16)) and not fused_rows._FAILED


# ~9 s a step interpreted: by default bf16 runs the three steps and reference numerics the middle one (decode,
# verify and padding rows in one step); reference numerics through all three steps with -m slow
@pytest.mark.parametrize("numerics,steps", [
    pytest.param("bf16", STEPS, id="bf16"),
    pytest.param("reference", STEPS, id="reference", marks=pytest.mark.slow),
    pytest.param("reference", STEPS[1:2], id="reference-one-step")])
def test_kernel_step_matches_pytorch_step_layer_by_layer(numerics, steps, monkeypatch):
    _layer_by_layer(numerics, monkeypatch, steps=steps)


def test_pytorch_step_is_used_without_triton_ops():
    assert not ts.step_kernels(_model("bf16", kernels=False).w)
    ref = V41Ops(KernelSet(default="reference"), route_all=True)
    assert ref.attention and not ts.step_kernels(type("W", (), {"ops": ref})())


def test_kernel_step_equals_eager_span_kernels_end_to_end():
    """The eager step with the span kernels and the tensor step with the step kernels compute the same
    arithmetic (same launch shapes, same row order): their outputs agree far inside what the PyTorch
    math vs kernel rounding gives after a few layers."""
    model = _model("bf16", kernels=True)
    b, seqs = _prefilled(model, 2, [21, 13])
    twin = copy.deepcopy(b.state)
    chunks = [[seqs[0][21]], [seqs[1][13]]]
    got = ts.tensor_forward(model, b.tensor_step(chunks, ()), b.state).float()
    eager_state, b.state = b.state, twin
    want = model.forward(b.meta(chunks), b.state).float()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel < 1e-3, rel
    b.state = eager_state


# ---------------------------------------------------------------------- GPU
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["bf16", "reference"])
def test_gpu_kernel_step_matches_pytorch_step_layer_by_layer(numerics, monkeypatch):
    _needs_cuda()
    _layer_by_layer(numerics, monkeypatch, device="cuda")


@pytest.mark.gpu
def test_gpu_kernel_step_graph_replay_no_sync():
    """The kernel step runs without a host sync, is captured in a CUDA graph, and every replay (fresh
    step contents, same shape) equals the same step run uncaptured on a twin state: real rows and
    the real requests' state bytes."""
    _needs_cuda()
    model = _model("reference", kernels=True, device="cuda")
    b, seqs = _prefilled(model, 3, [21, 6, 13])
    shape, pads = [2, 1, 3], (2,)
    chunks = [seqs[i][b.lens[i]:b.lens[i] + n] for i, n in enumerate(shape)]
    static = b.tensor_step(chunks, pads)
    ts.tensor_forward(model, static, copy.deepcopy(b.state))            # warm-up: weight caches, tuners
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ts.tensor_forward(model, static, copy.deepcopy(b.state))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with cuda_graph(graph):
        out = ts.tensor_forward(model, static, b.state)
    for step in range(3):
        counts = [shape[(i + step) % 3] for i in range(3)]
        chunks = [seqs[i][b.lens[i]:b.lens[i] + n] for i, n in enumerate(counts)]
        fresh = b.tensor_step(chunks, pads)
        for name in ("input_ids", "positions", "query_start_loc", "seq_slots", "block_tables"):
            getattr(static, name).copy_(getattr(fresh, name))
        twin = copy.deepcopy(b.state)
        want = ts.tensor_forward(model, fresh, twin)
        graph.replay()
        torch.cuda.synchronize()
        n_real = sum(counts)     # padding rows share the spare slot/block, whose racing writes may differ
        assert torch.equal(out[:n_real], want[:n_real]), step
        for x, y in zip(_real_state(b, b.state), _real_state(b, twin)):
            assert torch.equal(x, y), step
        b.advance(chunks)
