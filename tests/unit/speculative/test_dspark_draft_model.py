"""The V4-0731 DSpark draft model (``model=tiny-0731``) against the float64 reference written
from the documents: context K/V, the block forward over a partly filled and a wrapped ring,
the Markov bias and the confidence inputs; the taps are the hc-mean of the tapped layers'
*outputs*; checkpoint names, shapes and errors."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from dspark_reference import Reference, taps_of
from omegaconf import OmegaConf
from spec_testutil import checkpoint_tensors

from redknot.config.hardware_fit import CONF_DIR
from redknot.config.schema import HardwareConfig, ModelConfig
from redknot.models.deepseek_v4.dspark_config import parse_dspark
from redknot.models.deepseek_v4.dspark_draft import draft_checkpoint_spec
from redknot.models.deepseek_v4.weights import CheckpointError
from redknot.models.family import DSPARK
from redknot.models.registry import load_family
from redknot.step.metadata import StepMetadata


def tiny_0731() -> ModelConfig:
    raw = OmegaConf.load(Path(CONF_DIR) / "model" / "tiny-0731.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))


@pytest.fixture(scope="module")
def built(seeded_model_cache):
    family = load_family("deepseek_v4")
    cache = seeded_model_cache
    model_cfg = tiny_0731()
    net = family.build_model(model_cfg, HardwareConfig(), cache)
    return family, net, family.draft_models(net)[DSPARK], family.write_synthetic_checkpoint(model_cfg, cache)


def reference(built):
    """The reference over the checkpoint's own tensors, read by name from the files (not the model)."""
    _, net, draft, path = built
    params = checkpoint_tensors(path)
    return Reference(params, net.cfg, draft.dcfg, params["embed.weight"], params["head.weight"])


def test_the_checkpoint_is_a_0731_layout_with_three_stages(built):
    family, net, draft, path = built
    assert set(family.draft_models(net)) == {DSPARK}  # no classic MTP layer
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["dspark_block_size"] == 5 and config["dspark_target_layer_ids"] == [2, 3, 4]
    assert len(config["compress_ratios"]) == 5 + 3 and config["n_mtp_layers"] == 3
    d, v, r = net.cfg.hidden_size, net.cfg.vocab_size, 8
    shapes = {s.name: s.shape for s in draft_checkpoint_spec(net.cfg, draft.dcfg)}
    assert shapes["mtp.0.main_proj.weight"] == (d, 3 * d) and "mtp.1.main_proj.weight" not in shapes
    assert shapes["mtp.2.markov_head.markov_w1.weight"] == (v, r)
    assert shapes["mtp.2.markov_head.markov_w2.weight"] == (v, r)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, d + r)
    assert shapes["mtp.2.hc_head_fn"] == (4, 4 * d) and "mtp.0.hc_head_fn" not in shapes
    assert shapes["mtp.1.ffn.experts.7.w1.weight"] and not any(".e_proj" in n or "embed" in n for n in shapes)


def test_context_kv_and_block_match_the_reference(built):
    _, net, draft, _ = built
    ref = reference(built)
    gen = torch.Generator().manual_seed(0)
    w, d = draft.window, net.cfg.hidden_size
    anchors_at = [3, 130]  # a partly filled ring and a wrapped one
    rings = [torch.zeros(2, w, net.cfg.head_dim) for _ in range(draft.dcfg.num_stages)]
    context = [{}, {}]
    for slot, p in enumerate(anchors_at):
        positions = torch.arange(max(0, p - w), p)
        taps = torch.randn(len(positions), 3 * d, generator=gen)
        kv = draft.context_kv(taps, positions)  # [stages, T, hd]
        for s in range(draft.dcfg.num_stages):
            rings[s][slot, positions % w] = kv[s]
            for i, pos in enumerate(positions.tolist()):
                expected = ref.ring_kv(s, taps[i], pos)
                torch.testing.assert_close(kv[s, i].double(), expected, atol=2e-4, rtol=1e-4)
                context[slot][(s, pos)] = expected
    anchors = torch.tensor([11, 4242])
    h, logits = draft.forward_block(anchors, torch.tensor(anchors_at), rings, torch.tensor([0, 1]))
    assert h.shape == (2, 5, d) and logits.shape == (2, 5, net.cfg.vocab_size)
    for b in range(2):
        h_ref, u_ref = ref.block(int(anchors[b]), anchors_at[b], context[b])
        torch.testing.assert_close(h[b].double(), h_ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(logits[b].double(), u_ref, atol=2e-3, rtol=2e-3)


def test_a_ring_read_ignores_positions_at_or_after_the_anchor(built):
    """Rows past P-1 (stale, or another request's) must not change the block."""
    _, net, draft, _ = built
    w = draft.window
    rings = [torch.randn(1, w, net.cfg.head_dim) for _ in range(draft.dcfg.num_stages)]
    h1, _ = draft.forward_block(torch.tensor([5]), torch.tensor([10]), rings, torch.tensor([0]))
    for ring in rings:
        ring[0, 10:] = torch.randn(w - 10, net.cfg.head_dim)
    h2, _ = draft.forward_block(torch.tensor([5]), torch.tensor([10]), rings, torch.tensor([0]))
    torch.testing.assert_close(h1, h2)
    rings[0][0, 9] += 1.0
    h3, _ = draft.forward_block(torch.tensor([5]), torch.tensor([10]), rings, torch.tensor([0]))
    assert not torch.allclose(h1, h3)


def test_markov_bias_and_confidence_inputs_match_the_reference(built):
    _, net, draft, _ = built
    ref = reference(built)
    prev = torch.tensor([7, 128799])
    bias = draft.markov_bias(prev)
    for i, t in enumerate(prev.tolist()):
        torch.testing.assert_close(bias[i].double(), ref.markov_bias(t), atol=1e-5, rtol=1e-5)
    h = torch.randn(2, 5, net.cfg.hidden_size)
    prevs = torch.tensor([[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]])  # x_0 (anchor) .. x_{g-1}
    logits = draft.confidence_logits(h, prevs)
    for b in range(2):
        for k in range(5):
            assert logits[b, k].item() == pytest.approx(ref.confidence_logit(h[b, k], int(prevs[b, k])), abs=1e-4)
    moved = prevs.clone()
    moved[0, 4] = 11  # changing x_4 moves c_5 only: c_k never reads the draft it scores
    again = draft.confidence_logits(h, moved)
    assert torch.equal(again[0, :4], logits[0, :4]) and again[0, 4] != logits[0, 4]


def test_taps_are_the_hc_mean_of_the_tapped_layers_outputs(built):
    family, net, draft, _ = built
    layout = family.state_layout(net.cfg, block_size=128, max_backtrack=0, kv_bytes=4)
    state = family.allocate_state(net.cfg, layout, num_slots=1, num_blocks=4, device="cpu", dtype=torch.float32)
    outputs, inputs = {}, {}
    def spy(i):
        def hook(module, args, out):  # Block.forward(ks, streams, ...): args[1] is the layer's input
            outputs[i], inputs[i] = out, args[1]
        return hook
    hooks = [layer.register_forward_hook(spy(i)) for i, layer in enumerate(net.layers)]
    try:
        tokens = list(range(100, 140))
        meta = StepMetadata.build([tokens], [0], [0], [[0]])
        net.forward(meta, state)
    finally:
        for h in hooks:
            h.remove()
    taps = draft.last_taps(len(tokens))
    torch.testing.assert_close(taps.double(), taps_of([outputs[i] for i in (2, 3, 4)]))
    shifted = taps_of([inputs[i] for i in (2, 3, 4)])  # the V4.1 convention: layer inputs
    assert not torch.allclose(taps.double(), shifted, atol=1e-3)
    with pytest.raises(RuntimeError, match="do not cover the step's 7 rows"):
        draft.last_taps(7)


def test_checkpoint_errors_name_the_tensors(built, tmp_path):
    family, net, draft, path = built
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "ckpt"
    shutil.copytree(path, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["mtp.2.confidence_head.proj.weight"]
    tensors = load_file(str(bad / shard))
    tensors.pop("mtp.2.confidence_head.proj.weight")
    tensors["mtp.0.e_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(bad / shard))
    index["weight_map"].pop("mtp.2.confidence_head.proj.weight")
    index["weight_map"]["mtp.0.e_proj.weight"] = shard
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    from redknot.models.deepseek_v4.dspark_draft import load_draft
    with pytest.raises(CheckpointError, match=r"classic MTP tensors \(mtp.0.e_proj.weight\)"):
        load_draft(net, str(bad), HardwareConfig(), "cpu")
    tensors.pop("mtp.0.e_proj.weight")
    save_file(tensors, str(bad / shard))
    index["weight_map"].pop("mtp.0.e_proj.weight")
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    missing = r"missing     mtp.2.confidence_head.proj.weight: expected shape \[1, 136\]"
    with pytest.raises(CheckpointError, match=missing):
        load_draft(net, str(bad), HardwareConfig(), "cpu")


def test_bad_dspark_config_values_name_the_key():
    base = {"num_hidden_layers": 5, "vocab_size": 129280, "dspark_block_size": 5, "dspark_target_layer_ids": [2, 3, 4]}
    assert parse_dspark(base).target_layer_ids == (2, 3, 4)
    assert parse_dspark({"num_hidden_layers": 5}) is None
    with pytest.raises(ValueError, match=r"dspark_target_layer_ids=\[3, 4, 5\]: entries must be in \[0, num_hidden"):
        parse_dspark({**base, "dspark_target_layer_ids": [3, 4, 5]})
    with pytest.raises(ValueError, match="dspark_block_size=0: must be an integer >= 1"):
        parse_dspark({**base, "dspark_block_size": 0})
    with pytest.raises(ValueError, match="dspark_noise_token_id=200000"):
        parse_dspark({**base, "dspark_noise_token_id": 200000})
