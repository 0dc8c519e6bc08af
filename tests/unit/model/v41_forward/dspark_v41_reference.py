"""A straightforward float64 reference of the V4.1 DSpark draft, written from the documents
(dspark.md §2.4, deepseek_v41.md §3.3, §3.5, §3.7, §3.10): one block of one request, one token
and one head at a time, over the draft's parameters by checkpoint name (already dequantised to
float64). It shares no code with the engine; ``grid`` is the FP8 window-cache quantiser (the
tested primitive of the cache format) applied to every K/V row."""
from __future__ import annotations

import math
from typing import Callable, Dict, List

import torch

Params = Dict[str, torch.Tensor]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean() + eps)


def rope(x: torch.Tensor, pos: int, rope_dim: int, theta: float, inverse: bool = False) -> torch.Tensor:
    out = x.clone()
    base = x.shape[-1] - rope_dim
    for i in range(rope_dim // 2):
        phi = pos * theta ** (-2.0 * i / rope_dim) * (-1 if inverse else 1)
        a, b = x[base + 2 * i].item(), x[base + 2 * i + 1].item()
        out[base + 2 * i] = a * math.cos(phi) - b * math.sin(phi)
        out[base + 2 * i + 1] = a * math.sin(phi) + b * math.cos(phi)
    return out


def hc_mix(streams: torch.Tensor, fn, base, scale, cfg):
    """§3.3 for one token: (pre [hc], post [hc], C [hc, hc])."""
    n = cfg.hc_mult
    z = streams.reshape(-1)
    mix = (fn @ z) / torch.sqrt((z * z).mean() + cfg.norm_eps)
    pre = torch.sigmoid(mix[:n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[n:2 * n] * scale[1] + base[n:2 * n])
    c = torch.softmax((mix[2 * n:] * scale[2] + base[2 * n:]).view(n, n), dim=-1) + cfg.hc_eps
    c = c / (c.sum(0, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(1, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(0, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def expand(y, streams, post, c):
    return torch.stack([post[j] * y + sum(c[i, j] * streams[i] for i in range(streams.shape[0]))
                        for j in range(streams.shape[0])])


def collapse(streams, pre):
    return sum(pre[i] * streams[i] for i in range(streams.shape[0]))


def moe(u: torch.Tensor, p: Params, pre: str, cfg) -> torch.Tensor:
    n_exp, k, lim = cfg.dspark_n_routed_experts, cfg.dspark_n_activated_experts, cfg.swiglu_limit
    scores = torch.sqrt(torch.nn.functional.softplus((p[f"{pre}.gate.weight"] @ u) / cfg.gate_temp))
    biased = scores + p[f"{pre}.gate.bias"]
    chosen = sorted(range(n_exp), key=lambda e: (-biased[e].item(), e))[:k]
    weights = torch.stack([scores[e] for e in chosen])
    if cfg.norm_topk_prob and k > 1:
        weights = weights / (weights.sum() + 1e-20)
    weights = weights * cfg.route_scale

    def expert(name, wt):
        g = (p[f"{name}.w1.weight"] @ u).clamp(max=lim)
        up = (p[f"{name}.w3.weight"] @ u).clamp(-lim, lim)
        return p[f"{name}.w2.weight"] @ (torch.nn.functional.silu(g) * up * wt)
    out = sum(expert(f"{pre}.experts.{e}", w) for e, w in zip(chosen, weights))
    return out + expert(f"{pre}.shared_experts", 1.0)


def context_kv(p: Params, cfg, taps: torch.Tensor, grid: Callable) -> List[List[torch.Tensor]]:
    """taps [T, k*D] of positions 0..T-1 -> per stage, the K/V row of every position."""
    rings = [[] for _ in range(cfg.n_mtp_layers)]
    for t in range(taps.shape[0]):
        main_x = rms(p["mtp.0.main_proj.weight"] @ taps[t], p["mtp.0.main_norm.weight"], cfg.norm_eps)
        for s in range(cfg.n_mtp_layers):
            a = f"mtp.{s}.attn"
            kv = rms(p[f"{a}.wkv.weight"] @ main_x, p[f"{a}.kv_norm.weight"], cfg.norm_eps)
            rings[s].append(grid(rope(kv, t, cfg.rope_head_dim, cfg.rope_theta)[None])[0])
    return rings


def attention(p: Params, s: int, cfg, us: List[torch.Tensor], anchor_pos: int, ring: List[torch.Tensor],
              grid: Callable, causal: bool = False) -> List[torch.Tensor]:
    a, hd, nh = f"mtp.{s}.attn", cfg.head_dim, cfg.n_heads
    w = cfg.window_size
    ctx = [ring[t] for t in range(max(0, anchor_pos - w), anchor_pos)]
    block = [grid(rope(rms(p[f"{a}.wkv.weight"] @ u, p[f"{a}.kv_norm.weight"], cfg.norm_eps), anchor_pos + i,
                       cfg.rope_head_dim, cfg.rope_theta)[None])[0] for i, u in enumerate(us)]
    out = []
    for j, u in enumerate(us):
        keys = torch.stack(ctx + (block[:j + 1] if causal else block))  # block slots <= j only if causal
        q = p[f"{a}.wq_b.weight"] @ rms(p[f"{a}.wq_a.weight"] @ u, p[f"{a}.q_norm.weight"], cfg.norm_eps)
        heads = []
        for h in range(nh):
            qh = rope(q[h * hd:(h + 1) * hd], anchor_pos + j, cfg.rope_head_dim, cfg.rope_theta)
            logits = keys @ qh / math.sqrt(hd)
            sink = p[f"{a}.attn_sink"][h]
            m = torch.maximum(logits.max(), sink)
            e = torch.exp(logits - m)
            o = (e[:, None] * keys).sum(0) / (e.sum() + torch.exp(sink - m))
            heads.append(rope(o, anchor_pos + j, cfg.rope_head_dim, cfg.rope_theta, inverse=True))
        o = torch.cat(heads)
        g = cfg.o_groups
        per = o.shape[0] // g
        wo_a = p[f"{a}.wo_a.weight"]  # [g * o_lora_rank, per]
        z = torch.cat([wo_a[i * cfg.o_lora_rank:(i + 1) * cfg.o_lora_rank] @ o[i * per:(i + 1) * per]
                       for i in range(g)])
        out.append(p[f"{a}.wo_b.weight"] @ z)
    return out


def draft_block(p: Params, cfg, embed: torch.Tensor, head: torch.Tensor, anchor: int, anchor_pos: int,
                rings: List[List[torch.Tensor]], grid: Callable, causal: bool = False):
    """-> (h [g, D] pre-norm collapse, U [g, V]); ``causal``: block_attention=causal."""
    g, n = cfg.dspark_block_size, cfg.hc_mult
    ids = [anchor] + [cfg.dspark_noise_token_id] * (g - 1)
    streams = [embed[i].expand(n, -1).clone() for i in ids]
    pre = [torch.eye(n, dtype=torch.float64)[0] for _ in ids]
    for s in range(cfg.n_mtp_layers):
        m = f"mtp.{s}"
        mixes = [hc_mix(x, p[f"{m}.hc_attn_fn"], p[f"{m}.hc_attn_base"], p[f"{m}.hc_attn_scale"], cfg) for x in streams]
        us = [rms(collapse(x, pr), p[f"{m}.attn_norm.weight"], cfg.norm_eps) for x, pr in zip(streams, pre)]
        ys = attention(p, s, cfg, us, anchor_pos, rings[s], grid, causal)
        streams = [expand(y, x, mx[1], mx[2]) for y, x, mx in zip(ys, streams, mixes)]
        fmix = [hc_mix(x, p[f"{m}.hc_ffn_fn"], p[f"{m}.hc_ffn_base"], p[f"{m}.hc_ffn_scale"], cfg) for x in streams]
        us = [rms(collapse(x, mx[0]), p[f"{m}.ffn_norm.weight"], cfg.norm_eps) for x, mx in zip(streams, mixes)]
        streams = [expand(moe(u, p, f"{m}.ffn", cfg), x, fm[1], fm[2]) for u, x, fm in zip(us, streams, fmix)]
        pre = [fm[0] for fm in fmix]
    last = f"mtp.{cfg.n_mtp_layers - 1}"
    h = torch.stack([collapse(x, pr) for x, pr in zip(streams, pre)])
    logits = torch.stack([head @ rms(x, p[f"{last}.norm.weight"], cfg.norm_eps) for x in h])
    return h, logits


def markov_bias(p: Params, cfg, prev: int) -> torch.Tensor:
    last = f"mtp.{cfg.n_mtp_layers - 1}.markov_head"
    return p[f"{last}.head.weight"] @ p[f"{last}.embed.weight"][prev]


def confidence(p: Params, cfg, h: torch.Tensor, prev: int) -> torch.Tensor:
    last = f"mtp.{cfg.n_mtp_layers - 1}"
    z = torch.cat([h, p[f"{last}.markov_head.embed.weight"][prev]])
    return p[f"{last}.confidence_head.proj.weight"][0] @ z
