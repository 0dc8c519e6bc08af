"""Expert-parallel loading: given ``expert_rows``, each main layer allocates and reads only
the experts a rank keeps (replicas as repeated rows), bit for bit the rows of a full load; the MTP
layer keeps every expert."""
import pytest
import torch

from redknot.config.schema import DType, HardwareConfig, ModelConfig, SyntheticModelConfig, WeightFormat
from redknot.models.deepseek_v4 import build_model
from redknot.models.deepseek_v4 import weights as weights_module

from .conftest import ARCH

ROWS = {0: (1, 4, 6, 1), 1: (0, 2, 3, 7), 2: (5, 5, 6, 7), 3: (7, 6, 5, 4)}  # per layer; repeats = replicas


def build(cache_dir, quantized: bool, rows=None):
    model = ModelConfig(name="sharded-load", max_position=512, sliding_window=ARCH["sliding_window"],
                        synthetic=SyntheticModelConfig(seed=3, architecture=dict(ARCH), quantize_fp8=quantized))
    hardware = HardwareConfig(weight_format=WeightFormat.keep if quantized else WeightFormat.dequantize,
                              dtype=DType.float32)
    return build_model(model, hardware, str(cache_dir), expert_rows=rows)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "fp8-kept"])
def test_sharded_load_matches_full_rows_and_skips_other_experts(tmp_path, monkeypatch, quantized):
    full = build(tmp_path, quantized)
    loaded = []
    real = weights_module._load_one
    monkeypatch.setattr(weights_module, "_load_one", lambda f, name, *a: (loaded.append(name), real(f, name, *a)))
    part = build(tmp_path, quantized, rows=lambda layer, num_experts: ROWS[layer])
    for i, (a, b) in enumerate(zip(full.layers, part.layers)):
        ex_full, ex_part = a.ffn.experts, b.ffn.experts
        assert ex_part.logical_ids == ROWS[i]
        names = ["w1", "w2", "w3"] + (["w1_scale", "w2_scale", "w3_scale"] if quantized else [])
        for name in names:
            got, want = getattr(ex_part, name), getattr(ex_full, name)
            assert got.shape[0] == len(ROWS[i])
            assert torch.equal(got, want[list(ROWS[i])]), (i, name)
        assert ex_full.w1_scale is not None if quantized else ex_full.w1_scale is None
    assert part.mtp[0].ffn.experts.w1.shape[0] == ARCH["n_routed_experts"]  # the MTP layer keeps all
    read_experts = {(int(n.split(".")[1]), int(n.split(".")[4])) for n in loaded
                    if n.startswith("layers.") and ".ffn.experts." in n}
    assert read_experts == {(i, e) for i, rows in ROWS.items() for e in rows}  # nothing else was read
