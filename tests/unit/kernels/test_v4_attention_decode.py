"""The decode launch shapes of V4's ``sparse_attention_paged`` (``AttnDecodeConfig``: key splits as short as one
block, 16-64 heads a program) against the float64 oracle on fresh random inputs under Triton's CPU interpreter
(toy widths: the window alone, top-k lists with -1 pads, every visible entry, the fused inverse RoPE; a query
with no compressed entry), the split count they ask for, and the decode classes of the tuner. Tolerance 1e-2
norm-wise (bf16 rows and probabilities)."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import attention, oracle
from redknot.kernels.triton import attention_prefill as prefill
from redknot.kernels.triton.attention import AttnConfig, AttnDecodeConfig

TOY = {"heads": 20, "dim": 64, "window": 24, "ratio": 4, "block_size": 16, "topk": 40, "ctx": 181, "new": 1}
SHAPES = [AttnDecodeConfig(block_h=16, block_n=16, num_warps=4, split_keys=16),
          AttnDecodeConfig(block_h=32, block_n=16, num_warps=4, split_keys=32),
          AttnDecodeConfig(block_h=64, block_n=16, num_warps=4, split_keys=16)]


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("comp", ["topk", "all", "none"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "inv-rope"])
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_decode_shapes_match_oracle(comp, rope, cfg, kernel_device):
    seed = _fresh_seed()
    args = prefill.check_inputs(kernel_device, seed=seed, comp=comp, rope=rope, **TOY)
    args["out"].fill_(float("nan"))  # poisoned: every row must be written
    want = oracle.sparse_attention_paged(**{k: v for k, v in args.items() if k != "out"})
    got = attention.sparse_attention_paged(**args, config=cfg)
    assert _rel(got, want) < 1e-2, (cfg, seed)


def test_short_splits_spread_a_batch_one_step():
    """At one query row a decode shape splits the keys into blocks of ``split_keys``; the general shape keeps four
    blocks a split (a 640-key CSA step: 5 splits against 20)."""
    general = AttnConfig(block_h=64, block_n=32)
    short = AttnDecodeConfig(block_h=64, block_n=32, split_keys=32)
    assert attention._choose_splits(general, 1, 1, 640, 132) == 5
    assert attention._choose_splits(short, 1, 1, 640, 132) == 20
    assert attention._choose_splits(AttnDecodeConfig(block_h=64, block_n=64, split_keys=32), 1, 1, 640, 132) == 10
    # enough programs already: no split
    assert attention._choose_splits(short, 300, 1, 640, 132) == 1


def test_decode_classes_use_their_own_tuner(monkeypatch, kernel_device):
    """Decode rows pick from the decode tuner, keyed by the row count's power of two; the first candidate off the
    GPU. The candidates keep the general shapes first."""
    seen = []

    def pick(self, key, run, device):
        seen.append((self.name, key))
        return self.candidates[0]

    monkeypatch.setattr(attention.ConfigTuner, "pick", pick)
    dec = attention.ATTN_DECODE_TUNER
    assert dec.candidates[:len(attention.ATTN_TUNER.candidates)] == attention.ATTN_TUNER.candidates
    assert any(isinstance(c, AttnDecodeConfig) for c in dec.candidates)
    args = prefill.check_inputs(kernel_device, seed=3, comp="topk", **{**TOY, "new": 2})
    attention.sparse_attention_paged(**{k: v for k, v in args.items() if k != "out"})
    assert seen == [("sparse_attention_decode", (1, "decode", 20, 64, "torch.bfloat16", False, 4))]


@pytest.mark.gpu
@pytest.mark.parametrize("comp", ["topk", "all", "none"])
@pytest.mark.parametrize("cfg", [c for c in attention.ATTN_DECODE_TUNER.candidates if isinstance(c, AttnDecodeConfig)],
                         ids=str)
def test_decode_shapes_at_v4_width_on_the_gpu(cfg, comp):
    """V4's widths (64 heads x 512, window 128, 512 top-k entries, RoPE 64) on the GPU, fresh inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    seed = _fresh_seed()
    args = prefill.check_inputs("cuda", seed=seed, comp=comp, rope=True, heads=64, dim=512, window=128, ratio=4,
                                block_size=64, topk=512, ctx=3000, new=1)
    want = oracle.sparse_attention_paged(**{k: v for k, v in args.items() if k != "out"})
    got = attention.sparse_attention_paged(**args, config=cfg)
    assert _rel(got, want) < 1e-2, (cfg, seed)
