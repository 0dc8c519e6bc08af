"""The V4.1 shipped-format Triton kernels against their PyTorch references at toy dimensions (Triton's
CPU interpreter without a GPU), and their registration: ``triton`` on sm90-port, ``reference`` on CPU.
Fresh random inputs per seed; tolerances are documented in ``redknot/kernels/triton/checks_mx.py``."""
import pytest
import torch

pytest.importorskip("triton")

from redknot.kernels import KernelSet  # noqa: E402
from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import attention_mx, gemm_mx, indexer_mx  # noqa: E402
from redknot.kernels.triton.checks_mx import ALL_MX_CHECKS, TOY_V41, V41Dims  # noqa: E402

V41_OPS = ("act_quant_mx", "linear_mx", "moe_mx", "cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx",
           "indexer_candidates_mx", "indexer_source_mx", "engram_gather_mx")
# A second toy shape: odd counts, more experts than tokens, a window wider than the tokens' rows.
ODD_V41 = V41Dims(hidden=96, experts=7, topk_experts=3, moe_inter=96, heads=3, latent=64, window=5, attn_topk=9,
                  index_heads=2, index_dim=32, index_topk=5, cand_blocks=2, cand_block_size=8, engram_width=32,
                  engram_rows_per_token=5, tokens=9, attn_tokens=4, entries=37)


@pytest.mark.parametrize("dims", [TOY_V41, ODD_V41], ids=["toy", "odd"])
@pytest.mark.parametrize("name", sorted(ALL_MX_CHECKS))
@pytest.mark.parametrize("seed", [1, 2])
def test_mx_kernel_matches_reference(name, dims, seed, kernel_device):
    rows = ALL_MX_CHECKS[name](dims, kernel_device, seed=seed)
    failed = [r.line() for r in rows if not r.ok]
    assert rows and not failed, "\n".join(failed)


def test_v41_ops_resolve_by_backend():
    cpu = KernelSet(default="reference")
    fast = KernelSet(default="triton")
    for op in V41_OPS:
        assert cpu.choice[op] == "reference"
        assert fast.choice[op] == "triton"
    assert cpu.linear_mx is ref_v41.linear_mx


def test_moe_mx_reference_differs_from_unquantised_moe():
    """The reference applies FP8 activation quantisation in front of every expert GEMM (§3.7)."""
    from redknot.kernels.triton.checks_mx import moe_inputs
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(TOY_V41, "cpu", seed=5)
    got = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0).float()
    plain = torch.zeros_like(got)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = x[t].float()
            g = (mx.dequant_mxfp4(w1[e], s1[e]) @ h).clamp(max=10.0)
            u = (mx.dequant_mxfp4(w3[e], s3[e]) @ h).clamp(-10.0, 10.0)
            plain[t] += mx.dequant_mxfp4(w2[e], s2[e]) @ (torch.nn.functional.silu(g) * u * wt[t, j])
    rel = float((got - plain).norm() / plain.norm())
    assert 1e-4 < rel < 0.1  # close to the unquantised math, but not equal to it


def test_cache_insert_rejects_unknown_format():
    with pytest.raises(ValueError, match="fmt='fp16'"):
        ref_v41.cache_insert_mx(torch.zeros(2, 68, dtype=torch.uint8), torch.tensor([0]), torch.zeros(1, 128),
                                "fp16")


def test_sparse_attention_reference_by_hand():
    """One query, one head, two window rows (exact in FP8) and a sink: softmax written out."""
    d = 32
    rows = torch.zeros(2, d)
    rows[0, 0], rows[1, 1] = 1.0, 2.0
    cache = mx.pack_window_rows(rows)
    q = torch.zeros(1, 1, d)
    q[0, 0, 0], q[0, 0, 1] = 1.0, 0.5
    sink = torch.tensor([0.25])
    out = ref_v41.sparse_attention_mx(q, cache, torch.tensor([[0, 1, -1]]), sink, 1.0)
    z = torch.tensor([1.0, 1.0])  # q·k0 = 1, q·k1 = 0.5 * 2 = 1
    p = torch.exp(z) / (torch.exp(z).sum() + torch.exp(sink))
    assert torch.allclose(out[0, 0, :2], p * torch.tensor([1.0, 2.0]))


def _sweep(n: int, default_tier: tuple) -> list:
    """Launch-shape indices; those outside ``default_tier`` are in the slow tier (interpreted, each costs
    seconds; on a GPU run them all with ``-m "slow or not slow"``)."""
    return [pytest.param(i, marks=() if i in default_tier else pytest.mark.slow) for i in range(n)]


FIRST_BF16 = next(i for i, c in enumerate(gemm_mx.MX_GEMM_TUNER.candidates) if c.mma == "bf16")


@pytest.mark.parametrize("cfg_index", _sweep(len(gemm_mx.MX_GEMM_TUNER.candidates), (0, FIRST_BF16)))
def test_every_gemm_launch_shape_matches_reference(cfg_index, kernel_device, monkeypatch):
    """Both MMA modes and every tuner candidate (the tuner picks among them on a GPU)."""
    from redknot.kernels.triton.checks_mx import moe_inputs
    cfg = gemm_mx.MX_GEMM_TUNER.candidates[cfg_index]
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(ODD_V41, kernel_device, seed=cfg_index)
    if cfg_index % 2:  # the activations quantised by a separate pass (the large-batch path)
        monkeypatch.setattr(gemm_mx, "PREQUANT_MIN_ROWS", 1)
    got = gemm_mx.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0, config=cfg)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 3e-2
    for block in (32, 128):
        g = torch.Generator(device=kernel_device).manual_seed(block)
        w, ws = mx.quant_fp8_blocks(torch.randn(160, 96, generator=g, device=kernel_device) * 0.05, block)
        xl = torch.randn(7, 96, generator=g, device=kernel_device).to(torch.bfloat16)
        got = gemm_mx.linear_mx(xl, w, ws, block, config=cfg).float()
        want = ref_v41.linear_mx(xl, w, ws, block).float()
        assert float((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("cfg_index", _sweep(len(attention_mx.ATTN_MX_TUNER.candidates), (0, 2, 6)))
def test_every_attention_and_indexer_launch_shape_matches_reference(cfg_index, kernel_device):
    from redknot.kernels.triton.checks_mx import _compare_selection, attention_inputs, indexer_inputs
    q, win, widx, comp, cidx, sinks = attention_inputs(TOY_V41, kernel_device, seed=cfg_index)
    cfg = attention_mx.ATTN_MX_TUNER.candidates[cfg_index]
    got = attention_mx.sparse_attention_mx(q, win, widx, sinks, 0.125, comp, cidx, config=cfg).float()
    want = ref_v41.sparse_attention_mx(q, win, widx, sinks, 0.125, comp, cidx).float()
    assert float((got - want).norm() / want.norm()) < 2e-2
    q, w, keys, vis = indexer_inputs(ODD_V41, kernel_device, seed=cfg_index)
    icfg = indexer_mx.INDEX_MX_TUNER.candidates[cfg_index % len(indexer_mx.INDEX_MX_TUNER.candidates)]
    s = indexer_mx._scores(q, w, keys, vis.int(), keys.shape[0], config=icfg)
    want_s = ref_v41.index_scores(q, w, mx.unpack_index_keys(keys))
    want_s = want_s.masked_fill(torch.arange(keys.shape[0], device=kernel_device)[None] >= vis[:, None].long(),
                                float("-inf"))
    fin = torch.isfinite(want_s)
    assert torch.equal(torch.isfinite(s), fin)
    assert torch.allclose(s[fin], want_s[fin], rtol=1e-3, atol=1e-4)
    assert _compare_selection("topk", want_s, ref_v41._select(s, 5), ref_v41._select(want_s, 5)).ok
