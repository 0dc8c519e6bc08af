"""The embedded tiny model: real V4 architecture and vocabulary at toy width, written once
under the cache directory and loaded through the checkpoint loader."""
import os

import pytest
import torch
from safetensors import safe_open

from redknot.config.schema import HardwareConfig, ModelConfig, SyntheticModelConfig
from redknot.models.deepseek_v4 import SingleSequence, build_model, load_tokenizer
from redknot.models.deepseek_v4.config import CSA, HCA, SLIDING
from redknot.models.deepseek_v4.synthetic import TINY_ARCHITECTURE
from redknot.models.deepseek_v4.weights import CheckpointError
from v4_testutil import rel_err


def tiny_cfg(seed=0, **arch):
    arch = {**TINY_ARCHITECTURE, **arch}
    return ModelConfig(name="tiny", synthetic=SyntheticModelConfig(seed=seed, architecture=arch))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    return cache, build_model(tiny_cfg(), HardwareConfig(), cache)


def _only_dir(cache):
    entries = os.listdir(os.path.join(cache, "models"))
    assert len(entries) == 1 and entries[0].startswith("tiny-")
    return os.path.join(cache, "models", entries[0])


def test_tiny_is_the_real_architecture_at_toy_width(built):
    _, model = built
    cfg = model.cfg
    assert cfg.vocab_size == 129280 == load_tokenizer(None).vocab_size
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA}
    assert (cfg.sliding_window, cfg.csa_ratio, cfg.hca_ratio) == (128, 4, 128)
    assert "hash_moe" in cfg.mlp_layer_types and "moe" in cfg.mlp_layer_types
    assert len(model.mtp) == 1 and cfg.index_n_heads >= 16


def test_second_build_reuses_the_written_checkpoint(built):
    cache, first = built
    path = _only_dir(cache)
    stamp = {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)}
    again = build_model(tiny_cfg(), HardwareConfig(), cache)
    assert _only_dir(cache) == path
    assert stamp == {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)}
    for (name, a), (_, b) in zip(first.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_weights_come_from_the_files_on_disk(built):
    cache, model = built
    path = _only_dir(cache)
    shard = next(f for f in sorted(os.listdir(path)) if f.endswith(".safetensors"))
    with safe_open(os.path.join(path, shard), framework="pt") as f:
        names = list(f.keys())
        assert {f.get_tensor(n).dtype for n in names} <= {torch.bfloat16, torch.float32, torch.int32}
        for name in names[:40]:
            if ".experts." in name or not name.endswith("weight"):
                continue
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            assert torch.equal(owner.weight, f.get_tensor(name).float()), name


def test_a_damaged_cached_checkpoint_is_refused(tmp_path):
    cfg = tiny_cfg(seed=7)
    build_model(cfg, HardwareConfig(), str(tmp_path))
    path = _only_dir(str(tmp_path))
    os.remove(os.path.join(path, sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]))
    with pytest.raises(CheckpointError, match="does not exist"):
        build_model(cfg, HardwareConfig(), str(tmp_path))


def test_seed_changes_the_checkpoint(tmp_path):
    a = build_model(tiny_cfg(seed=1), HardwareConfig(), str(tmp_path))
    b = build_model(tiny_cfg(seed=2), HardwareConfig(), str(tmp_path))
    assert len(os.listdir(os.path.join(str(tmp_path), "models"))) == 2
    assert not torch.equal(a.layers[1].attn.attn_sink, b.layers[1].attn.attn_sink)


def test_chunked_prefill_and_decode_match_one_forward_at_real_window_and_ratios(built):
    _, model = built
    ids = load_tokenizer(None).encode("The quick brown fox jumps over the lazy dog. " * 40)[:300]
    assert len(ids) == 300
    whole = SingleSequence(model, 300, block_size=256).step(ids, all_logits=True)[1]
    seq = SingleSequence(model, 300, block_size=128, shuffle_blocks=2)
    parts = [seq.step(ids[a:b], all_logits=True)[1] for a, b in [(0, 130), (130, 131), (131, 258), (258, 290)]]
    parts += [seq.step([t])[1] for t in ids[290:]]
    assert rel_err(torch.cat(parts), whole) <= 1e-5


def test_model_path_and_window_checks(built, tmp_path):
    bad = ModelConfig(name="x", path=None, synthetic=None)
    with pytest.raises(ValueError, match="model.path is null"):
        build_model(bad, HardwareConfig(), str(tmp_path))
    cfg = tiny_cfg()
    cfg.sliding_window = 64
    with pytest.raises(ValueError, match="model.sliding_window=64"):
        build_model(cfg, HardwareConfig(), built[0])
