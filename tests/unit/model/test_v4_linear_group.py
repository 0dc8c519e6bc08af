"""V4's projection groups (``LinearGroup``, ``DeepseekV4.fuse_projections``): the linears that read one input
run as one linear per storage format over the concatenated weights. Checked: a group's outputs against its
members' own outputs (float and FP8 members with their block scales, a member whose scale rows do not line up),
the members' parameters view the concatenation with their values and names unchanged, a member whose storage is
replaced makes the group run unfused, the row limit, and the tiny model's steps (prefill, then decode; logits and
every state tensor) with and without the groups, with the linear launches a step counted."""
import copy

import pytest
import torch

from redknot.kernels import KernelSet
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.layers import Linear, LinearGroup
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.params import FLOAT, FP8, ParamFactory
from redknot.models.deepseek_v4.state import V4State
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.models.deepseek_v4.synthetic import TINY_ARCHITECTURE, randomize_, synthetic_config
from redknot.step.metadata import StepMetadata
from v4_testutil import PARITY_CONFIG

CFG = V4Config.from_hf_dict(PARITY_CONFIG)


class CountingKernels:
    """The reference kernel set, counting its ``linear`` calls (the group's launches) and their output widths."""

    def __init__(self, base: KernelSet):
        self.base, self.widths = base, []

    def linear(self, x, weight, scale=None):
        self.widths.append(weight.shape[0])
        return self.base.linear(x, weight, scale)

    def __getattr__(self, name):
        return getattr(self.base, name)


def _float_members(sizes, k=48, seed=0):
    f = ParamFactory(CFG, torch.float32, device="cpu")
    g = torch.Generator().manual_seed(seed)
    members = [Linear(f, n, k, FLOAT) for n in sizes]
    for m in members:
        m.weight.data.copy_(torch.randn(m.weight.shape, generator=g))
    return members


def test_group_outputs_equal_the_members_and_the_parameters_view_the_concatenation():
    members = _float_members([40, 24, 8])
    group = LinearGroup(members)
    ks = CountingKernels(KernelSet())
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(1))
    before = [m(ks.base, x) for m in members]
    saved = [m.weight.detach().clone() for m in members]
    params = [m.weight for m in members]
    assert group(ks, x) and len(ks.widths) == 3  # unfused: one launch a member
    assert group.fuse() == 2
    ks.widths.clear()
    got = group(ks, x)
    assert ks.widths == [72]  # one launch, every member's rows
    for a, b in zip(got, before):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fused = group.weight0
    for m, p, w, r0 in zip(members, params, saved, (0, 40, 64)):
        assert m.weight is p and torch.equal(m.weight, w)  # same Parameter, same values
        assert m.weight.data_ptr() == fused[r0].data_ptr()
    assert not any(name.startswith("weight") for name in group.state_dict())  # names stay the members'


def test_an_in_place_load_reaches_the_group_and_a_replaced_weight_unfuses_it():
    members = _float_members([16, 16])
    group = LinearGroup(members)
    group.fuse()
    ks = KernelSet()
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2))
    members[1].weight.data.mul_(2.0)  # in place: the concatenation sees it
    torch.testing.assert_close(group(ks, x)[1], members[1](ks, x), rtol=1e-5, atol=1e-6)
    members[0].weight.data = torch.randn(16, 48, generator=torch.Generator().manual_seed(3))  # new storage
    got = group(ks, x)
    torch.testing.assert_close(got[0], x @ members[0].weight.T, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], members[1](ks, x), rtol=1e-5, atol=1e-6)


def test_rows_over_the_limit_run_the_members():
    members = _float_members([8, 8])
    group = LinearGroup(members, max_rows=2)
    group.fuse()
    ks = CountingKernels(KernelSet())
    group(ks, torch.randn(2, 48))
    assert ks.widths == [16]
    ks.widths.clear()
    group(ks, torch.randn(3, 48))
    assert ks.widths == [8, 8]


def test_fp8_members_group_with_their_block_scales():
    cfg = synthetic_config(TINY_ARCHITECTURE, quantize_fp8=True)
    f = ParamFactory(cfg, torch.bfloat16, keep_quantized=True, device="cpu")
    g = torch.Generator().manual_seed(4)
    k = 256
    # two FP8 members of whole 128-row scale blocks, one FP8 member of 64 rows (its scale row covers half a
    # block: concatenating it would shift the next member's scales), one float member
    members = [Linear(f, 256, k, FP8), Linear(f, 128, k, FP8), Linear(f, 64, k, FP8), Linear(f, 96, k, FLOAT)]
    for m in members:
        m.weight.data.copy_(torch.randn(m.weight.shape, generator=g).to(m.weight.dtype))
        if m.scale is not None:
            m.scale.data.copy_(torch.rand(m.scale.shape, generator=g) + 0.5)
    ks = CountingKernels(KernelSet())
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    before = [m(ks.base, x) for m in members]
    group = LinearGroup(members)
    assert group.fuse() == 1
    got = group(ks, x)
    assert sorted(ks.widths) == [64, 96, 384]
    for a, b in zip(got, before):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert members[1].scale.data_ptr() == group.scale0[2].data_ptr()


def _tables(layout, lengths, steps):
    need = [layout.blocks_for(n + steps) for n in lengths]
    out, at = [], 0
    for n in need:
        out.append(list(range(at, at + n)))
        at += n
    return out, at


@pytest.mark.parametrize("decode_steps", [6])
def test_fused_model_steps_equal_unfused(decode_steps):
    plain = DeepseekV4(CFG, torch.float32, device="cpu", kernels=KernelSet(), with_mtp=False)
    randomize_(plain, seed=5)
    fused = copy.deepcopy(plain)
    # 2 attention layers of 7 x-projections (CSA), 1 of 4 (HCA), 1 of 2 (window): 6 + 6 + 3 + 1; q groups: 2
    assert fused.fuse_projections() == 18
    layout = StateLayout.create(CFG, block_size=8, kv_bytes=4)
    lengths = [13, 5]
    tables, blocks = _tables(layout, lengths, decode_steps)
    states = [V4State.allocate(CFG, layout, 2, blocks, "cpu", torch.float32) for _ in range(2)]
    gen = torch.Generator().manual_seed(6)
    ids = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    meta = StepMetadata.build(ids, [0, 0], [0, 1], tables)
    counts = []
    for step in range(decode_steps + 1):
        outs = []
        for model, state in zip((plain, fused), states):
            ks = CountingKernels(KernelSet())
            model.set_kernels(ks)
            outs.append(model.compute_logits(model(meta, state)[meta.logits_indices]))
            counts.append(len(ks.widths))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        nxt = outs[0].argmax(-1).tolist()
        meta = StepMetadata.build([[t] for t in nxt], lengths, [0, 1], tables)
        lengths = [n + 1 for n in lengths]
    for a, b in zip(states[0].layers, states[1].layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            torch.testing.assert_close(tb, ta, rtol=1e-5, atol=1e-5)
    # the prefill's 18 rows pass the q groups' limit of 16: 16 launches fewer; a decode step's 2 rows: 18
    assert counts[0] - counts[1] == 16 and counts[-2] - counts[-1] == 18
