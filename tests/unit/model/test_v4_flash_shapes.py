"""The full V4-Flash architecture on the meta device: parameter counts and state sizes."""
import math

import torch

from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.state_layout import StateLayout
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.params import checkpoint_spec


def test_flash_parameter_count_on_meta():
    model = DeepseekV4(V4Config.flash(), dtype=torch.bfloat16, device="meta")
    assert model.num_parameters() == 284_332_230_231  # reference §9 (HF meta count)
    assert model.num_parameters(include_mtp=True) - model.num_parameters() == 6_610_048_635  # the MTP layer
    experts = model.layers[5].ffn.experts
    assert tuple(experts.w1.shape) == (256, 2048, 4096) and tuple(experts.w2.shape) == (256, 4096, 2048)


def test_flash_checkpoint_layout_matches_reference_table():
    cfg = V4Config.flash()
    spec = {s.name: s for s in checkpoint_spec(cfg)}
    # embed, head, norm, hc_head x3; per layer 2 norms + 6 mHC + 8 attention + router 2 + 768 experts + 3 shared;
    # CSA adds 10 compressor/indexer tensors, HCA 4; MTP = a layer + e/h_proj + 3 norms + its hc_head x3.
    per_layer = 2 + 6 + 8 + 2 + 256 * 3 + 3
    assert len(spec) == 6 + 43 * per_layer + 21 * 10 + 20 * 4 + per_layer + 2 + 3 + 3
    assert spec["layers.2.attn.wq_b.weight"].shape == (32768, 1024) and spec["layers.2.attn.wq_b.weight"].fmt == "fp8"
    assert spec["layers.2.attn.compressor.ape"].shape == (4, 1024)
    assert spec["layers.3.attn.compressor.ape"].shape == (128, 512)
    assert spec["layers.2.attn.indexer.compressor.wkv.weight"].shape == (256, 4096)
    assert spec["layers.0.ffn.gate.tid2eid"].shape == (129280, 6) and "layers.3.ffn.gate.tid2eid" not in spec
    assert spec["layers.42.ffn.experts.255.w2.weight"].shape == (4096, 2048)
    assert spec["mtp.0.e_proj.weight"].shape == (4096, 4096) and "mtp.0.attn.compressor.wkv.weight" not in spec
    fp4 = {s.name: s for s in checkpoint_spec(cfg.with_overrides({"expert_dtype": "fp4"}))}
    assert fp4["layers.4.ffn.experts.0.w1.weight"].fmt == "fp4"
    active = sum(math.prod(s.shape) for s in spec.values() if s.name.startswith("layers.") and s.fmt != "int"
                 and ".experts." not in s.name and not s.name.endswith("gate.bias"))
    assert active == 284_332_230_231 - 277_025_390_592 - 2 * 129280 * 4096 - 4096 - 4 * 16384 - 4 - 1


def test_flash_state_bytes_match_reference_section_7():
    cfg = V4Config.flash()
    bf16 = StateLayout.create(cfg, block_size=256, max_backtrack=0, kv_bytes=2)
    assert bf16.bytes_per_block / 256 == 6880  # bytes of history per token, bf16 layout
    assert bf16.csa_entries_per_block == 64 and bf16.hca_entries_per_block == 2
    assert bf16.swa_ring == 128 and bf16.csa_ring == 8 and bf16.hca_ring == 128
    spec = StateLayout.create(cfg, block_size=256, max_backtrack=5, kv_bytes=2)
    assert (spec.swa_ring, spec.csa_ring, spec.hca_ring) == (133, 13, 133)
    swa = 44 * 133 * 512 * 2  # 43 layers + MTP
    rings = 21 * 13 * 2 * (1024 + 256) * 4 + 20 * 133 * 2 * 512 * 4
    assert spec.bytes_per_slot == swa + rings
