"""A straightforward float64 reference of the V4-0731 DSpark draft, written from the documents
(dspark.md §2.3, deepseek_v4.md §3-5): one request, one token, one head at a time. It reads
the draft's parameters by their checkpoint names and shares no code with the engine."""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import torch

EPS = 1e-6


def _p(params: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return params[name].double()


def rmsnorm(x: torch.Tensor, w=None) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean() + EPS)
    return y * w if w is not None else y


def rope_vec(x: torch.Tensor, pos: int, rope_dim: int, theta: float, inverse: bool = False) -> torch.Tensor:
    """Interleaved pairs of the last rope_dim entries rotated by pos * theta^(-2i/rope_dim)."""
    out = x.clone()
    base = x.shape[-1] - rope_dim
    for i in range(rope_dim // 2):
        phi = pos * theta ** (-2.0 * i / rope_dim)
        if inverse:
            phi = -phi
        a, b = x[base + 2 * i].item(), x[base + 2 * i + 1].item()
        out[base + 2 * i] = a * math.cos(phi) - b * math.sin(phi)
        out[base + 2 * i + 1] = a * math.sin(phi) + b * math.cos(phi)
    return out


def hc_pre(streams: torch.Tensor, fn, base, scale, iters: int):
    n = streams.shape[0]
    z = rmsnorm(streams.reshape(-1))
    mix = fn @ z
    pre = torch.sigmoid(mix[:n] * scale[0] + base[:n]) + EPS
    post = 2 * torch.sigmoid(mix[n:2 * n] * scale[1] + base[n:2 * n])
    c = (mix[2 * n:].reshape(n, n) * scale[2] + base[2 * n:].reshape(n, n))
    c = torch.softmax(c, dim=-1) + EPS
    c = c / (c.sum(dim=0, keepdim=True) + EPS)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=1, keepdim=True) + EPS)
        c = c / (c.sum(dim=0, keepdim=True) + EPS)
    u = sum(pre[j] * streams[j] for j in range(n))
    return u, post, c


def hc_post(y, streams, post, c):
    n = streams.shape[0]
    return torch.stack([post[k] * y + sum(c[j, k] * streams[j] for j in range(n)) for k in range(n)])


def expert(x, w1, w2, w3, limit):
    gate = torch.clamp(w1 @ x, max=limit)
    up = torch.clamp(w3 @ x, -limit, limit)
    return w2 @ (gate * torch.sigmoid(gate) * up)


def moe(params, p: str, x: torch.Tensor, num_experts: int, top_k: int, limit: float, scaling: float):
    s = torch.sqrt(torch.nn.functional.softplus(_p(params, f"{p}.ffn.gate.weight") @ x))
    chosen = torch.topk(s + _p(params, f"{p}.ffn.gate.bias"), top_k).indices.tolist()
    total = sum(s[e] for e in chosen)
    y = torch.zeros_like(x)
    for e in chosen:
        w = [_p(params, f"{p}.ffn.experts.{e}.w{i}.weight") for i in (1, 2, 3)]
        y = y + s[e] / total * scaling * expert(x, *w, limit)
    shared = [_p(params, f"{p}.ffn.shared_experts.w{i}.weight") for i in (1, 2, 3)]
    return y + expert(x, *shared, limit)


class Reference:
    """The draft of ``params`` (checkpoint names -> tensors) for a V4 config ``cfg``."""

    def __init__(self, params: Dict[str, torch.Tensor], cfg, dcfg, embed: torch.Tensor, head: torch.Tensor):
        self.params, self.cfg, self.dcfg = params, cfg, dcfg
        self.embed, self.head = embed.double(), head.double()

    def ring_kv(self, stage: int, tap: torch.Tensor, pos: int) -> torch.Tensor:
        """The ring row of one committed position from its taps [k*D]."""
        prm, p0, p = self.params, "mtp.0", f"mtp.{stage}"
        main_x = rmsnorm(_p(prm, f"{p0}.main_proj.weight") @ tap.double(), _p(prm, f"{p0}.main_norm.weight"))
        kv = rmsnorm(_p(prm, f"{p}.attn.wkv.weight") @ main_x, _p(prm, f"{p}.attn.kv_norm.weight"))
        return rope_vec(kv, pos, self.cfg.rope_dim, self.cfg.rope_theta)

    def attention(self, stage: int, xs: List[torch.Tensor], anchor_pos: int, context: Dict[int, torch.Tensor],
                  causal: bool = False):
        cfg, prm, p = self.cfg, self.params, f"mtp.{stage}.attn"
        g, hd, h = len(xs), cfg.head_dim, cfg.num_heads
        window = range(max(0, anchor_pos - cfg.sliding_window), anchor_pos)
        block_kv = [rope_vec(rmsnorm(_p(prm, f"{p}.wkv.weight") @ x, _p(prm, f"{p}.kv_norm.weight")),
                             anchor_pos + i, cfg.rope_dim, cfg.rope_theta) for i, x in enumerate(xs)]
        ring = [context[(stage, j)] for j in window]
        outs = []
        for i, x in enumerate(xs):
            keys = ring + (block_kv[:i + 1] if causal else block_kv)  # ring + the block (up to slot i if causal)
            cq = rmsnorm(_p(prm, f"{p}.wq_a.weight") @ x, _p(prm, f"{p}.q_norm.weight"))
            q = (_p(prm, f"{p}.wq_b.weight") @ cq).reshape(h, hd)
            heads = []
            for head in range(h):
                qh = rope_vec(rmsnorm(q[head]), anchor_pos + i, cfg.rope_dim, cfg.rope_theta)
                logits = torch.stack([qh @ k / math.sqrt(hd) for k in keys])
                z = torch.exp(logits - logits.max())
                sink = torch.exp(_p(prm, f"{p}.attn_sink")[head] - logits.max())
                o = sum(z[j] * keys[j] for j in range(len(keys))) / (z.sum() + sink)
                heads.append(rope_vec(o, anchor_pos + i, cfg.rope_dim, cfg.rope_theta, inverse=True))
            o = torch.stack(heads)  # [H, hd]
            groups = o.reshape(cfg.o_groups, -1)
            wa = _p(prm, f"{p}.wo_a.weight").reshape(cfg.o_groups, cfg.o_lora_rank, -1)
            mid = torch.cat([wa[gi] @ groups[gi] for gi in range(cfg.o_groups)])
            outs.append(_p(prm, f"{p}.wo_b.weight") @ mid)
        return outs

    def block(self, anchor: int, anchor_pos: int, context: Dict[int, torch.Tensor], causal: bool = False):
        """-> (h [g, D] pre-norm, U [g, V]) for one request; ``causal``: block_attention=causal."""
        cfg, dcfg, prm = self.cfg, self.dcfg, self.params
        ids = [anchor] + [dcfg.noise_token_id] * (dcfg.block_size - 1)
        streams = [self.embed[t].repeat(cfg.hc_mult, 1) for t in ids]  # g x [n, D]
        top_k = dcfg.num_experts_per_tok or cfg.num_experts_per_tok
        experts = dcfg.n_routed_experts or cfg.n_routed_experts
        for s in range(dcfg.num_stages):
            p = f"mtp.{s}"
            mixes = [hc_pre(x, _p(prm, f"{p}.hc_attn_fn"), _p(prm, f"{p}.hc_attn_base"),
                            _p(prm, f"{p}.hc_attn_scale"), cfg.hc_sinkhorn_iters) for x in streams]
            normed = [rmsnorm(u, _p(prm, f"{p}.attn_norm.weight")) for u, _, _ in mixes]
            att = self.attention(s, normed, anchor_pos, context, causal)
            streams = [hc_post(a, x, post, c) for a, x, (_, post, c) in zip(att, streams, mixes)]
            new = []
            for x in streams:
                v, post, c = hc_pre(x, _p(prm, f"{p}.hc_ffn_fn"), _p(prm, f"{p}.hc_ffn_base"),
                                    _p(prm, f"{p}.hc_ffn_scale"), cfg.hc_sinkhorn_iters)
                y = moe(prm, p, rmsnorm(v, _p(prm, f"{p}.ffn_norm.weight")), experts, top_k, cfg.swiglu_limit,
                        cfg.routed_scaling_factor)
                new.append(hc_post(y, x, post, c))
            streams = new
        last = f"mtp.{dcfg.num_stages - 1}"
        hs, us = [], []
        for x in streams:
            z = rmsnorm(x.reshape(-1))
            pre = torch.sigmoid((_p(prm, f"{last}.hc_head_fn") @ z) * _p(prm, f"{last}.hc_head_scale")
                                + _p(prm, f"{last}.hc_head_base")) + EPS
            hk = sum(pre[j] * x[j] for j in range(cfg.hc_mult))
            hs.append(hk)
            us.append(self.head @ rmsnorm(hk, _p(prm, f"{last}.norm.weight")))
        return torch.stack(hs), torch.stack(us)

    def markov_bias(self, prev: int) -> torch.Tensor:
        last = f"mtp.{self.dcfg.num_stages - 1}.markov_head"
        return _p(self.params, f"{last}.markov_w2.weight") @ _p(self.params, f"{last}.markov_w1.weight")[prev]

    def confidence_logit(self, h: torch.Tensor, prev: int) -> float:
        last = f"mtp.{self.dcfg.num_stages - 1}"
        e = _p(self.params, f"{last}.markov_head.markov_w1.weight")[prev]
        return float(_p(self.params, f"{last}.confidence_head.proj.weight")[0] @ torch.cat([h.double(), e]))


def taps_of(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenated hc-means of layer outputs [T, n, D] -> [T, k*D]."""
    return torch.cat([o.double().mean(dim=1) for o in outputs], dim=-1)
