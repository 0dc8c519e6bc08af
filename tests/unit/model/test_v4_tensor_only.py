"""Tensor-only decode steps (what CUDA graphs capture): the model and its ops must read every
per-step value from the metadata tensors. The python lists of these steps are made wrong on
purpose, so any op that still reads them computes a different step and the test fails."""
import math
import random

import pytest
import torch

from redknot.kernels import KernelSet
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.step.metadata import StepMetadata
from redknot.models.deepseek_v4.state import V4State
from redknot.models.deepseek_v4.synthetic import randomize_
from v4_testutil import PARITY_CONFIG

CFG = V4Config.from_hf_dict(PARITY_CONFIG)  # window 8, CSA m=4 (top-4), HCA m=8


def _clone(state: V4State) -> V4State:
    layers = [type(st)(**{k: (None if v is None else v.clone()) for k, v in vars(st).items()}) for st in state.layers]
    mtp = [type(st)(**{k: (None if v is None else v.clone()) for k, v in vars(st).items()}) for st in state.mtp]
    return V4State(state.cfg, state.layout, layers, mtp, state.num_slots, state.num_blocks)


class StaticStep:
    """One tensor-only decode step object whose tensors are refilled in place every step, as a CUDA
    graph's input buffers are: ``pad`` extra rows point at a slot and a block no sequence owns, the
    block tables are wider than any sequence needs, and the python lists describe another step."""

    def __init__(self, b: int, pad: int, width: int, spare_block: int, spare_slot: int, device):
        n = b + pad
        self.b, self.spare_block, self.spare_slot = b, spare_block, spare_slot
        i64 = dict(dtype=torch.long, device=device)
        self.meta = StepMetadata(
            input_ids=torch.zeros(n, **i64), positions=torch.zeros(n, **i64),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_slots=torch.full((n,), spare_slot, dtype=torch.int32, device=device),
            block_tables=torch.full((n, width), spare_block, dtype=torch.int32, device=device),
            logits_indices=torch.arange(n, **i64), num_tokens_per_seq=[1] * n, context_lens=[0] * n,
            seq_slot_list=[spare_slot] * n, query_start_list=[0] * n, tensor_only=True)

    def fill(self, meta: StepMetadata) -> StepMetadata:
        m, b = self.meta, self.b
        m.input_ids[:b].copy_(meta.input_ids)
        m.positions[:b].copy_(meta.positions)
        m.seq_slots[:b].copy_(meta.seq_slots)
        m.block_tables.fill_(self.spare_block)
        m.block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        return m


# The Triton kernels are covered on the GPU (interpreted on the CPU they take minutes here).
@pytest.mark.parametrize("backend,device", [
    ("reference", "cpu"),
    pytest.param("reference", "cuda", marks=pytest.mark.gpu),
    pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
def test_tensor_only_decode_equals_decode(backend, device):
    kernels = KernelSet(backend)
    model = DeepseekV4(CFG, torch.float32, device="cpu", kernels=kernels, with_mtp=False)
    randomize_(model, seed=11)
    model = model.to(device)
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    block_size = math.lcm(*CFG.ratios)  # 8: 2 CSA entries and 1 HCA entry per block
    layout = StateLayout.create(CFG, block_size=block_size, kv_bytes=4)
    prompts = [1, 6, 15, 23]  # windows of 4 and 8 close at different decode steps; one shorter than the window
    steps = 11
    need = [layout.blocks_for(n + steps) for n in prompts]
    num_blocks = sum(need) + 1  # + one no sequence owns
    blocks = list(range(num_blocks - 1))
    random.Random(5).shuffle(blocks)
    tables, at = [], 0
    for n in need:
        tables.append(blocks[at:at + n])
        at += n
    slots = [3, 0, 4, 1]  # slot 2 and the last one are nobody's
    state = V4State.allocate(CFG, layout, 6, num_blocks, device, torch.float32)
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, CFG.vocab_size, (n,), generator=gen).tolist() for n in prompts]
    prefill = StepMetadata.build(ids, [0] * len(prompts), slots, tables, device=device)
    logits = model.compute_logits(model(prefill, state)[prefill.logits_indices])
    eager_state, tensor_state = state, _clone(state)
    static = StaticStep(len(prompts), pad=2, width=max(need) + 2, spare_block=num_blocks - 1, spare_slot=2,
                        device=device)
    lengths = list(prompts)
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        meta = StepMetadata.build([[t] for t in nxt], lengths, slots,
                                  [tb[:layout.blocks_for(n + 1)] for tb, n in zip(tables, lengths)], device=device)
        logits = model.compute_logits(model(meta, eager_state)[meta.logits_indices])
        step = static.fill(meta)
        got = model.compute_logits(model(step, tensor_state)[step.logits_indices])[:len(prompts)]
        torch.testing.assert_close(got, logits, **tol)
        lengths = [n + 1 for n in lengths]
    real_blocks = torch.tensor(blocks, device=device)
    for a, b in zip(eager_state.layers, tensor_state.layers):
        for ta, tb in zip(a.tensors(), b.tensors()):
            rows = real_blocks if ta.shape[0] == num_blocks else torch.tensor(slots, device=device)
            torch.testing.assert_close(tb[rows], ta[rows], **tol)


def test_tensor_only_is_for_decode_steps():
    meta = StepMetadata.build([[1, 2], [3]], [0, 4], [0, 1], [[0], [1]])
    with pytest.raises(ValueError, match="tensor_only is for decode steps"):
        StepMetadata(input_ids=meta.input_ids, positions=meta.positions, query_start_loc=meta.query_start_loc,
                     seq_slots=meta.seq_slots, block_tables=meta.block_tables, logits_indices=meta.logits_indices,
                     num_tokens_per_seq=[2, 1], context_lens=[0, 4], tensor_only=True)
