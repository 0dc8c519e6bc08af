"""Checkpoint I/O: FP8 / FP4 round trips on the exact grids, field-named load errors,
cut models, and keeping weights quantised."""
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.params import checkpoint_spec
from redknot.models.deepseek_v4.single import full_logits
from redknot.models.deepseek_v4.synthetic import randomize_
from redknot.models.deepseek_v4.weights import CheckpointError, load_checkpoint
from redknot.models.deepseek_v4.writer import native_tensors, write_checkpoint
from v4_testutil import PARITY_CONFIG, rel_err

E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
E4M3 = E4M3[E4M3.isfinite()].unique()  # every finite e4m3 value
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1 = torch.cat([-E2M1.flip(0), E2M1]).unique()


def nearest_on_grid(x, grid):
    return grid[(x[..., None] - grid).abs().argmin(-1)]


def expected_fp8(w):
    """Per 128x128 block: scale 2^ceil(log2(amax/448)), values rounded to the nearest e4m3."""
    out = torch.empty_like(w)
    for i in range(0, w.shape[0], 128):
        for j in range(0, w.shape[1], 128):
            blk = w[i:i + 128, j:j + 128]
            s = 2.0 ** math.ceil(math.log2(blk.abs().max().item() / 448.0))
            out[i:i + 128, j:j + 128] = nearest_on_grid(blk / s, E4M3) * s
    return out


def expected_fp4(w):
    """Per 32 values of a row: scale 2^ceil(log2(amax/6)), values rounded to the nearest e2m1."""
    g = w.view(w.shape[0], -1, 32)
    s = torch.exp2(torch.ceil(torch.log2(g.abs().amax(-1, keepdim=True) / 6.0)))
    return (nearest_on_grid(g / s, E2M1) * s).view_as(w)


def make_model(cfg, seed=0, **kw):
    model = DeepseekV4(cfg, torch.float32, device="cpu", **kw)
    randomize_(model, seed)
    return model


def write(tmp, cfg, model, **kw):
    write_checkpoint(str(tmp), cfg, native_tensors(cfg, model.state_dict(), float_dtype=torch.float32),
                     max_shard_bytes=kw.pop("max_shard_bytes", 1 << 20))
    return str(tmp)


def load(path, cfg, **kw):
    model = DeepseekV4(cfg, torch.float32, device="meta", **kw)
    model.to_empty(device="cpu")
    load_checkpoint(model, path, progress=False)
    return model


@pytest.mark.parametrize("expert_dtype", ["fp8", "fp4"])
def test_quantised_round_trip_lands_on_the_grid(tmp_path, expert_dtype):
    base = V4Config.from_hf_dict(dict(PARITY_CONFIG, hidden_size=256, q_lora_rank=160))
    cfg = base.with_overrides({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                       "expert_dtype": expert_dtype}})
    src = make_model(base)
    path = write(tmp_path, cfg, src)
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) > 1  # sharded
    stored = {}
    for f in files:
        stored.update(load_file(os.path.join(path, f)))
    assert stored["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32  # never quantised
    w1 = stored["layers.2.ffn.experts.5.w1.weight"]
    assert w1.dtype == (torch.int8 if expert_dtype == "fp4" else torch.float8_e4m3fn)
    got = load(path, cfg)
    wq_b = got.layers[1].attn.wq_b.weight  # [256, 160]: partial 128-blocks on both axes
    assert torch.equal(wq_b, expected_fp8(src.layers[1].attn.wq_b.weight))
    want = expected_fp4 if expert_dtype == "fp4" else expected_fp8
    assert torch.equal(got.layers[2].ffn.experts.w1[5], want(src.layers[2].ffn.experts.w1[5]))
    assert torch.equal(got.layers[3].ffn.experts.w2[7], want(src.layers[3].ffn.experts.w2[7]))
    # Unquantised tensors are exact.
    assert torch.equal(got.layers[1].attn.compressor.wkv.weight, src.layers[1].attn.compressor.wkv.weight)
    assert torch.equal(got.layers[0].ffn.gate.tid2eid, src.layers[0].ffn.gate.tid2eid)


def test_keeping_weights_quantised_gives_the_dequantised_results(tmp_path):
    cfg = V4Config.from_hf_dict(PARITY_CONFIG).with_overrides(
        {"quantization_config": {"quant_method": "fp8", "expert_dtype": "fp4"}})
    path = write(tmp_path, cfg, make_model(V4Config.from_hf_dict(PARITY_CONFIG)))
    deq = load(path, cfg)
    kept = load(path, cfg, keep_quantized=True)
    assert kept.layers[1].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    assert kept.layers[1].ffn.experts.w1.dtype == torch.int8 and kept.layers[1].ffn.experts.w1_scale is not None
    ids = list(range(3, 40))
    assert rel_err(full_logits(kept, ids), full_logits(deq, ids)) <= 1e-6


def test_missing_and_misshaped_tensors_are_all_named(tmp_path):
    cfg = V4Config.from_hf_dict(PARITY_CONFIG)
    path = write(tmp_path, cfg, make_model(cfg), max_shard_bytes=1 << 40)
    file = os.path.join(path, "model-00001-of-00001.safetensors")
    tensors = load_file(file)
    del tensors["layers.2.attn.wkv.weight"]
    tensors["layers.1.attn.indexer.wq_b.weight"] = torch.zeros(7, 64)
    tensors["layers.9.attn.extra"] = torch.zeros(2)
    save_file(tensors, file)
    index = os.path.join(path, "model.safetensors.index.json")
    wm = json.load(open(index))
    del wm["weight_map"]["layers.2.attn.wkv.weight"]
    wm["weight_map"]["layers.9.attn.extra"] = os.path.basename(file)
    json.dump(wm, open(index, "w"))
    with pytest.raises(CheckpointError) as err:
        load(path, cfg)
    msg = str(err.value)
    assert "missing     layers.2.attn.wkv.weight: expected shape [64, 128]" in msg
    assert "mis-shaped  layers.1.attn.indexer.wq_b.weight: expected shape [512, 64]" in msg
    assert "found shape [7, 64]" in msg
    assert "unexpected  layers.9.attn.extra" in msg


def test_cut_model_reads_only_its_layers_and_bad_hash_ids_fail(tmp_path):
    cfg = V4Config.from_hf_dict(PARITY_CONFIG)
    src = make_model(cfg)
    path = write(tmp_path, cfg, src)
    cut = load(path, cfg.cut(2), with_mtp=False)
    assert len(cut.layers) == 2 and torch.equal(cut.layers[1].attn.wq_a.weight, src.layers[1].attn.wq_a.weight)
    no_mtp = V4Config.from_hf_dict(dict(PARITY_CONFIG, num_nextn_predict_layers=0))
    path_no_mtp = write(tmp_path / "no_mtp", no_mtp, make_model(no_mtp))
    with pytest.raises(CheckpointError, match="missing     mtp.0.e_proj.weight"):
        load(path_no_mtp, cfg)
    bad = make_model(cfg)
    bad.layers[0].ffn.gate.tid2eid[5, 0] = cfg.n_routed_experts
    with pytest.raises(CheckpointError, match="tid2eid: expert ids"):
        load(write(tmp_path / "bad", cfg, bad), cfg)


def test_spec_covers_every_parameter_and_buffer():
    cfg = V4Config.from_hf_dict(PARITY_CONFIG)
    model = DeepseekV4(cfg, device="meta")
    targets = {s.param for s in checkpoint_spec(cfg)}
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert targets == names
