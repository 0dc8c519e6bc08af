"""``features.dspark.block_attention=causal`` on the V4.1 draft (dspark.md §2.4, §8 item 3): the
draft matches the float64 reference under the same key, the key changes the draft's output, and
the anchor slot no longer reads the noise slots after it."""
from dataclasses import replace

import torch

from redknot.kernels import mx_formats as mx
from redknot.models.deepseek_v41.dspark_draft import V41DSparkDraft
from redknot.models.deepseek_v41.model import DeepseekV41
from redknot.models.deepseek_v41.ref_math import Numerics, Weights

from . import dspark_v41_reference as ref
from .v41util import Seq, random_weights, token_map_for, tokens
from .v41util import test_config as v41_config


def _grid(x: torch.Tensor) -> torch.Tensor:
    return mx.act_quant_ref(x, "fp8")


def _setup():
    cfg = v41_config(n_mtp_layers=2, dspark_block_size=3, compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0))
    num = Numerics("bf16", torch.float64)
    tensors = random_weights(cfg, 0, include_draft=True)
    tmap = token_map_for(cfg)
    model = DeepseekV41(cfg, Weights({k: v for k, v in tensors.items() if not k.startswith("mtp.")}, torch.float64),
                        tmap, int(tmap[cfg.engram_pad_id]), num)
    draft = V41DSparkDraft(cfg, Weights({k: v for k, v in tensors.items() if k.startswith("mtp.")}, torch.float64),
                           num).attach(model)
    model.dspark = draft
    prompt = tokens(21, seed=5)
    Seq(model, 64).step(prompt)
    taps = draft.last_taps(len(prompt))
    w = Weights(tensors, torch.float64)
    params = {n: w.dense(n, torch.float64) for n in w.tensors if n.startswith("mtp.") and not n.endswith(".scale")}
    got = draft.context_kv(taps, torch.arange(len(prompt)))
    rings = [torch.zeros(1, cfg.window_size, cfg.head_dim, dtype=torch.float64) for _ in range(2)]
    for s in range(2):
        for t in range(len(prompt) - cfg.window_size, len(prompt)):
            rings[s][0, t % cfg.window_size] = got[s, t]
    return cfg, model, draft, params, ref.context_kv(params, cfg, taps, _grid), rings, len(prompt)


def test_causal_block_attention_matches_the_reference_and_changes_the_draft():
    cfg, model, draft, params, want_rings, rings, pos = _setup()
    args = (torch.tensor([905]), torch.tensor([pos]), rings, torch.tensor([0]))
    h_c, u_c = draft.forward_block(*args, causal=True)
    h_bi, u_bi = draft.forward_block(*args)
    embed, head = model.w.dense("embed.weight", torch.float64), model.w.dense("head.weight", torch.float64)
    want_h, want_u = ref.draft_block(params, cfg, embed, head, 905, pos, want_rings, _grid, causal=True)
    torch.testing.assert_close(h_c[0], want_h, atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(u_c[0], want_u, atol=1e-9, rtol=1e-9)
    assert (h_c - h_bi)[0, :-1].abs().amax(dim=-1).min() > 1e-3 and (u_c - u_bi).abs().max() > 1e-3

    # the anchor slot under causal attention ignores the noise slots: another noise id leaves it as is
    dcfg = draft.dcfg
    try:
        draft.dcfg = replace(dcfg, noise_token_id=(dcfg.noise_token_id + 1) % cfg.vocab_size)
        h_c2, _ = draft.forward_block(*args, causal=True)
        h_bi2, _ = draft.forward_block(*args)
    finally:
        draft.dcfg = dcfg
    torch.testing.assert_close(h_c2[0, 0], h_c[0, 0], atol=1e-9, rtol=1e-9)
    assert (h_bi2[0, 0] - h_bi[0, 0]).abs().max() > 1e-3
