"""The transposed prefill kernel of ``sparse_attention_mx`` (``attention_prefill_mx``) against the reference
attention on fresh random inputs: toy and odd shapes (short windows, a query with no valid row, lists whose
length is no multiple of the block, both cache kinds and the window alone) under Triton's CPU interpreter, one
query at V4.1 width (64 heads x 512, 128 window rows, 512 compressed entries: the launch ``tools/sm90_compile.py``
compiles for sm_90a), and real sizes on the GPU (``-m gpu``). Tolerance as ``checks_mx``: 2e-2 norm-wise
(bf16 probabilities); the GPU bound is 1e-2 as for the other prefill launch shapes."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import ref_v41
from redknot.kernels.triton import attention_mx
from redknot.kernels.triton import attention_prefill_mx as prefill
from redknot.kernels.triton.checks_mx import (
    REAL_V41,
    TOY_V41,
    V41Dims,
    attention_inputs,
)

ODD = V41Dims(heads=3, latent=64, window=5, attn_topk=9, attn_tokens=4, entries=37)
CANDIDATES = [c for c in attention_mx.ATTN_MX_PREFILL_TUNER.candidates if isinstance(c, prefill.PrefillAttnConfig)]
# launch shapes besides the tuner's, so every column split runs with and without the chunk lookahead
SHAPES = CANDIDATES + [prefill.PrefillAttnConfig(16, 4, 1, 64, 1), prefill.PrefillAttnConfig(32, 4, 2, 16, 1),
                      prefill.PrefillAttnConfig(16, 4, 1, 64, 1, lookahead=True),
                      prefill.PrefillAttnConfig(32, 4, 2, 16, 1, lookahead=True)]


def _fresh_seed() -> int:
    return int(torch.randint(0, 2 ** 31 - 1, (), generator=torch.Generator().manual_seed(torch.seed())).item())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_the_prefill_tuner_offers_the_transposed_kernel():
    assert CANDIDATES, "no attention_prefill_mx launch shape among the prefill tuner's candidates"
    assert all(c.block_n == 64 * c.num_warps // 4 for c in CANDIDATES)  # one 64-key slice per warpgroup


@pytest.mark.parametrize("dims", [TOY_V41, ODD], ids=["toy", "odd"])
@pytest.mark.parametrize("cfg", SHAPES, ids=str)
def test_prefill_kernel_matches_reference(dims, cfg, kernel_device):
    seed = _fresh_seed()
    q, win, widx, comp, cidx, sinks = attention_inputs(dims, kernel_device, seed=seed)
    scale = dims.latent ** -0.5
    got = prefill.prefill_attention_mx(q, win, widx, sinks, scale, comp, cidx, cfg)
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    assert _rel(got, want) < 2e-2, (cfg, seed)
    assert torch.equal(got[1], torch.zeros_like(got[1])), "a query with no valid row must return 0"
    got_w = prefill.prefill_attention_mx(q, win, widx, sinks, scale, config=cfg)
    assert _rel(got_w, ref_v41.sparse_attention_mx(q, win, widx, sinks, scale)) < 2e-2, (cfg, seed)
    # the op with the launch shape as its config runs the same kernel
    same = attention_mx.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx, config=cfg)
    assert torch.equal(same, got)


def test_the_tolerance_sees_a_dropped_entry(kernel_device):
    """The bound is tight enough to fail: the reference without the compressed entries of a query, or with
    the sinks moved by 2, is far outside it."""
    q, win, widx, comp, cidx, sinks = attention_inputs(ODD, kernel_device, seed=_fresh_seed())
    got = prefill.prefill_attention_mx(q, win, widx, sinks, 0.05, comp, cidx, CANDIDATES[0])
    cut = cidx.clone()
    cut[3] = -1
    assert _rel(got, ref_v41.sparse_attention_mx(q, win, widx, sinks, 0.05, comp, cut)) > 2e-2
    assert _rel(got, ref_v41.sparse_attention_mx(q, win, widx, sinks + 2, 0.05, comp, cidx)) > 2e-2


@pytest.mark.parametrize("cfg", CANDIDATES, ids=str)
def test_prefill_kernel_at_v41_width(cfg, kernel_device):
    """One query (and an empty one) at V4.1 width: the launch the sm_90a compile check sees at real sizes."""
    seed = _fresh_seed()
    q, win, widx, comp, cidx, sinks = attention_inputs(REAL_V41, kernel_device, seed=seed, tokens=2, n_window=256,
                                                       n_comp=2048)
    scale = REAL_V41.latent ** -0.5
    got = prefill.prefill_attention_mx(q, win, widx, sinks, scale, comp, cidx, cfg)
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    assert _rel(got[:1], want[:1]) < 2e-2, (cfg, seed)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefill_kernel_at_real_size_on_the_gpu():
    """2048 queries at V4.1 sizes on fresh random inputs: every transposed launch shape against the reference,
    each passes its first-use check, and the tuned op (which may pick any prefill shape) stays within bound."""
    seed = _fresh_seed()
    q, win, widx, comp, cidx, sinks = attention_inputs(REAL_V41, "cuda", seed=seed, tokens=2048)
    scale = REAL_V41.latent ** -0.5
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    for cfg in CANDIDATES:
        assert prefill.first_use_ok(cfg, q.device), cfg
        got = attention_mx.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx, config=cfg)
        assert _rel(got, want) < 1e-2, (cfg, seed)
        assert torch.equal(got[1], torch.zeros_like(got[1]))
    tuned = attention_mx.sparse_attention_mx(q, win, widx, sinks, scale, comp, cidx)
    assert _rel(tuned, want) < 1e-2, seed


def test_first_use_check_accepts_the_kernel_and_refuses_a_wrong_one(monkeypatch, kernel_device):
    """The guard the tuner relies on: a launch shape passes on fresh inputs at V4.1 width, a kernel that drops
    its compressed rows does not, and the op then refuses that shape (so the tuner skips it)."""
    cfg = CANDIDATES[0]
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    assert prefill.first_use_ok(cfg, torch.device(kernel_device))
    monkeypatch.setattr(prefill, "_FIRST_USE", {})
    real = prefill.prefill_attention_mx
    monkeypatch.setattr(prefill, "prefill_attention_mx",
                        lambda q, win, widx, sinks, scale, comp=None, cidx=None, config=cfg:
                        real(q, win, widx, sinks, scale, config=config))
    assert not prefill.first_use_ok(cfg, torch.device(kernel_device))
    if kernel_device == "cuda":
        monkeypatch.setattr(attention_mx, "first_use_ok", prefill.first_use_ok)
        q, win, widx, comp, cidx, sinks = attention_inputs(TOY_V41, kernel_device, seed=_fresh_seed())
        with pytest.raises(RuntimeError, match="first-use check"):
            attention_mx.sparse_attention_mx(q, win, widx, sinks, 0.125, comp, cidx, config=cfg)
