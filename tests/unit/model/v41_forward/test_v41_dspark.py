"""The V4.1 DSpark draft (reference dspark.md §2.4, deepseek_v41.md §3.10) against the float64
reference of ``dspark_v41_reference``; the taps are the stream means *entering* the tapped layers
after Engram (not the layers' outputs, the V4 rule); a bad ``mtp.*`` tensor is named in the error."""
import pytest
import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41 import model as model_mod
from redknot.models.deepseek_v41 import tensor_step as site_mod   # the mHC site functions (PyTorch math)
from redknot.models.deepseek_v41.dspark_draft import V41DSparkDraft
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights

from . import dspark_v41_reference as ref
from .v41util import Seq, random_weights, token_map_for, tokens
from .v41util import test_config as v41_config


def _build(cfg, numerics="bf16"):
    num = Numerics(numerics, torch.float64)
    tensors = random_weights(cfg, 0, include_draft=True)
    backbone = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    draft = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    tmap = token_map_for(cfg)
    model = DeepseekV41(cfg, Weights(backbone, torch.float64), tmap, int(tmap[cfg.engram_pad_id]), num)
    d = V41DSparkDraft(cfg, Weights(draft, torch.float64), num).attach(model)
    model.dspark = d
    return model, d, Weights(tensors, torch.float64)


def _grid(x: torch.Tensor) -> torch.Tensor:
    return mx.act_quant_ref(x, "fp8")


@pytest.mark.parametrize("stages", [1, 2])
def test_draft_matches_float64_reference(stages):
    cfg = v41_config(n_mtp_layers=stages, dspark_block_size=3,
                      compress_ratios=(0, 2, 2, 1, 1, 1) + (0,) * stages)
    model, draft, w = _build(cfg)
    seq = Seq(model, 64)
    prompt = tokens(21, seed=3)
    seq.step(prompt)
    taps = draft.last_taps(len(prompt))
    names = [n for n in w.tensors if n.startswith("mtp.") and not n.endswith(".scale")]
    params = {n: w.dense(n, torch.float64) for n in names}
    want_rings = ref.context_kv(params, cfg, taps, _grid)
    win = cfg.window_size
    got = draft.context_kv(taps, torch.arange(len(prompt)))                          # [S, T, hd]
    for s in range(stages):
        torch.testing.assert_close(got[s], torch.stack(want_rings[s]), atol=1e-10, rtol=0)
    rings = [torch.zeros(2, win, cfg.head_dim, dtype=torch.float64) for _ in range(stages)]
    for s in range(stages):  # slot 1 holds the last W positions at pos % W
        for t in range(len(prompt) - win, len(prompt)):
            rings[s][1, t % win] = got[s, t]
        for t in range(5):       # slot 0: a short request (ring only partly filled)
            rings[s][0, t] = got[s, t]
    anchors, positions = torch.tensor([17, 905]), torch.tensor([5, len(prompt)])
    h, logits = draft.forward_block(anchors, positions, rings, torch.tensor([0, 1]))
    embed = model.w.dense("embed.weight", torch.float64)
    head = model.w.dense("head.weight", torch.float64)
    for b, (anchor, pos) in enumerate(zip(anchors.tolist(), positions.tolist())):
        want_h, want_u = ref.draft_block(params, cfg, embed, head, anchor, pos, want_rings, _grid)
        torch.testing.assert_close(h[b], want_h, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(logits[b], want_u, atol=1e-9, rtol=1e-9)
        prev = torch.tensor([anchor, 3, 99])
        conf = draft.confidence_logits(h[b:b + 1], prev[None])[0]
        for k in range(3):
            torch.testing.assert_close(conf[k], ref.confidence(params, cfg, want_h[k], int(prev[k])))
        torch.testing.assert_close(draft.markov_bias(prev[:1])[0], ref.markov_bias(params, cfg, anchor))
    assert not any("hc_head" in n for n in w.tensors), "V4.1 has no learned hc_head"


def test_taps_are_layer_inputs_after_engram(monkeypatch):
    # Layer 1 carries Engram; layer 4 does not: its input is layer 3's output.
    cfg = v41_config(dspark_target_layer_ids=(1, 4))
    model, draft, _ = _build(cfg)
    seen, engram_in = [], []
    real_mixes, real_engram = site_mod.hc_mixes, model_mod.engram_forward

    def mixes(h, *a):
        seen.append(h.clone())
        return real_mixes(h, *a)

    def engram(h, *a):
        engram_in.append(h.clone())
        return real_engram(h, *a)
    monkeypatch.setattr(site_mod, "hc_mixes", mixes)
    monkeypatch.setattr(model_mod, "engram_forward", engram)
    seq = Seq(model, 64)
    prompt = tokens(12, seed=4)
    seq.step(prompt)
    taps = draft.last_taps(len(prompt))
    d = cfg.dim
    attn_in = seen[0::2]      # each layer: the attention site's mixes see the (post-Engram) layer input
    torch.testing.assert_close(taps[:, :d], attn_in[1].mean(1), atol=0, rtol=0)
    torch.testing.assert_close(taps[:, d:], attn_in[4].mean(1), atol=0, rtol=0)
    # The classic mistakes give other values: layer outputs (V4's rule), or the input before Engram.
    assert not torch.allclose(taps[:, :d], attn_in[2].mean(1), atol=1e-6)
    assert not torch.allclose(taps[:, d:], attn_in[5].mean(1), atol=1e-6)
    assert not torch.allclose(taps[:, :d], engram_in[1].mean(1), atol=1e-6)


def test_bad_mtp_tensor_is_named(tmp_path):
    from redknot.models.deepseek_v41.weights import CheckpointError
    from redknot.models.deepseek_v41.weights import load_v41_weights
    from redknot.models.deepseek_v41.writer import write_checkpoint

    cfg = v41_config()
    tensors = random_weights(cfg, 0, include_draft=True)
    bad = "mtp.0.markov_head.embed.weight"
    tensors[bad] = tensors[bad][:, :-1].contiguous()
    write_checkpoint(str(tmp_path), cfg, list(tensors.items()))
    with pytest.raises(CheckpointError) as err:
        load_v41_weights(str(tmp_path), cfg, weight_format="dequantize", dtype=torch.float32)
    msg = str(err.value)
    assert bad in msg and ".safetensors" in msg and str(cfg.dspark_markov_rank) in msg


@pytest.mark.parametrize("prompt_len,k", [(19, 1), (20, 2), (33, 3)])
def test_rollback_leaves_state_bit_identical(prompt_len, k):
    """A verify chunk whose last ``k`` drafts are rejected, rolled back and followed by the right
    tokens leaves every state tensor (window rings, ratio-2 carry-over rows, compressed entries and
    index keys, Engram look-back ids) bit-identical to a run whose drafts were right."""
    cfg = v41_config()
    model, _, _ = _build(cfg, numerics="reference")
    right, wrong = Seq(model, 96, max_backtrack=4), Seq(model, 96, max_backtrack=4)
    prompt = tokens(prompt_len, seed=5)
    nxt = tokens(3 + k, seed=6)
    bad = [(t + 17) % 2000 + 3 for t in nxt[3 - k:3]]
    chunk_right = nxt[:3]
    chunk_wrong = nxt[:3 - k] + bad
    for seq, chunk in ((right, chunk_right), (wrong, chunk_wrong)):
        seq.step(prompt)
        seq.step(chunk)
    # The rejected tokens did write state (so the equality below is not vacuous).
    assert not all(torch.equal(x, y) for x, y in zip(right.state.tensors(), wrong.state.tensors()))
    right.rollback(k)
    wrong.rollback(k)
    a, b = right.step(nxt[3 - k:]), wrong.step(nxt[3 - k:])
    assert torch.equal(a, b)
    for x, y in zip(right.state.tensors(), wrong.state.tensors()):
        assert torch.equal(x, y)
    assert any(t.abs().sum() > 0 for t in right.state.tensors())


def test_released_draft_tensor_names_and_shapes():
    """deepseek_v41.md §4.6 / dspark.md §2.4: the released V4.1-Flash ``mtp.*`` names and shapes."""
    from redknot.models.deepseek_v41.checkpoint import checkpoint_spec
    from redknot.models.deepseek_v41.config import V41Config

    specs = {s.name: s for s in checkpoint_spec(V41Config.flash()) if s.draft}
    assert specs["mtp.0.main_proj.weight"].shape == (5120, 15360)
    assert tuple(specs["mtp.0.main_proj.weight"].scale_shape) == (160, 480)     # 32x32 UE8M0 blocks
    assert specs["mtp.0.main_norm.weight"].shape == (5120,)
    assert specs["mtp.2.norm.weight"].shape == (5120,)
    assert specs["mtp.2.markov_head.embed.weight"].shape == (129280, 256)
    assert specs["mtp.2.markov_head.head.weight"].shape == (129280, 256)
    assert specs["mtp.2.confidence_head.proj.weight"].shape == (1, 5376)
    for s in range(3):
        assert specs[f"mtp.{s}.ffn.gate.weight"].shape[0] == 128
        assert f"mtp.{s}.ffn.experts.127.w1.weight" in specs and f"mtp.{s}.ffn.experts.128.w1.weight" not in specs
        assert f"mtp.{s}.ffn.shared_experts.w2.weight" in specs
        assert not any(n.startswith(f"mtp.{s}.attn.compressor") or n.startswith(f"mtp.{s}.attn.indexer")
                       for n in specs)
    assert not any(k in n for n in specs for k in ("hc_head", "eh_proj", "enorm", "hnorm", "mtp.0.embed",
                                                   "mtp.2.head."))
    assert "mtp.1.main_proj.weight" not in specs and "mtp.0.markov_head.embed.weight" not in specs


def test_tensor_only_forward_taps_equal_eager():
    """The tensor-only step (the CUDA-graph path) hands the draft the same taps as the eager step."""
    import copy

    from redknot.step.metadata import StepMetadata

    from .test_v41_tensor_step import TOL, Batch

    model, draft, _ = _build(v41_config(), numerics="reference")
    eager = Batch(model, 2)
    pre = [tokens(11, seed=5), tokens(8, seed=6)]
    model.forward(eager.meta(pre), eager.state)
    eager.advance(pre)
    fast_state = copy.deepcopy(eager.state)
    for step in range(3):
        chunks = [[7 + step], [40 + step]]
        m = eager.meta(chunks)
        model.forward(m, eager.state)
        want = draft.last_taps(2)
        fast = StepMetadata(input_ids=m.input_ids, positions=m.positions, query_start_loc=m.query_start_loc,
                            seq_slots=m.seq_slots, block_tables=m.block_tables, logits_indices=m.logits_indices,
                            num_tokens_per_seq=m.num_tokens_per_seq, context_lens=m.context_lens,
                            seq_slot_list=m.seq_slot_list, query_start_list=m.query_start_list, tensor_only=True)
        model.forward(fast, fast_state)
        got = draft.last_taps(2)
        assert (got - want).abs().max().item() <= TOL and draft.computed_rows(2).all()
        eager.advance(chunks)
