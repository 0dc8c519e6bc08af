"""V4.1 native checkpoint: writer -> loader round trips (FP8 32x32 tiles, MXFP4 experts,
Engram tables with per-row scales), stored bit patterns, DSpark tensors kept apart, and
an error naming the tensor and the shard for every kind of bad tensor."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41.checkpoint import FP4, FP8, by_name, checkpoint_spec
from redknot.models.deepseek_v41.config import tiny_v41_config
from redknot.models.deepseek_v41.weights import INDEX_FILE, CheckpointError, load_v41_weights, read_weight_map
from redknot.models.deepseek_v41.writer import (
    native_tensors, store, synthetic_tensors, synthetic_value, write_checkpoint)


@pytest.fixture(scope="module")
def cfg():
    """The tiny layer schedule at a small vocabulary (fast to write)."""
    return tiny_v41_config().with_overrides({"vocab_size": 1024, "dspark_noise_token_id": 1000,
                                             "engram_compressed_vocab_size": 512})


def _write(path, cfg, edit=None, shard_bytes=1 << 20, extra=None):
    tensors = dict(native_tensors(synthetic_tensors(cfg, 0)))
    for name, t in (edit or {}).items():
        if t is None:
            tensors.pop(name)
        else:
            tensors[name] = t
    tensors.update(extra or {})
    write_checkpoint(str(path), cfg, tensors.items(), max_shard_bytes=shard_bytes)
    return str(path)


@pytest.fixture(scope="module")
def good(tmp_path_factory, cfg):
    return _write(tmp_path_factory.mktemp("v41ckpt"), cfg)


def test_sharded_index_and_config(good, cfg):
    wm = read_weight_map(good)
    assert len(set(wm.values())) > 1  # really sharded
    with open(os.path.join(good, "config.json"), encoding="utf-8") as f:
        written = json.load(f)
    assert written["architectures"] == ["DeepseekV41ForCausalLM"] and "text_config" in written
    from redknot.models.deepseek_v41.config import V41Config
    assert V41Config.from_dict(written) == cfg


def test_header_dtypes_are_the_released_ones(good):
    wm = read_weight_map(good)
    want = {"layers.1.attn.wq_a.weight": "F8_E4M3", "layers.1.attn.wq_a.scale": "F8_E8M0",
            "layers.1.ffn.experts.0.w1.weight": "I8", "layers.1.ffn.experts.0.w1.scale": "F8_E8M0",
            "layers.0.engram.embed.weight": "F8_E4M3", "layers.0.engram.embed.scale": "F8_E8M0",
            "layers.1.attn_norm.weight": "BF16", "layers.1.hc_attn_fn": "F32", "layers.1.attn.attn_sink": "F32",
            "layers.1.ffn.gate.bias": "F32", "layers.1.ffn.gate.weight": "BF16",
            "layers.1.attn.compressor.wkv.weight": "BF16", "mtp.0.main_proj.weight": "F8_E4M3"}
    for name, dtype in want.items():
        with safe_open(wm[name], "pt") as f:
            assert f.get_slice(name).get_dtype() == dtype, name


def test_keep_and_dequantize_round_trip(good, cfg):
    keep = load_v41_weights(good, cfg)
    deq = load_v41_weights(good, cfg, weight_format="dequantize", dtype=torch.float32)
    specs = by_name(checkpoint_spec(cfg))
    assert set(keep.draft) and all(n.startswith("mtp.") for n in keep.draft)
    assert not any(n.startswith("mtp.") for n in keep.tensors)
    name = "layers.3.attn.wo_b.weight"
    q, s = keep.tensors[name], keep.scale(name)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (256 // 32, 128 // 32)
    assert torch.equal(deq.tensors[name], mx.dequant_fp8_blocks(q, s, 32, torch.float32))
    assert name + ".scale" not in keep.tensors and "layers.3.attn.wo_b.scale" not in deq.tensors
    true = synthetic_value(specs[name], 0)
    assert (deq.tensors[name] - true).norm() / true.norm() < 0.05       # FP8 e4m3: ~3 % relative error
    expert = "layers.5.ffn.experts.3.w2.weight"
    assert keep.tensors[expert].dtype == torch.uint8 and keep.tensors[expert].shape == (256, 64)
    true = synthetic_value(specs[expert], 0)
    assert deq.tensors[expert].shape == (256, 128)
    assert (deq.tensors[expert] - true).norm() / true.norm() < 0.2      # MXFP4: ~12 %
    table = "layers.1.engram.embed.weight"
    for w in (keep, deq):  # Engram tables stay quantised in both formats
        assert w.tensors[table].dtype == torch.float8_e4m3fn and w.scale(table).shape == (864, 1)
    rows = mx.dequant_fp8_groups(keep.tensors[table], keep.scale(table))
    true = synthetic_value(specs[table], 0)
    assert (rows - true).norm() / true.norm() < 0.05
    assert {"layers.3.attn.wo_b.weight", expert, table, "mtp.0.main_proj.weight"} <= keep.quantized
    assert deq.tensors["layers.1.attn_norm.weight"].dtype == torch.bfloat16
    assert deq.tensors["layers.1.hc_ffn_base"].dtype == torch.float32


def test_fp8_tile_and_fp4_nibble_bit_patterns():
    spec8 = next(s for s in checkpoint_spec(tiny_v41_config()) if s.kind == FP8 and s.shape == (64, 256))
    w = torch.zeros(spec8.shape)
    w[0, 0] = 896.0            # tile (0, 0): amax 896 = 2 * 448 -> scale 2^1 -> E8M0 byte 128
    w[40, 40] = 112.0          # tile (1, 1): amax 112 = 448 / 4 -> scale 2^-2 -> byte 125
    w[40, 41] = -56.0          # -56 / 2^-2 = -224 -> e4m3 0xF6
    (_, q), (_, s) = store(spec8, w)
    s = s.view(torch.uint8)
    assert s[0, 0] == 128 and s[1, 1] == 125
    assert q.view(torch.uint8)[0, 0] == 0x7E and q.view(torch.uint8)[40, 41] == 0xF6   # 448 = 0x7E
    spec4 = next(s for s in checkpoint_spec(tiny_v41_config()) if s.kind == FP4)
    v = torch.zeros(spec4.shape)
    v[0, :4] = torch.tensor([1.0, -3.0, 6.0, 0.5])   # amax 6 -> scale 1 (byte 127)
    (_, packed), (_, sc) = store(spec4, v)
    b = packed.view(torch.uint8)
    # element 0 (1.0, code 2) in the low nibble, element 1 (-3.0, code 8|5) in the high nibble
    assert b[0, 0] == (2 | (13 << 4)) and b[0, 1] == (7 | (1 << 4)) and sc.view(torch.uint8)[0, 0] == 127


def test_expert_rows_and_draft_selection(good, cfg):
    w = load_v41_weights(good, cfg, expert_rows=lambda layer, n: [layer % n], include_draft=False)
    assert not w.draft
    got = {n for n in w.tensors if ".experts." in n and n.endswith("w1.weight")}
    assert got == {f"layers.{i}.ffn.experts.{i % 4}.w1.weight" for i in range(6)}
    assert w.experts == {i: (i % 4,) for i in range(6)}


def test_cut_config_reads_only_its_layers(good, cfg):
    cut = cfg.cut(2)
    w = load_v41_weights(good, cut)
    assert not any(n.startswith("layers.2.") for n in w.tensors) and not w.draft


def test_vision_tensors_are_ignored(tmp_path, cfg):
    path = _write(tmp_path, cfg, extra={"vision.norm.weight": torch.ones(8, dtype=torch.bfloat16),
                                        "image_start": torch.ones(256, dtype=torch.bfloat16)})
    w = load_v41_weights(path, cfg)
    assert "vision.norm.weight" not in w.tensors


# ----------------------------------------------------------------------------- bad tensors
def _shard_of(path, name):
    return os.path.basename(read_weight_map(path)[name])


def test_missing_tensor(tmp_path, cfg):
    path = _write(tmp_path, cfg, {"layers.3.attn.wkv.scale": None})
    with pytest.raises(CheckpointError, match=r"missing +layers\.3\.attn\.wkv\.scale: expected shape \[2, 8\]"):
        load_v41_weights(path, cfg)


def test_mis_shaped_tensor(tmp_path, cfg):
    name = "layers.2.attn.kv_norm.weight"
    path = _write(tmp_path, cfg, {name: torch.ones(63, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError) as err:
        load_v41_weights(path, cfg)
    assert f"mis-shaped  {name} in {_shard_of(path, name)}: expected shape [64], found [63]" in str(err.value)


def test_engram_table_with_the_wrong_row_count(tmp_path, cfg):
    name = "layers.0.engram.embed.weight"
    path = _write(tmp_path, cfg, {name: torch.zeros(659, 32, dtype=torch.float8_e4m3fn)})
    with pytest.raises(CheckpointError, match=r"mis-shaped  layers\.0\.engram\.embed\.weight in model-\d+-of-\d+"
                                              r"\.safetensors: expected shape \[660, 32\], found \[659, 32\]"):
        load_v41_weights(path, cfg)


def test_wrong_dtype(tmp_path, cfg):
    name = "layers.1.attn.wq_a.weight"
    path = _write(tmp_path, cfg, {name: torch.zeros(64, 256, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError) as err:
        load_v41_weights(path, cfg)
    assert f"wrong dtype {name} in {_shard_of(path, name)}: expected F8_E4M3, found BF16" in str(err.value)
    name = "layers.1.hc_attn_base"   # F32 in the release; a BF16 copy is refused, not converted
    path = _write(tmp_path / "b", cfg, {name: torch.zeros(24, dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"wrong dtype layers\.1\.hc_attn_base in .*expected F32, found BF16"):
        load_v41_weights(path, cfg)


def test_unexpected_tensor(tmp_path, cfg):
    path = _write(tmp_path, cfg, extra={"layers.2.attn.indexer.wk.weight": torch.zeros(64, 64,
                                                                                       dtype=torch.bfloat16)})
    with pytest.raises(CheckpointError, match=r"unexpected  layers\.2\.attn\.indexer\.wk\.weight in model-"):
        load_v41_weights(path, cfg)


def test_truncated_shard(tmp_path, cfg):
    path = _write(tmp_path, cfg)
    name = "layers.4.attn.wq_b.weight"
    file = read_weight_map(path)[name]
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=f"shard {file} cannot be read .*truncated or corrupt") as err:
        load_v41_weights(path, cfg)
    with open(file, "rb") as f:  # the last tensor of the shard is the one cut short
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    assert f"tensors cut short: {last}" in str(err.value)


def test_index_names_a_shard_without_the_tensor(tmp_path, cfg):
    path = _write(tmp_path, cfg)
    index = os.path.join(path, INDEX_FILE)
    with open(index, encoding="utf-8") as f:
        d = json.load(f)
    files = sorted(set(d["weight_map"].values()))
    name = "layers.5.attn.indexer.wq_b.weight"
    other = next(f for f in files if f != d["weight_map"][name])
    d["weight_map"][name] = other
    with open(index, "w", encoding="utf-8") as f:
        json.dump(d, f)
    with pytest.raises(CheckpointError, match=f"maps tensor {name} to shard .*{other}, which lacks it"):
        load_v41_weights(path, cfg)


def test_missing_shard_file(tmp_path, cfg):
    path = _write(tmp_path, cfg)
    file = read_weight_map(path)["head.weight"]
    os.remove(file)
    with pytest.raises(CheckpointError, match=f"shard {file} named by the index does not exist"):
        load_v41_weights(path, cfg)


def test_nan_scale(tmp_path, cfg):
    name = "layers.3.attn.wq_b.scale"
    bad = torch.full((8, 2), 127, dtype=torch.uint8)
    bad[1, 1] = 255
    path = _write(tmp_path, cfg, {name: bad.view(torch.float8_e8m0fnu)})
    with pytest.raises(CheckpointError, match=f"shard .*{_shard_of(path, name)}: scale {name} holds E8M0 byte 255"):
        load_v41_weights(path, cfg)


def test_bad_weight_format(good, cfg):
    with pytest.raises(ValueError, match=r"hardware.weight_format='fp8': allowed values are \['keep', 'dequantize'\]"):
        load_v41_weights(good, cfg, weight_format="fp8")


def test_engram_tables_sharded_by_rows(good, cfg):
    whole = load_v41_weights(good, cfg)
    table = "layers.1.engram.embed.weight"       # 864 rows
    parts = [load_v41_weights(good, cfg, engram_shard=(rank, 3)) for rank in range(3)]
    assert [p.engram_rows[1] for p in parts] == [(0, 288), (288, 576), (576, 864)]
    assert parts[1].engram_rows[0] == (220, 440)   # layer 0: 660 rows
    for name in (table, "layers.1.engram.embed.scale"):
        joined = torch.cat([p.tensors[name].view(torch.uint8) for p in parts])
        assert torch.equal(joined, whole.tensors[name].view(torch.uint8))
    # everything else is read whole on every rank
    assert torch.equal(parts[2].tensors["layers.1.engram.wkv.weight"].view(torch.uint8),
                       whole.tensors["layers.1.engram.wkv.weight"].view(torch.uint8))
    with pytest.raises(ValueError, match=r"engram_shard=\(3, 3\)"):
        load_v41_weights(good, cfg, engram_shard=(3, 3))
