"""The cost model against the reference §9 tables and brute-force sums."""
import pytest

from redknot.models.deepseek_v4.config import CSA, HCA, SLIDING, V4Config
from redknot.models.deepseek_v4.cost import H200, CostModel, _pairs_visible, _pairs_window

FLASH = CostModel(V4Config.flash())


@pytest.mark.parametrize("n,m,cap", [(1, 4, None), (37, 4, None), (5000, 4, 512), (2047, 4, 512), (2048, 4, 512),
                                     (3000, 128, None), (9, 4, 2)])
def test_closed_form_sums_equal_loops(n, m, cap):
    want = sum(min((t + 1) // m, cap) if cap else (t + 1) // m for t in range(n))
    assert _pairs_visible(n, m, cap) == want
    assert _pairs_window(n, 128) == sum(min(t + 1, 128) for t in range(n))


@pytest.mark.parametrize("n,swa,csa,hca,idx", [
    (65536, 4.72e13, 9.09e13, 4.39e13, 1.85e14),
    (131072, 9.45e13, 1.83e14, 1.76e14, 7.39e14),
    (450560, 3.25e14, 6.34e14, 2.08e15, 8.73e15),
    (1 << 20, 7.56e14, 1.48e15, 1.13e16, 4.73e16),
])
def test_flash_prefill_attention_flops_match_reference(n, swa, csa, hca, idx):
    p = FLASH.prefill(n)
    for got, want in ((p.swa, swa), (p.csa, csa), (p.hca, hca), (p.indexer, idx)):
        assert got == pytest.approx(want, rel=6e-3)


def test_flash_active_params_and_decode_bytes():
    active = sum(FLASH.active_linear_params(k) for k in V4Config.flash().layer_types)
    mhc = 43 * 2 * 24 * 4 * 4096  # mHC projections: in the reference's 12.74B, not in the linear FLOPs
    assert (active + mhc) / 1e9 == pytest.approx(12.74, abs=0.005)
    for n, mb in ((65536, 115), (131072, 214), (450560, 694), (1 << 20, 1594)):  # bf16 layout, reference §9
        assert FLASH.decode(n).kv_bytes / 1e6 == pytest.approx(mb, abs=1)


def test_cut_model_and_floors():
    cut = V4Config.flash().with_overrides({"num_hidden_layers": 3, "compress_ratios": [0, 4, 128, 0]})
    assert cut.layer_types == (SLIDING, CSA, HCA)
    p = CostModel(cut).prefill(8192)
    assert p.hca > 0 and p.csa > 0 and p.floor_s() == pytest.approx(p.total / 796e12)
    assert p.floor_s(fp8=True) < p.floor_s()
    d = CostModel(cut).decode(8192)
    assert d.floor_s() == pytest.approx(d.bytes / H200.hbm_bytes_per_s)
    assert HCA in cut.layer_types
