"""The Gluon prefill kernel of V4's ``sparse_attention_paged`` (``attention_prefill_wg``): the tuner offers its
shapes only where Gluon imports and only shapes whose shared memory fits a Hopper SM; the op refuses it for
fp32 rows and off the GPU with a message naming the shape; on an SM90 GPU (``-m gpu``) every shape passes the
first-use guard in each compiled form and matches the float64 oracle on fresh random inputs, at V4 width and
on a real 4096-query chunk, with every output row written. Gluon has no interpreter, so its numbers come from
the GPU cases only. Tolerance 1e-2 norm-wise, as the Triton forms."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels.triton import attention, oracle
from redknot.kernels.triton import attention_prefill as prefill
from redknot.kernels.triton import attention_prefill_wg as wg

SHAPES = [c for c in attention.ATTN_PREFILL_TUNER.candidates if isinstance(c, wg.PrefillWGConfig)]
HOPPER_SMEM = 227 * 1024  # the most dynamic shared memory one CTA may take on SM90
V4 = {"heads": 64, "dim": 512, "window": 128, "ratio": 4, "block_size": 256, "topk": 512, "ctx": 2100, "new": 5}


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_the_tuner_offers_the_gluon_shapes_where_gluon_imports():
    assert bool(SHAPES) == wg.AVAILABLE
    for cfg in SHAPES:
        assert wg.smem_bytes(cfg, 512) + 1024 <= HOPPER_SMEM, cfg  # + the compiler's reduction scratch
        assert cfg.block_n % 32 == 0 and cfg.stages >= 2, cfg
    # a shape that cannot fit is not offered: three 64-key buffers at D = 512
    assert wg.smem_bytes(wg.PrefillWGConfig(64, 3), 512) > HOPPER_SMEM


def test_the_op_refuses_the_gluon_kernel_for_fp32_rows():
    args = prefill.check_inputs("cpu", seed=_fresh_seed(), dtype=torch.float32, heads=4, dim=64, window=8, ratio=4,
                                block_size=16, topk=7, ctx=37, new=3)
    with pytest.raises(ValueError, match="bf16"):
        attention.sparse_attention_paged(**{**args, "out": None}, config=wg.PrefillWGConfig())


def test_the_op_refuses_the_gluon_kernel_off_the_gpu():
    args = prefill.check_inputs("cpu", seed=_fresh_seed(), heads=4, dim=64, window=8, ratio=4, block_size=16,
                                topk=7, ctx=37, new=3)
    with pytest.raises(RuntimeError, match=r"PrefillWGConfig\(block_n=64, stages=2\).*SM90 GPU only"):
        attention.sparse_attention_paged(**{**args, "out": None}, config=wg.PrefillWGConfig())


@pytest.mark.parametrize("cfg", [wg.PrefillWGConfig(32, 1), wg.PrefillWGConfig(48, 2)], ids=str)
def test_the_launch_refuses_shapes_it_cannot_run(cfg):
    args = prefill.check_inputs("cpu", seed=_fresh_seed(), heads=4, dim=64, window=8, ratio=4, block_size=16,
                                topk=7, ctx=37, new=3)
    if not wg.AVAILABLE:
        pytest.skip("no Gluon in this Triton")
    with pytest.raises(ValueError, match="keys a block and at least"):
        wg.launch_prefill_wg(cfg, **args)


def test_the_launch_refuses_rows_it_cannot_tile():
    args = prefill.check_inputs("cpu", seed=_fresh_seed(), heads=4, dim=48, window=8, ratio=4, block_size=16,
                                topk=7, ctx=37, new=3)
    with pytest.raises((ValueError, RuntimeError), match="bf16 rows of a multiple of 64 columns|Gluon"):
        wg.launch_prefill_wg(wg.PrefillWGConfig(), **args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("comp", ["topk", "all", "none"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "inv-rope"])
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_gluon_kernel_matches_oracle_at_v4_width(comp, rope, cfg):
    seed = _fresh_seed()
    args = prefill.check_inputs("cuda", seed=seed, comp=comp, rope=rope, **V4)
    args["out"].fill_(float("nan"))  # poisoned: every row must be written
    got = wg.launch_prefill_wg(cfg, **args)
    want = oracle.sparse_attention_paged(**{k: v for k, v in args.items() if k != "out"})
    assert bool(torch.isfinite(got).all()), (cfg, seed)
    assert _rel(got, want) < 1e-2, (cfg, comp, rope, seed)
    # a query whose key list ends inside a block, and one with no compressed entry: the last row
    assert _rel(got[-1], want[-1]) < 1e-2, (cfg, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_first_use_check_accepts_each_shape_and_refuses_a_wrong_one(monkeypatch):
    for cfg in SHAPES:
        for comp, rope in (("topk", False), ("topk", True), ("all", True), ("none", False)):
            monkeypatch.setattr(prefill, "_FIRST_USE", {})
            assert prefill.first_use_ok(cfg, torch.device("cuda"), rope, comp), (cfg, comp, rope)
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    real = wg.launch_prefill_wg
    monkeypatch.setattr(wg, "launch_prefill_wg", lambda c, **a: real(c, **dict(a, sink=None)))
    assert not prefill.first_use_ok(SHAPES[0], torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["csa", "hca"])
def test_gluon_kernel_at_real_size(mode):
    """A 4096-query chunk at context 8192 with V4 dims: each shape against the float64 oracle on 128 sampled
    queries and against the Triton transposed kernel on all of them."""
    from redknot.kernels.triton.checks.common import REAL, prefill_attention_args
    gen = torch.Generator().manual_seed(_fresh_seed())
    args = prefill_attention_args(REAL, mode, 8192, 4096, "cuda", gen)
    t = args["q"].shape[0]
    base = attention.sparse_attention_paged(**args, config=attention.PrefillTConfig(128, 8, 4, 64))
    rows = torch.randperm(t, generator=gen)[:128].cuda()
    sub = dict(args, q=args["q"][rows], positions=args["positions"][rows], token_seq=args["token_seq"][rows],
               topk=args["topk"][rows])
    want = oracle.sparse_attention_paged(**sub)
    for cfg in SHAPES:
        got = attention.sparse_attention_paged(**args, config=cfg)
        assert _rel(got[rows], want) < 1e-2, cfg
        assert _rel(got, base) < 1e-2, cfg
