"""The DSpark choices the reference leaves open, as ``features.dspark`` keys (dspark.md §2.3, §8):
``block_attention`` (bidirectional | causal within the draft block) and ``confidence_activation``
(sigmoid | clamp of the confidence head's raw logit). Each non-default value changes the draft's
output, the V4-0731 draft still matches the float64 reference under it, and greedy decoding with
DSpark under the non-default values equals greedy decoding without it."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from dspark_reference import Reference
from omegaconf import OmegaConf
from spec_testutil import DSPARK_VOCAB, checkpoint_tensors, run_all

from redknot.config.hardware_fit import CONF_DIR
from redknot.config.schema import FeaturesConfig, HardwareConfig, ModelConfig
from redknot.engine import SamplingParams
from redknot.models.family import DSPARK
from redknot.models.registry import load_family
from redknot.speculative.dspark_drafter import DSparkDrafter, confidence_probs


@pytest.fixture(scope="module")
def built(seeded_model_cache):
    family = load_family("deepseek_v4")
    cache = seeded_model_cache
    raw = OmegaConf.load(Path(CONF_DIR) / "model" / "tiny-0731.yaml")
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))
    net = family.build_model(model_cfg, HardwareConfig(), cache)
    return net, family.draft_models(net)[DSPARK], family.write_synthetic_checkpoint(model_cfg, cache)


def _reference(net, draft, path) -> Reference:
    """The reference over the checkpoint's tensors read by name from the files (not the model)."""
    params = checkpoint_tensors(path)
    return Reference(params, net.cfg, draft.dcfg, params["embed.weight"], params["head.weight"])


def _rings(net, draft, anchors_at, gen):
    """Random context written through the draft's own context K/V; the reference's rows alongside."""
    w, d = draft.window, net.cfg.hidden_size
    rings = [torch.zeros(len(anchors_at), w, net.cfg.head_dim) for _ in range(draft.dcfg.num_stages)]
    taps = []
    for slot, p in enumerate(anchors_at):
        positions = torch.arange(max(0, p - w), p)
        t = torch.randn(len(positions), 3 * d, generator=gen)
        kv = draft.context_kv(t, positions)
        for s in range(draft.dcfg.num_stages):
            rings[s][slot, positions % w] = kv[s]
        taps.append((positions, t))
    return rings, taps


def test_causal_block_attention_matches_the_reference_and_changes_the_draft(built):
    net, draft, path = built
    ref = _reference(net, draft, path)
    rings, taps = _rings(net, draft, [3, 130], torch.Generator().manual_seed(1))
    anchors, at, slots = torch.tensor([11, 4242 % DSPARK_VOCAB]), torch.tensor([3, 130]), torch.tensor([0, 1])
    h_bi, u_bi = draft.forward_block(anchors, at, rings, slots)
    h_c, u_c = draft.forward_block(anchors, at, rings, slots, causal=True)
    for b, (positions, t) in enumerate(taps):
        context = {(s, pos): ref.ring_kv(s, t[i], pos) for s in range(draft.dcfg.num_stages)
                   for i, pos in enumerate(positions.tolist())}
        h_ref, u_ref = ref.block(int(anchors[b]), int(at[b]), context, causal=True)
        torch.testing.assert_close(h_c[b].double(), h_ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(u_c[b].double(), u_ref, atol=2e-3, rtol=2e-3)
    # the key is real: every slot before the last sees less of the block, so its hidden state moves
    assert (h_c - h_bi).abs().amax(dim=-1).min() > 1e-3 and (u_c - u_bi).abs().max() > 1e-3


def test_causal_anchor_slot_ignores_the_noise_slots(built):
    """Under causal attention slot 0 (the anchor) never reads the noise slots after it: a different
    noise id leaves its hidden state unchanged (to float rounding); under bidirectional attention it moves."""
    net, draft, _ = built
    rings, _ = _rings(net, draft, [40], torch.Generator().manual_seed(2))
    args = (torch.tensor([7]), torch.tensor([40]), rings, torch.tensor([0]))
    dcfg = draft.dcfg
    try:
        h_c, h_bi = draft.forward_block(*args, causal=True), draft.forward_block(*args)
        draft.dcfg = replace(dcfg, noise_token_id=(dcfg.noise_token_id + 1) % net.cfg.vocab_size)
        h_c2, h_bi2 = draft.forward_block(*args, causal=True), draft.forward_block(*args)
    finally:
        draft.dcfg = dcfg
    torch.testing.assert_close(h_c[0][0, 0], h_c2[0][0, 0], atol=1e-5, rtol=1e-5)  # [B, g, D]: request 0, slot 0
    assert (h_bi[0][0, 0] - h_bi2[0][0, 0]).abs().max() > 1e-3
    assert (h_c[0][0, 1:] - h_c2[0][0, 1:]).abs().max() > 1e-3  # the noise slots themselves do move


def test_confidence_activation_values():
    z = torch.tensor([[-2.0, 0.0, 0.5, 3.0]])
    temps = torch.tensor([1.0, 1.0, 2.0, 2.0])
    want_sigmoid = [1 / (1 + 2.718281828459045 ** 2), 0.5, 1 / (1 + 2.718281828459045 ** -0.25),
                    1 / (1 + 2.718281828459045 ** -1.5)]
    assert confidence_probs(z, temps, "sigmoid")[0].tolist() == pytest.approx(want_sigmoid, abs=1e-6)
    assert confidence_probs(z, temps, "clamp")[0].tolist() == pytest.approx([0.0, 0.0, 0.25, 1.0], abs=1e-7)


@pytest.mark.parametrize("key, value", [("block_attention", "causual"), ("confidence_activation", "softmax")])
def test_a_bad_value_names_the_key_and_the_allowed_values(built, key, value):
    _, draft, _ = built
    f = FeaturesConfig()
    setattr(f.dspark, key, value)
    with pytest.raises(ValueError) as err:
        DSparkDrafter(draft, None, None, f, 64)
    allowed = {"block_attention": "['bidirectional', 'causal']", "confidence_activation": "['sigmoid', 'clamp']"}
    assert f"features.dspark.{key}={value!r}: allowed values are {allowed[key]}" in str(err.value)


def test_greedy_with_non_default_choices_equals_plain_greedy(engines):
    off = engines(arch="dspark", dspark=False)
    on = engines(arch="dspark", adaptive=True, block_attention="causal", confidence_activation="clamp")
    drafter = on.runner.speculator.drafter
    assert drafter.causal and drafter.activation.value == "clamp"
    fixed = engines(arch="dspark", block_attention="causal")  # every draft verified: acceptance shows
    prompts = {f"c{i}": [(7 * i + 3 * j) % (DSPARK_VOCAB - 2) + 2 for j in range(5 + 9 * i)] for i in range(4)}
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = run_all(off, prompts, params)
    for llm in (on, fixed):
        got = run_all(llm, prompts, params)
        assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in ref.items()}
        assert sum(o.metrics.num_draft_proposed for o in got.values()) > 0
    assert sum(o.metrics.num_draft_accepted for o in run_all(fixed, prompts, params).values()) > 0
