"""The V4.1 engine path routed through the registry's shipped-format ops against its own PyTorch math.

Same tiny model (every layer type), same kept FP8/MXFP4 weights; chunked prefill then decode steps
across ring wraps and ratio-2 groups. The registry ops compute in fp32, so the comparison runs the
model in fp64 where a tiny fp32 difference cannot flip a quantisation step: attention, cache inserts,
indexer and Engram under ``model.numerics=bf16`` (no FP8 activation rounding after them), the FP8
linears under ``reference`` numerics; the MXFP4 experts (bf16 roundings inside by contract) are
compared layer by layer in bf16.
"""
from __future__ import annotations

import pytest
import torch

from redknot.kernels import KernelSet
from redknot.models.deepseek_v41.kernel_ops import OPS, V41Ops
from redknot.models.deepseek_v41.attention import Slots
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.moe import moe_forward
from redknot.models.deepseek_v41.ref_math import Numerics, Weights
from v41_forward import v41util

PROMPT = 61
ATTENTION = ("cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx", "indexer_source_mx", "engram_gather_mx")


def _ops(routed):
    ops = V41Ops(KernelSet(default="reference"), route_all=True)
    for op in OPS:
        if op not in routed:
            setattr(ops, op, None)
    return ops


def _model(ops, tensors, cfg, numerics, dtype=torch.float64):
    tmap = v41util.token_map_for(cfg)
    w = Weights(dict(tensors), dtype, keep=True)
    return DeepseekV41(cfg, w, tmap, int(tmap[cfg.engram_pad_id]), Numerics(numerics, dtype), ops=ops)


def _run(model, ids):
    seq = v41util.Seq(model, len(ids))
    out = [seq.step(ids[:23]), seq.step(ids[23:PROMPT])]
    record = {k: v.clone() for k, v in model.last_slots.record.items()}
    out += [seq.step([ids[p]]) for p in range(PROMPT, len(ids))]
    return torch.cat(out), record


@pytest.fixture(scope="module")
def setup():
    cfg = v41util.test_config()
    return cfg, v41util.random_weights(cfg, 0), v41util.tokens(PROMPT + 20)


def test_cpu_target_routes_nothing_and_every_op_resolves():
    assert V41Ops.create(KernelSet(default="reference")) is None
    assert V41Ops.create(None) is None
    ops = V41Ops(KernelSet(default="reference"), route_all=True)
    assert all(ops.choice[op] == "reference" for op in OPS) and ops.attention


class _Twin:
    """Runs layer i of the PyTorch model and, on a copy of the state and the same inputs, the same
    layer routed through the registry; records the largest output difference and any state or
    selection mismatch (one layer at a time, so a quantisation step flipped by fp32 rounding upstream
    cannot make the paths diverge)."""

    def __init__(self, plain, routed, log):
        self.plain, self.routed, self.log = plain, routed, log

    def __call__(self, u, pos, spans, state, slots):
        import copy

        if self.plain.layer == 0:
            self.log["slots"] = Slots()
        mine = self.log["slots"]
        mine.topk = None if slots.topk is None else slots.topk.clone()
        st = copy.deepcopy(state)
        got = self.routed(u, pos, spans, st, mine)
        want = self.plain(u, pos, spans, state, slots)
        e = float((got - want).abs().max() / want.abs().max())
        self.log["err"] = max(self.log.get("err", 0.0), e)
        for a, b in zip(st.tensors(), state.tensors()):
            if not torch.equal(a, b):
                self.log.setdefault("state", []).append(self.plain.layer)
        if self.plain.cfg.is_index_source(self.plain.layer):
            same = torch.equal(mine.topk.sort(1).values, slots.topk.sort(1).values)
            self.log.setdefault("topk", []).append(same)
        return want


def test_sm90_target_routes_every_op():
    pytest.importorskip("triton")
    ops = V41Ops.create(KernelSet(default="triton"))
    assert ops is not None and ops.attention
    assert all(ops.choice[op] == "triton" for op in OPS)


def _select_lower_first(scores, topk):
    """The op contract's selection written from the model's ``topk_ids`` (lower entry first on exact
    ties, which the tiny indexer has many of: relu zeros, FP4 grids)."""
    from redknot.models.deepseek_v41.ref_math import topk_ids

    k = min(topk, scores.shape[1])
    ids = topk_ids(scores, k)
    ids = torch.where(scores.gather(1, ids) > float("-inf"), ids, -1)
    ids = torch.where(ids < 0, torch.iinfo(torch.int32).max, ids).sort(1).values
    ids = torch.where(ids == torch.iinfo(torch.int32).max, -1, ids).to(torch.int32)
    return torch.cat([ids, ids.new_full((ids.shape[0], topk - k), -1)], 1)


def test_reference_selection_breaks_ties_to_the_lower_id():
    """``ref_v41``'s top-k (the reference ops' selection, which the eager step runs) picks the same set
    as the model's ``topk_ids`` on tie-heavy scores, -inf entries and k above the row length included:
    the tensor-only step's ``select_topk`` uses that rule, so a device top-k with another tie order
    would make eager and graph steps select different entries."""
    from redknot.kernels import ref_v41

    g = torch.Generator().manual_seed(3)
    for n, k in ((40, 8), (7, 8), (300, 64)):
        s = torch.randint(0, 4, (16, n), generator=g).float()          # four distinct values: ties everywhere
        s[torch.rand(16, n, generator=g) < 0.2] = float("-inf")
        assert torch.equal(ref_v41._select(s, k), _select_lower_first(s, k)), (n, k)


def test_attention_indexer_caches_through_the_registry(setup):
    cfg, tensors, ids = setup
    plain = _model(None, tensors, cfg, "bf16")
    routed = _model(_ops(ATTENTION), tensors, cfg, "bf16")
    log = {}
    plain.attn = [_Twin(a, b, log) for a, b in zip(plain.attn, routed.attn)]
    _run(plain, ids)
    assert log["err"] < 1e-5, log["err"]
    assert "state" not in log, log["state"]          # cache bytes written by the op equal the PyTorch packing
    assert len(log["topk"]) > 3 * 20 and all(log["topk"])


def test_engram_gather_through_the_registry(setup):
    cfg, tensors, ids = setup
    want, _ = _run(_model(None, tensors, cfg, "bf16"), ids)
    got, _ = _run(_model(_ops(("engram_gather_mx",)), tensors, cfg, "bf16"), ids)
    assert float((got - want).abs().max()) < 1e-9


def test_fp8_linears_through_the_registry(setup):
    cfg, tensors, ids = setup
    want, _ = _run(_model(None, tensors, cfg, "reference"), ids)
    got, _ = _run(_model(_ops(("linear_mx",)), tensors, cfg, "reference"), ids)
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err < 1e-5, err   # routed (fp32 GEMM), and the same up to fp32 rounding


@pytest.mark.parametrize("layer", [0, 3])
def test_mxfp4_experts_through_the_registry(setup, layer):
    cfg, tensors, _ = setup
    num = Numerics("reference", torch.bfloat16)
    u = torch.randn(37, cfg.dim, generator=torch.Generator().manual_seed(layer)).bfloat16()
    plain = moe_forward(u, Weights(dict(tensors), torch.bfloat16, keep=True), layer, cfg, num).float()
    w = Weights(dict(tensors), torch.bfloat16, keep=True)
    w.ops = _ops(("moe_mx",))
    routed = moe_forward(u, w, layer, cfg, num).float()
    assert layer_prefix_stacked(w, layer)
    # bf16 roundings at different places (the routed sum is bf16 before the shared expert): a few ulps.
    tol = 4 * 2.0 ** -8 * plain.abs().max()
    assert (routed - plain).abs().max() <= tol


def layer_prefix_stacked(w: Weights, layer: int) -> bool:
    """The routed call used the stacked experts (the per-expert tensors became views of one stack)."""
    a = w.tensors[f"layers.{layer}.ffn.experts.0.w1.weight"]
    b = w.tensors[f"layers.{layer}.ffn.experts.1.w1.weight"]
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
