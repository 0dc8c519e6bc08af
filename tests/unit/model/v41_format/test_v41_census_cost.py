"""The real V4.1-Flash built from the checkpoint schema (shape arithmetic) against the published
census, and the cost model / memory plan: 890 B of global KV per token, 8xH200 layouts."""
import pytest

from redknot.models.deepseek_v41 import census as cen
from redknot.models.deepseek_v41.config import V41Config, tiny_v41_config
from redknot.models.deepseek_v41.cost import (
    DEVICE_MEMORY, GIB, CostModel, LayoutDoesNotFit, _pairs_visible, _pairs_window, check_fits,
    global_kv_bytes_per_token, memory_plan, sequence_bytes)


@pytest.fixture(scope="module")
def flash():
    return V41Config.flash()


def test_census_matches_the_published_memory_table(flash):
    rows = {name: (n, gib) for name, n, gib in cen.recipe_rows(flash)}
    for name, (pub_n, pub_gib) in cen.PUBLISHED.items():
        n, gib = rows[name]
        if name.startswith("Embedding"):
            # the recipe's row also holds the vision tower (not part of the text schema)
            assert abs(n + cen.vision_params() - pub_n) / pub_n < 0.02, (name, n)
            continue
        assert abs(n - pub_n) / pub_n < 0.005, (name, n, pub_n)      # published to 0.1B
        assert abs(gib - pub_gib) < 0.06, (name, gib, pub_gib)      # published to 0.1 GiB


def test_census_by_component(flash):
    c = cen.census(flash)
    assert c["routed_experts"].params == 40 * 384 * 3 * 2304 * 5120
    assert c["dspark.routed_experts"].params == 3 * 128 * 3 * 2304 * 5120
    assert c["engram_table"].params == (384006168 + 384016682) * 256
    assert c["engram_table"].scales == (384006168 + 384016682) * 8          # [rows, 8] per-row scales
    assert c["embed"].params == c["head"].params == 129280 * 5120
    # per layer: wq_a, wq_b, wkv, wo_a, wo_b (+ 64 sinks)
    assert c["attention"].params == 40 * (1280 * 5120 + 32768 * 1280 + 512 * 5120 + 8192 * 4096 + 5120 * 8192 + 64)
    assert c["compressor"].params == (4 + 3) * 512 * 5120                   # wkv x4, wgate x3 (ratio 2 only)
    assert c["indexer"].params == 4 * 128 * 512 + 8 * (4096 * 1280 + 32 * 5120)
    assert abs(cen.backbone_params(flash) - cen.PUBLISHED_BACKBONE) / cen.PUBLISHED_BACKBONE < 0.002
    assert abs(cen.draft_params(flash) - cen.PUBLISHED_DRAFT) / cen.PUBLISHED_DRAFT < 0.05
    # the recipe: "8B active per prompt token (encoder), 16B per output token"
    head = 129280 * 5120
    assert 7.5e9 < cen.active_params(flash, range(20)) < 8.5e9
    assert 15.5e9 < cen.active_params(flash) + head < 16.5e9
    tensors = cen.total(c).tensors
    assert tensors == 95819 and 0 < cen.PUBLISHED_TENSORS - tensors < 300   # the rest is the vision tower


def test_global_kv_is_890_bytes_per_token(flash):
    assert global_kv_bytes_per_token(flash) == 890
    rings = 43 * 128 * 528
    assert sequence_bytes(flash, 1 << 20) == rings + 3 * (1 << 19) * 356 + (1 << 20) * 356 + 3 * 8192
    assert sequence_bytes(flash, 1 << 20, with_draft=False) == sequence_bytes(flash, 1 << 20) - 3 * 128 * 528


def test_pair_sums_against_loops():
    for n in (0, 1, 5, 17, 64, 200):
        for start in (0, 3, n // 2):
            if start > n:
                continue
            assert _pairs_window(n, 16, start) == sum(min(u, 16) for u in range(start + 1, n + 1))
            for r, cap in ((1, None), (2, None), (2, 8), (1, 12)):
                want = sum(min(u // r, cap) if cap else u // r for u in range(start + 1, n + 1))
                assert _pairs_visible(n, r, cap, start) == want, (n, start, r, cap)


def test_prefill_and_decode_costs_on_the_tiny_config():
    cfg = tiny_v41_config()
    cm = CostModel(cfg)
    n = 61
    p = cm.prefill(n)
    core = 4 * cfg.n_heads * cfg.head_dim
    window = sum(min(u, 16) for u in range(1, n + 1)) * core * 6
    assert p.window == window
    comp = sum(min(u // cfg.compress_ratios[layer], 8) for layer in (1, 2, 3, 4, 5) for u in range(1, n + 1)) * core
    assert p.compressed == comp
    idx = (sum(u // 2 for u in range(1, n + 1)) + sum(u for u in range(1, n + 1))
           + sum(min(u, 12) for u in range(1, n + 1))) * 2 * 4 * 64   # layers 1 (r2), 3 (r1), 5 (candidates: 3x4)
    assert p.indexer == idx
    assert p.lm_head == 2 * 129280 * 256
    replay = cm.prefill(n, keep_tokens=20)
    assert replay.total < p.total and replay.lm_head == p.lm_head
    d_short, d_long = cm.decode(10), cm.decode(1000)
    assert d_long.kv_bytes > d_short.kv_bytes and d_long.weight_bytes == d_short.weight_bytes
    assert d_short.engram_bytes == 2 * 6 * (32 + 1)


def test_memory_plan_for_8xh200(flash):
    h200 = DEVICE_MEMORY["H200"]
    plan = memory_plan(flash, ep=8, dp=8, engram_placement="sharded", device_bytes=h200, device_name="H200")
    assert 33 * GIB < plan.routed_experts < 34 * GIB                 # (259.5 + 16.2 scale) GiB / 8 of the backbone
    assert 23 * GIB < plan.engram < 24 * GIB                         # 188.8 GiB of tables and row scales / 8
    assert plan.fits and plan.sequences(1 << 20) >= 50 and plan.sequences(131072) >= 400
    check_fits(plan, 1 << 20)
    rep = memory_plan(flash, ep=8, dp=8, engram_placement="replicated", device_bytes=h200, device_name="H200")
    assert not rep.fits
    with pytest.raises(LayoutDoesNotFit, match=r"does not fit one H200 .*Engram tables 188\.8 GiB replicated.*"
                                              r"features\.parallel\.engram_placement=sharded"):
        check_fits(rep, 131072)
    one = memory_plan(flash, ep=1, dp=1, device_bytes=h200, device_name="H200")
    with pytest.raises(LayoutDoesNotFit, match=r"routed experts 2.* GiB at ep=1.*larger features\.parallel\.ep"):
        check_fits(one, 131072)
    host = memory_plan(flash, ep=8, dp=8, engram_placement="host", device_bytes=h200, device_name="H200")
    assert host.engram == 0 and host.engram_host > 180 * GIB and host.sequences(1 << 20) > plan.sequences(1 << 20)
    with pytest.raises(ValueError, match="features.parallel.engram_placement='disk'"):
        memory_plan(flash, engram_placement="disk", device_bytes=h200)
    text = "\n".join(plan.describe())
    assert "dp=8 ep=8" in text and "890 B/token" in text and "context 1,048,576" in text
    assert "cost at 131,072 tokens: prefill 36.0 GFLOP/token" in text and "decode step" in text


def test_meta_device_storage_matches_the_census_and_the_published_size(flash):
    """The real checkpoint's tensors on the meta device: their bytes equal the census, and with
    the vision tower (BF16) they add up to the published 475.2 GiB of all 48 shards."""
    tensors = cen.meta_tensors(flash)
    assert len(tensors) == cen.total(cen.census(flash)).tensors
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert stored == cen.total(cen.census(flash)).bytes
    assert tensors["layers.7.ffn.experts.383.w2.weight"].shape == (5120, 1152)
    assert tensors["layers.14.engram.embed.scale"].shape == (384016682, 8)
    assert tensors["mtp.0.main_proj.scale"].shape == (160, 480)
    assert abs((stored + 2 * cen.vision_params()) / GIB - 475.2) < 0.3
