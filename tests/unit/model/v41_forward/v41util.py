"""Helpers of the V4.1 forward tests: seeded native-format weights, a one-sequence driver over
the paged state, and the tie-aware top-k comparison of reference §7.3."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41.checkpoint import BF16, ENGRAM, F32, FP4, FP8, checkpoint_spec
from redknot.models.deepseek_v41.config import tiny_v41_config
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights
from redknot.models.deepseek_v41.reference import ReferenceV41
from redknot.models.deepseek_v41.state import allocate_state
from redknot.models.deepseek_v41.state_layout import create_state_layout
from redknot.step.metadata import StepMetadata

VOCAB = 2048  # the tests' vocabulary (the tiny model's real one is 129,280: same code, slower head)
COMPRESSED = 1027  # size of the test token map (7919 is prime to it, so every compressed id occurs)


def test_config(**overrides):
    return tiny_v41_config().with_overrides({"vocab_size": VOCAB, "dspark_noise_token_id": VOCAB - 1,
                                             "image_token_id": VOCAB - 2,
                                             "engram_compressed_vocab_size": COMPRESSED, **overrides})


def _value(spec, gen: torch.Generator) -> torch.Tensor:
    shape = spec.shape
    name = spec.name
    if name.endswith(("norm.weight", "k_norm.weight")):
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    if "hc_" in name:
        if name.endswith("_scale"):
            return 0.5 + 0.1 * torch.rand(shape, generator=gen)
        if name.endswith("_base"):
            return 0.5 * torch.randn(shape, generator=gen)
        return 0.05 * torch.randn(shape, generator=gen)
    if name.endswith("attn_sink"):
        return torch.randn(shape, generator=gen)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(("q_weight", "k_weight")):
        return 1 + 0.2 * torch.randn(shape, generator=gen)
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return 0.5 * torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    return torch.randn(shape, generator=gen) * (1.5 / math.sqrt(fan_in))


def random_weights(cfg, seed: int = 0, include_draft: bool = False) -> Dict[str, torch.Tensor]:
    """Every backbone tensor of ``cfg`` (and the DSpark stages' with ``include_draft``) in its native
    stored form (FP8 32x32 tiles, MXFP4 experts, FP8 Engram rows with per-32 E8M0 scales, BF16 norms,
    F32 hc/sink/bias)."""
    gen = torch.Generator().manual_seed(seed)
    out: Dict[str, torch.Tensor] = {}
    for spec in checkpoint_spec(cfg, include_draft=include_draft):
        v = _value(spec, gen)
        if spec.kind == FP8:
            q, s = mx.quant_fp8_blocks(v, 32)
            out[spec.name], out[spec.scale_name] = q, s
        elif spec.kind == FP4:
            out[spec.name], out[spec.scale_name] = mx.quant_mxfp4(v)
        elif spec.kind == ENGRAM:
            q, s = mx.quant_fp8_groups(v, 32, floor=1e-30)
            out[spec.name], out[spec.scale_name] = q, s
        elif spec.kind == BF16:
            out[spec.name] = v.to(torch.bfloat16)
        else:
            assert spec.kind == F32
            out[spec.name] = v.float()
    return out


def token_map_for(cfg) -> torch.Tensor:
    """A fixed many-to-one raw -> compressed map (the hashing only needs some map)."""
    return (torch.arange(cfg.vocab_size) * 7919) % COMPRESSED


class Pair:
    """The oracle and the engine path over the same weights."""

    def __init__(self, cfg=None, numerics: str = "reference", dtype=torch.float64, index_keys: str = "owner",
                 seed: int = 0, device="cpu"):
        self.cfg = cfg or test_config()
        self.num = Numerics(numerics, dtype)
        tensors = random_weights(self.cfg, seed)
        tmap = token_map_for(self.cfg)
        pad_c = int(tmap[self.cfg.engram_pad_id])
        self.ref = ReferenceV41(self.cfg, Weights(tensors, dtype), tmap, pad_c, self.num, index_keys)
        on_device = {k: v.to(device) for k, v in tensors.items()}
        self.model = DeepseekV41(self.cfg, Weights(on_device, dtype), tmap, pad_c, self.num, index_keys,
                                 device=device)


class Seq:
    """One sequence on a private paged state (blocks shuffled so paging is exercised)."""

    def __init__(self, model: DeepseekV41, max_tokens: int, block_size: int = 4, max_backtrack: int = 0,
                 slot: int = 1, num_slots: int = 3, seed: int = 0):
        self.model = model
        self.layout = create_state_layout(model.cfg, block_size=block_size, max_backtrack=max_backtrack)
        nb = 2 * self.layout.blocks_for(max_tokens) + 3   # spare blocks: other sequences, shuffling
        self.state = allocate_state(model.cfg, self.layout, num_slots=num_slots, num_blocks=nb,
                                    device=model.device, dtype=model.dtype)
        perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks = perm[:self.layout.blocks_for(max_tokens)]
        self.slot = slot
        self.tokens: List[int] = []

    def step(self, ids: Sequence[int], replay_from: Optional[int] = None) -> torch.Tensor:
        """Append ids; -> logits of every new row [n, V]."""
        start = len(self.tokens)
        meta = StepMetadata.build([list(ids)], [start], [self.slot], [self.blocks],
                                  list(range(len(ids))), device=self.model.device)
        if replay_from is not None:
            meta.replay_from = [replay_from]
        x = self.model.forward(meta, self.state)
        self.tokens.extend(int(i) for i in ids)
        return self.model.compute_logits(x).cpu()

    def rollback(self, k: int) -> None:
        del self.tokens[len(self.tokens) - k:]


def tokens(n: int, seed: int = 1, vocab: int = VOCAB) -> List[int]:
    return torch.randint(3, vocab - 3, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tie_aware_equal(scores: torch.Tensor, sel_a: torch.Tensor, sel_b: torch.Tensor) -> bool:
    """§7.3: every entry scored strictly above the K-th selected score is in both selections, and
    the entries where they differ score exactly the K-th score. scores [N, n]; sel [N, K] (-1 none)."""
    for row in range(scores.shape[0]):
        a = set(int(i) for i in sel_a[row] if i >= 0)
        b = set(int(i) for i in sel_b[row] if i >= 0)
        if len(a) != len(b):
            return False
        if a == b:
            continue
        kth = min(float(scores[row, i]) for i in a)
        for i in a ^ b:
            if float(scores[row, i]) != kth:
                return False
    return True


def toy_cut(monkeypatch, backend: str = "triton"):
    """``benchmarks/e2e_v41``'s toy cut on the CPU, every V4.1 op on ``backend``'s kernels (``triton``: the
    interpreter), after a 40-token prefill of one sequence: ``(cfg, model, batch, step)`` with ``step`` the tensor
    step of that sequence's next token (id 11). ``benchmarks/`` is on ``sys.path`` for the calling test only."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[4] / "benchmarks"))
    import e2e_v41

    import redknot.models.deepseek_v41.tensor_step as ts
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    dev = torch.device("cpu")
    cfg = e2e_v41.cut_config(True, 100)
    model = e2e_v41.build(cfg, e2e_v41.random_tensors(cfg, dev), "reference", V41Ops(KernelSet(default=backend)), dev)
    batch = e2e_v41.Batch(model, 1, 64, block_size=16)
    batch.step([e2e_v41.tokens(40, cfg.vocab_size, 1)], seqs=[0])
    step = ts.TensorStep(torch.full((1,), 11, dtype=torch.long), torch.tensor(batch.lens), torch.arange(2),
                         torch.arange(1), torch.tensor(batch.blocks))
    return cfg, model, batch, step
