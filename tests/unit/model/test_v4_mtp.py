"""The MTP layer against a direct, dense implementation of reference §6 written here
(full-sequence, no state, plain torch), fed the target model's pre-head streams."""
import math

import torch
import torch.nn.functional as F

from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.model import DeepseekV4
from redknot.models.deepseek_v4.single import SingleSequence
from redknot.models.deepseek_v4.synthetic import randomize_
from v4_testutil import PARITY_CONFIG, rel_err


def rms(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def hc_weights(X, fn, base, scale, n, iters, eps):
    """§3: pre, post and Sinkhorn-projected comb for X [T, n, D]."""
    z = rms(X.reshape(X.shape[0], -1))
    mix = z @ fn.T
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    c = torch.softmax(mix[:, 2 * n:].reshape(-1, n, n) * scale[2] + base[2 * n:].reshape(n, n), -1) + eps
    c = c / (c.sum(1, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(2, keepdim=True) + eps)
        c = c / (c.sum(1, keepdim=True) + eps)
    return pre, post, c


def rotate(x, pos, r, theta, sign=1.0):
    """Interleaved RoPE on the last r dims of x [T, ..., d] at positions pos [T]."""
    freqs = torch.tensor([theta ** (-2 * i / r) for i in range(r // 2)])
    ang = sign * pos[:, None].double() * freqs[None].double()
    cos, sin = ang.cos().float(), ang.sin().float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (r // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    a, b = x[..., -r::2], x[..., -r + 1::2]
    out = x.clone()
    out[..., -r::2] = a * cos - b * sin
    out[..., -r + 1::2] = a * sin + b * cos
    return out


def swa_attention(p, x, pos, cfg):
    t, h, d, r = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.rope_dim
    cq = rms(x @ p["attn.wq_a.weight"].T, p["attn.q_norm.weight"])
    q = rms((cq @ p["attn.wq_b.weight"].T).view(t, h, d))
    q = rotate(q, pos, r, cfg.rope_theta)
    kv = rotate(rms(x @ p["attn.wkv.weight"].T, p["attn.kv_norm.weight"]), pos, r, cfg.rope_theta)
    logits = torch.einsum("thd,sd->ths", q, kv) / math.sqrt(d)
    i, j = pos[:, None], pos[None, :]
    allowed = (j <= i) & (j > i - cfg.sliding_window)
    logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
    sink = p["attn.attn_sink"].view(1, h, 1).expand(t, h, 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    o = rotate(torch.einsum("ths,sd->thd", probs, kv), pos, r, cfg.rope_theta, sign=-1.0)
    groups = o.reshape(t, cfg.o_groups, -1)
    wa = p["attn.wo_a.weight"].view(cfg.o_groups, cfg.o_lora_rank, -1)
    y = torch.einsum("tgk,grk->tgr", groups, wa).reshape(t, -1)
    return y @ p["attn.wo_b.weight"].T


def moe(p, x, cfg):
    lim = cfg.swiglu_limit
    s = torch.sqrt(F.softplus(x @ p["ffn.gate.weight"].T))
    chosen = torch.topk(s + p["ffn.gate.bias"], cfg.num_experts_per_tok, -1).indices
    w = s.gather(1, chosen)
    w = w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(chosen[t].tolist()):
            w1, w2, w3 = (p[f"ffn.experts.{n}"][e] for n in ("w1", "w2", "w3"))
            hid = F.silu((w1 @ x[t]).clamp(max=lim)) * (w3 @ x[t]).clamp(-lim, lim)
            out[t] += w[t, j] * (w2 @ hid)
    sh = F.silu((x @ p["ffn.shared_experts.w1.weight"].T).clamp(max=lim)) * \
        (x @ p["ffn.shared_experts.w3.weight"].T).clamp(-lim, lim)
    return out + sh @ p["ffn.shared_experts.w2.weight"].T


def mtp_reference(model, H, next_ids):
    """§6 for positions 0..T-1: returns (MTP streams, logits)."""
    cfg, n = model.cfg, model.cfg.hc_mult
    p = {k[len("mtp.0."):]: v for k, v in model.state_dict().items() if k.startswith("mtp.0.")}
    pos = torch.arange(H.shape[0])
    e = model.embed.weight[next_ids]
    X = (rms(e, p["enorm.weight"]) @ p["e_proj.weight"].T)[:, None] + rms(H, p["hnorm.weight"]) @ p["h_proj.weight"].T
    for site, fn in (("attn", lambda u: swa_attention(p, u, pos, cfg)), ("ffn", lambda u: moe(p, u, cfg))):
        pre, post, comb = hc_weights(X, p[f"hc_{site}_fn"], p[f"hc_{site}_base"], p[f"hc_{site}_scale"], n,
                                     cfg.hc_sinkhorn_iters, cfg.hc_eps)
        u = (pre[..., None] * X).sum(1)
        y = fn(rms(u, p[f"{site}_norm.weight"]))
        X = post[..., None] * y[:, None] + torch.einsum("tjk,tjd->tkd", comb, X)
    z = rms(X.reshape(X.shape[0], -1))
    pre = torch.sigmoid((z @ p["hc_head_fn"].T) * p["hc_head_scale"] + p["hc_head_base"]) + cfg.hc_eps
    h = rms((pre[..., None] * X).sum(1), p["norm.weight"])
    return X, h @ model.head.weight.T


def test_mtp_matches_direct_equations():
    cfg = V4Config.from_hf_dict(PARITY_CONFIG)
    model = DeepseekV4(cfg, torch.float32, device="cpu")
    randomize_(model, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (41,), generator=torch.Generator().manual_seed(4))
    seq = SingleSequence(model, 41, shuffle_blocks=1)
    H, _ = seq.step(ids.tolist(), all_logits=True)  # target pre-head streams at 0..40
    ref_streams, ref_logits = mtp_reference(model, H[:40], ids[1:41])
    streams, logits = [], []
    for a, b in [(0, 13), (13, 14), (14, 31), (31, 32), (32, 40)]:  # chunked, incl. single-token steps
        s, lg = seq.mtp_step(H[a:b], ids[a + 1:b + 1].tolist())
        streams.append(s)
        logits.append(lg)
    assert rel_err(torch.cat(logits), ref_logits) <= 1e-5
    assert rel_err(torch.cat(streams), ref_streams) <= 1e-5
    assert model.mtp[0].attn.compressor is None and not model.mtp[0].ffn.gate.hash_layer
