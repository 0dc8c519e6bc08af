"""Pieces of the V4.1 forward checked against numbers the document states (reference §2.6, §3.0,
§3.3, §3.9, §5.1), and the model built through its family from the native tiny-v41 checkpoint."""
from __future__ import annotations

import math

import pytest
import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41.config import V41Config
from redknot.models.deepseek_v41.mhc import hc_mixes
from redknot.models.deepseek_v41.ref_math import Numerics, layer_rope, rms_norm
from redknot.models.deepseek_v41.state import allocate_state
from redknot.models.deepseek_v41.state_layout import create_state_layout
from v41_forward.v41util import Pair, Seq, tokens


def test_rope_tables_per_layer_of_the_real_config():
    cfg = V41Config.flash()
    plain = layer_rope(cfg, 0)
    i = torch.arange(32, dtype=torch.float64)
    assert torch.allclose(plain, 10000.0 ** (-2 * i / 64), rtol=1e-15)       # ratio 0: θ 1e4, no YaRN
    yarn = layer_rope(cfg, 1)
    base = 160000.0 ** (-2 * i / 64)
    assert torch.allclose(yarn[:16], base[:16], rtol=1e-15)                  # pairs <= low=15 keep θ
    assert torch.allclose(yarn[25:], base[25:] / 16, rtol=1e-15)            # pairs >= high=25 divided by 16
    mid = yarn[16:25] / base[16:25]
    assert bool(((mid < 1) & (mid > 1 / 16)).all()) and bool((mid[1:] < mid[:-1]).all())
    assert torch.equal(layer_rope(cfg, 2), yarn)                             # every ratio != 0 layer


def test_sinkhorn_ends_on_a_column_normalisation():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 4, 32, generator=gen, dtype=torch.float64)
    fn = torch.randn(24, 128, generator=gen, dtype=torch.float64)
    base, scale = torch.randn(24, generator=gen, dtype=torch.float64), torch.tensor([1.0, 1.0, 3.0])
    pre, post, comb = hc_mixes(h, fn, base, scale, 4, 3, 1e-6, 1e-20)
    cols, rows = comb.sum(-2), comb.sum(-1)
    assert (cols - 1).abs().max() < 1e-4
    assert (rows - 1).abs().max() > 1e-3          # three iterations: rows are not yet stochastic
    assert bool(((post > 0) & (post < 2)).all()) and bool((pre > 1e-6).all())


def test_rms_norm_multiplies_the_weight_before_the_cast():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 512, generator=gen).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(512, generator=gen)).to(torch.bfloat16)
    got = rms_norm(x, w, 1e-20)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-20)
    assert torch.equal(got, (w.float() * normed).to(torch.bfloat16))
    assert not torch.equal(got, normed.to(torch.bfloat16) * w)               # HF's order rounds differently


def test_state_stores_the_trained_byte_formats():
    cfg = V41Config.flash()
    lay = create_state_layout(cfg, block_size=256, max_backtrack=5, kv_bytes=2)
    assert (lay.window_bytes, lay.entry_bytes, lay.key_bytes) == (528, 288, 68)
    assert (lay.window_bytes, lay.entry_bytes, lay.key_bytes) == (
        mx.window_row_bytes(512), mx.compressed_entry_bytes(512), mx.index_key_bytes(128))
    assert lay.global_bytes_per_token() == 890                               # §5.1
    assert lay.window_ring == 128 + 5 and lay.compressor_ring == 2 + 5 and lay.engram_ring == 3 + 1 + 5
    tiny = Pair().cfg
    small = create_state_layout(tiny, block_size=8, max_backtrack=0)
    st = allocate_state(tiny, small, num_slots=2, num_blocks=3, device="cpu", dtype=torch.float32)
    assert all(w.dtype == torch.uint8 for w in st.windows)
    assert all(s.entries.dtype == s.keys.dtype == torch.uint8 for s in st.sources.values())
    assert st.nbytes() == 2 * small.bytes_per_slot + 3 * small.bytes_per_block


def test_numerics_modes_differ_and_bad_values_name_the_key():
    ids = tokens(40, seed=4)
    ref = Pair(numerics="reference").ref.forward(ids).logits
    bf = Pair(numerics="bf16").ref.forward(ids).logits
    assert (ref - bf).abs().max() > 1e-3   # activation quantisation and bf16 scores change the numbers
    with pytest.raises(ValueError, match=r"model.numerics='fp8': allowed values are \['reference', 'bf16'\]"):
        Numerics("fp8")
    with pytest.raises(ValueError, match="model.index_keys='latest'"):
        Pair(index_keys="latest")


def test_tiny_v41_from_its_native_checkpoint_matches_the_reference(tmp_path):
    """model=tiny-v41 through the family: the seeded checkpoint written in the native layout, read
    by the loader, the Engram token map built from the real tokenizer; the engine path equals the
    reference over the same tensors (fp32, one-shot prefill)."""
    from omegaconf import OmegaConf

    from redknot.config.schema import HardwareConfig, ModelConfig
    from redknot.models.deepseek_v41.reference import ReferenceV41
    from redknot.models.registry import load_family
    from pathlib import Path

    conf = Path(__file__).resolve().parents[4] / "conf" / "model" / "tiny-v41.yaml"
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(conf)))
    family = load_family("deepseek_v41")
    model = family.build_model(model_cfg, HardwareConfig(), str(tmp_path))
    assert model.cfg.engram_compressed_vocab_size == 99092 and model.cfg.vocab_size == 129280
    ref = ReferenceV41(model.cfg, model.w, model.token_map, int(model.hasher.layout.pad_c), model.num)
    ids = tokens(45, seed=6, vocab=model.cfg.vocab_size)
    want = ref.forward(ids).logits
    got = Seq(model, 45, block_size=16).step(ids)
    assert got.dtype == torch.float32 and math.isfinite(float(got.abs().max()))
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
    # hardware.weight_format=keep: FP8/FP4 weights stay quantised and are dequantised per GEMM
    kept = family.build_model(model_cfg, HardwareConfig(weight_format="keep"), str(tmp_path))
    assert kept.w.tensors["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(Seq(kept, 45, block_size=16).step(ids), got)


def test_bounded_replay_benchmark_on_tiny(tmp_path):
    """benchmarks/v41_bounded_replay.py end to end on the tiny model: keep_tokens below
    (tail layers) x (window - 1) + 1 = 31 perturbs the last row, 40 (whole prompt) does not."""
    import json
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[4] / "benchmarks" / "v41_bounded_replay.py"
    argv = sys.argv
    sys.argv = [str(script), "--arch", "tiny", "--prompts", "40", "--keep", "17", "40", "--decode", "2",
                "--out", str(tmp_path)]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["keep_tokens"] for r in rows] == [17, 40]
    assert rows[0]["last_row_max_abs_err"] > 1e-3 and rows[1]["last_row_max_abs_err"] < 1e-5
    assert (tmp_path / "results.md").read_text().count("| 40 |") == 2
