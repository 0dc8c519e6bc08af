"""The Gluon prefill kernel of ``sparse_attention_mx`` (``attention_prefill_mx_wg``): the prefill tuner offers its
shapes only where Gluon imports and only shapes whose shared memory fits a Hopper SM; bad launch shapes and
off-GPU calls are refused with messages naming the shape; on an SM90 GPU (``-m gpu``) every shape passes the
first-use guard and matches ``ref_v41.sparse_attention_mx`` on fresh random inputs at V4.1 width (both cache
kinds, the window alone, a short window, a query with nothing visible returning 0) and on 2048 queries. Gluon
has no interpreter, so its numbers come from the GPU cases only. Bound 1e-2 norm-wise, as the other prefill
launch shapes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import attention_mx
from redknot.kernels.triton import attention_prefill_mx as prefill
from redknot.kernels.triton import attention_prefill_mx_wg as wg
from redknot.kernels.triton.checks_mx import REAL_V41, TOY_V41, attention_inputs

SHAPES = [c for c in attention_mx.ATTN_MX_PREFILL_TUNER.candidates if isinstance(c, wg.PrefillMXWGConfig)]
HOPPER_SMEM = 227 * 1024


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_the_tuner_offers_the_gluon_shapes_where_gluon_imports():
    assert bool(SHAPES) == wg.AVAILABLE
    for cfg in SHAPES:
        assert wg.smem_bytes(cfg, REAL_V41.latent) + 1024 <= HOPPER_SMEM, cfg
        assert cfg.stages >= 3, cfg
    assert wg.smem_bytes(wg.PrefillMXWGConfig(64, 3), REAL_V41.latent) > HOPPER_SMEM  # not offered: too big


@pytest.mark.parametrize("cfg,match", [(wg.PrefillMXWGConfig(32, 2), "3 or more stages"),
                                       (wg.PrefillMXWGConfig(48, 3), "16 / 32 / 64 keys")])
def test_the_launch_refuses_shapes_it_cannot_run(cfg, match):
    q, win, widx, comp, cidx, sinks = attention_inputs(TOY_V41, "cpu", seed=_fresh_seed())
    if not wg.AVAILABLE:
        pytest.skip("no Gluon in this Triton")
    with pytest.raises(ValueError, match=match):
        wg.prefill_attention_mx_wg(q, win, widx, sinks, 0.1, comp, cidx, cfg)


def test_the_op_refuses_the_gluon_kernel_off_the_gpu():
    q, win, widx, comp, cidx, sinks = attention_inputs(TOY_V41, "cpu", seed=_fresh_seed())
    with pytest.raises(RuntimeError, match=r"PrefillMXWGConfig\(block_n=32, stages=3\).*SM90 GPU only"):
        attention_mx.sparse_attention_mx(q, win, widx, sinks, 0.1, comp, cidx, config=wg.PrefillMXWGConfig())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("with_comp", [True, False], ids=["window+compressed", "window"])
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_gluon_kernel_matches_the_reference_at_v41_width(cfg, with_comp):
    seed = _fresh_seed()
    q, win, widx, comp, cidx, sinks = attention_inputs(REAL_V41, "cuda", seed=seed, tokens=6, n_window=256,
                                                       n_comp=1024)
    q = q.to(torch.bfloat16)
    scale = REAL_V41.latent ** -0.5
    comp, cidx = (comp, cidx) if with_comp else (None, None)
    got = wg.prefill_attention_mx_wg(q, win, widx, sinks, scale, comp, cidx, cfg)
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    assert _rel(got, want) < 1e-2, (cfg, seed)
    assert _rel(got[0], want[0]) < 1e-2, (cfg, seed)  # the short window (and no compressed entry)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # nothing visible


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gluon_kernel_at_real_size_and_its_first_use_check(monkeypatch):
    seed = _fresh_seed()
    q, win, widx, comp, cidx, sinks = attention_inputs(REAL_V41, "cuda", seed=seed, tokens=2048)
    scale = REAL_V41.latent ** -0.5
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    for cfg in SHAPES:
        monkeypatch.setattr(prefill, "_FIRST_USE", {})
        assert prefill.first_use_ok(cfg, q.device), cfg
        got = attention_mx.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx, config=cfg)
        assert _rel(got, want) < 1e-2, (cfg, seed)
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    real = wg.prefill_attention_mx_wg
    monkeypatch.setattr(wg, "prefill_attention_mx_wg",
                        lambda q, win, widx, sinks, scale, comp=None, cidx=None, config=None:
                        real(q, win, widx, sinks, scale, None, None, config))
    assert not prefill.first_use_ok(SHAPES[0], q.device)  # a kernel that drops its compressed rows is refused
