"""The dense one-shot oracle of DeepSeek-V4.1 (reference §3), written from the document.

One sequence at positions 0..S-1, every layer over every row, dense masks, no
paging, no rings, no chunking: the shape of the math as the document states it.
The engine path (:mod:`redknot.models.deepseek_v41.model`) is tested against it.
Shared with the engine path are only the pointwise formulas of :mod:`ref_math`
(norm, RoPE table, quantisers) and the integer hashing of :mod:`engram_hash`.

Two serving variants are expressed on the one-shot sequence:

* ``index_keys="shipped"`` with ``decode_from``: rows at positions >= decode_from are
  decode steps; there a ratio-2 owner whose group is incomplete scores the last
  published index keys (the last kv source's), as the shipped reference does (§5.2).
* ``replay_from`` (bounded replay, §5.5): layers above the last kv source compute only
  rows >= replay_from, and their windows start there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from redknot.models.deepseek_v41.engram_hash import EngramHasher, EngramLayout
from redknot.models.deepseek_v41.ref_math import (
    Numerics, Weights, acc_dtype, apply_rope, bf16_round, compressed_qdq, index_qdq, layer_rope, linear,
    plain_linear, rms_norm, topk_ids, window_qdq)


@dataclass
class RefOutput:
    """Logits of rows first_row..S-1 and the per-layer selections (for tie-aware checks)."""
    logits: torch.Tensor                          # [S - first_row, V]
    first_row: int
    scores: Dict[int, torch.Tensor] = field(default_factory=dict)    # index source -> [N, n] (-inf: not eligible)
    topk: Dict[int, torch.Tensor] = field(default_factory=dict)      # index source -> [N, K] entry ids, -1 none
    candidates: Dict[int, torch.Tensor] = field(default_factory=dict)  # candidate source -> [N, n] bool


def _sinkhorn_mixes(h, fn, base, scale, cfg):
    a = acc_dtype(h.dtype)
    n = cfg.hc_mult
    x = h.reshape(h.shape[0], -1).to(a)
    mix = (x @ fn.t()) * torch.rsqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps)
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    c = torch.softmax((mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(-1, n, n), dim=-1) + cfg.hc_eps
    c = c / (c.sum(dim=1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(dim=2, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(dim=1, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def _collapse(h, pi):
    return torch.einsum("sc,scd->sd", pi, h.to(pi.dtype)).to(h.dtype)


def _expand(y, h, post, c):
    a = post.dtype
    out = post[:, :, None] * y.to(a)[:, None, :] + torch.einsum("sij,sid->sjd", c, h.to(a))
    return out.to(h.dtype)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
    """select_candidate_blocks (§3.5(d)): [N, n] scores, [N] visible counts -> [N, n] bool mask."""
    n_rows, n = scores.shape
    nblk = -(-n // block)
    padded = torch.full((n_rows, nblk * block), float("-inf"), dtype=scores.dtype)
    padded[:, :n] = scores
    bscore = padded.view(n_rows, nblk, block).amax(-1)
    newest = (visible - 1).clamp(min=0) // block
    pin = (visible > 0)[:, None] & (torch.arange(nblk)[None, :] == newest[:, None])
    bscore = torch.where(pin, torch.full_like(bscore, float("inf")), bscore)
    keep = topk_ids(bscore, min(n_blocks, nblk))
    kept = torch.zeros(n_rows, nblk, dtype=torch.bool)
    kept.scatter_(1, keep, True)
    kept &= bscore > float("-inf")
    return kept.repeat_interleave(block, dim=1)[:, :n]


class ReferenceV41:
    """``forward(ids)`` -> :class:`RefOutput`; the weights are native checkpoint tensors."""

    def __init__(self, cfg, weights: Weights, token_map: torch.Tensor, pad_c: int, numerics: Numerics,
                 index_keys: str = "owner"):
        self.cfg, self.w, self.num = cfg, weights, numerics
        self.token_map = token_map.long()
        self.index_keys = index_keys
        self.hasher = EngramHasher(EngramLayout.create(cfg, pad_c)) if cfg.engram_layer_ids else None
        self._published: Optional[torch.Tensor] = None   # last kv source's keys of the previous pass

    # --------------------------------------------------------------- driver (§3.4)
    @torch.no_grad()
    def forward(self, ids: Sequence[int], decode_from: Optional[int] = None,
                replay_from: Optional[int] = None) -> RefOutput:
        """Logits of every row. With ``index_keys="shipped"`` and ``decode_from``, the decode rows'
        ratio-2 owners read the last kv source's keys of the *previous* step; those keys come from
        later layers of earlier rows, so the one-shot pass is repeated with the keys of the pass
        before until they stop changing (pass k is exact for rows < decode_from + k)."""
        self._published = None
        if self.index_keys != "shipped" or decode_from is None or not self.cfg.kv_source_layers:
            return self._forward(ids, decode_from, replay_from)
        last = max(self.cfg.kv_source_layers)
        for _ in range(len(ids) - decode_from + 1):
            out = self._forward(ids, decode_from, replay_from)
            keys = self.slots["all_keys"][last]
            if self._published is not None and torch.equal(keys, self._published):
                break
            self._published = keys
        return out

    def _forward(self, ids, decode_from, replay_from) -> RefOutput:
        cfg, w, dt = self.cfg, self.w, self.num.dtype
        ids_t = torch.tensor(list(ids), dtype=torch.long)
        s = ids_t.shape[0]
        pos = torch.arange(s)
        hashes = None
        if self.hasher is not None:
            lb = self.hasher.layout.lookback
            comp = torch.cat([torch.zeros(lb, dtype=torch.long), self.token_map[ids_t]])
            hashes = self.hasher.hash(comp[None], 0)[0]                      # [S, L, cols]
        e = w.dense("embed.weight", dt)[ids_t]
        h = e[:, None, :].expand(s, cfg.hc_mult, cfg.dim).clone()           # [S, hc, D]
        pre = torch.zeros(s, cfg.hc_mult, dtype=acc_dtype(dt))
        pre[:, 0] = 1
        split = max(cfg.kv_source_layers) + 1 if cfg.kv_source_layers else 0
        first = 0
        out = RefOutput(logits=torch.empty(0), first_row=0)
        self.slots: Dict[str, object] = {}
        for layer in range(cfg.n_layers):
            if replay_from is not None and layer == split and replay_from > 0:
                first = min(replay_from, s - 1)
                h, pre, pos = h[first:], pre[first:], pos[first:]
                if hashes is not None:
                    hashes = hashes[first:]
                for key in ("topk", "cand"):
                    if key in self.slots:
                        self.slots[key] = self.slots[key][first:]
            if cfg.is_engram(layer):
                h = self._engram(h, hashes[:, cfg.engram_index(layer)], layer)
            h, pre = self._block(layer, h, pre, pos, s, first, decode_from, out)
        x = _collapse(h, pre)
        x = rms_norm(x, w.float("norm.weight"), cfg.norm_eps).to(acc_dtype(dt))
        out.logits = x @ w.dense("head.weight", acc_dtype(dt)).t()
        out.first_row = first
        return out

    def _block(self, layer, h, pre_in, pos, s, first, decode_from, out):
        cfg, w = self.cfg, self.w
        p = f"layers.{layer}"
        a = acc_dtype(h.dtype)
        pre_a, post_a, c_a = _sinkhorn_mixes(h, w.float(f"{p}.hc_attn_fn"), w.float(f"{p}.hc_attn_base"),
                                             w.float(f"{p}.hc_attn_scale"), cfg)
        u = rms_norm(_collapse(h, pre_in.to(a)), w.float(f"{p}.attn_norm.weight"), cfg.norm_eps)
        h = _expand(self._attention(layer, u, pos, s, first, decode_from, out), h, post_a, c_a)
        pre_f, post_f, c_f = _sinkhorn_mixes(h, w.float(f"{p}.hc_ffn_fn"), w.float(f"{p}.hc_ffn_base"),
                                             w.float(f"{p}.hc_ffn_scale"), cfg)
        u = rms_norm(_collapse(h, pre_a), w.float(f"{p}.ffn_norm.weight"), cfg.norm_eps)
        h = _expand(self._moe(layer, u), h, post_f, c_f)
        return h, pre_f

    # --------------------------------------------------------------- Engram (§3.2)
    def _engram(self, h, ids, layer):
        cfg, w, num = self.cfg, self.w, self.num
        p = f"layers.{layer}.engram"
        a = acc_dtype(num.dtype)
        table = w.raw(f"{p}.embed.weight").view(torch.uint8)[ids]           # [S, cols, hd] e4m3 bytes
        scale = w.raw(f"{p}.embed.scale").view(torch.uint8)[ids]            # [S, cols, hd/32]
        vals = table.view(torch.float8_e4m3fn).to(torch.float32)
        rows = (vals.unflatten(-1, (-1, 32)) * torch.exp2(scale.float() - 127)[..., None]).flatten(-2)
        kv = linear(rows.reshape(h.shape[0], -1).to(num.dtype), w, f"{p}.wkv.weight", num).to(a)
        d = cfg.dim
        key, value = kv[:, :cfg.hc_mult * d].reshape(-1, cfg.hc_mult, d), kv[:, cfg.hc_mult * d:]
        qk = w.float(f"{p}.q_weight") * w.float(f"{p}.k_weight")
        hf = h.to(a)
        dot = (hf * qk * key).sum(-1) * torch.rsqrt((hf * hf).mean(-1) + cfg.norm_eps) \
            * torch.rsqrt((key * key).mean(-1) + cfg.norm_eps) / d ** 0.5
        gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=1e-6).sqrt())
        return (hf + gate[..., None] * value[:, None, :]).to(h.dtype)

    # --------------------------------------------------------------- attention (§3.5)
    def _attention(self, layer, u, pos, s, first, decode_from, out):
        cfg, w, num = self.cfg, self.w, self.num
        dt, a = num.dtype, acc_dtype(num.dtype)
        p = f"layers.{layer}.attn"
        ratio = cfg.compress_ratios[layer]
        inv = layer_rope(cfg, ratio)
        n = u.shape[0]
        qr = rms_norm(linear(u, w, f"{p}.wq_a.weight", num), w.float(f"{p}.q_norm.weight"), cfg.norm_eps)
        q = apply_rope(linear(qr, w, f"{p}.wq_b.weight", num).view(n, cfg.n_heads, cfg.head_dim), pos, inv)
        kv = rms_norm(linear(u, w, f"{p}.wkv.weight", num), w.float(f"{p}.kv_norm.weight"), cfg.norm_eps)
        kv = window_qdq(apply_rope(kv, pos, inv))                            # [N, Dh]
        if cfg.is_kv_source(layer):
            self._compress(layer, u, ratio, inv)
        if cfg.is_index_source(layer):
            self._index(layer, u, qr, pos, ratio, inv, decode_from, out)
        # window: rows max(first, p - W + 1) .. p
        dist = pos[:, None] - pos[None, :]
        win = (dist >= 0) & (dist < cfg.window_size)                         # [N, N]
        scale = cfg.head_dim ** -0.5
        z = torch.einsum("nhd,md->nhm", q.to(a), kv.to(a)) * scale
        z = z.masked_fill(~win[:, None, :], float("-inf"))
        values = [kv.to(a)]
        if ratio:
            entries = self.slots["kv"]                                       # [n_entries, Dh]
            sel = self.slots["topk"]                                         # [N, K]
            hot = torch.zeros(n, entries.shape[0] + 1, dtype=torch.bool)
            hot.scatter_(1, torch.where(sel >= 0, sel, entries.shape[0]), True)
            hot = hot[:, :-1]
            zc = torch.einsum("nhd,jd->nhj", q.to(a), entries.to(a)) * scale
            z = torch.cat([z, zc.masked_fill(~hot[:, None, :], float("-inf"))], dim=-1)
            values.append(entries.to(a))
        sink = w.float(f"{p}.attn_sink")[None, :, None].expand(n, -1, 1)
        m = torch.maximum(z.amax(-1, keepdim=True), sink)
        e = torch.exp(z - m)
        o = torch.einsum("nhm,md->nhd", e, torch.cat(values)) / (e.sum(-1, keepdim=True) + torch.exp(sink - m))
        o = apply_rope(o.to(dt), pos, inv, inverse=True)
        g = cfg.o_groups
        wo_a = w.dense(f"{p}.wo_a.weight", dt).view(g, cfg.o_lora_rank, -1)
        z_g = torch.einsum("ngk,grk->ngr", o.reshape(n, g, -1), wo_a).reshape(n, -1)
        return linear(z_g, w, f"{p}.wo_b.weight", num)

    def _compress(self, layer, u, ratio, inv):
        cfg, w, num = self.cfg, self.w, self.num
        dt, a = num.dtype, acc_dtype(num.dtype)
        p = f"layers.{layer}.attn"
        if ratio == 1:
            latent = rms_norm(plain_linear(u, w, f"{p}.compressor.wkv.weight", dt),
                              w.float(f"{p}.compressor.norm.weight"), cfg.norm_eps)
        else:
            groups = u.shape[0] // ratio
            kv_a = plain_linear(u.to(a), w, f"{p}.compressor.wkv.weight", a)[:groups * ratio]
            gate = plain_linear(u.to(a), w, f"{p}.compressor.wgate.weight", a)[:groups * ratio]
            kv_a, gate = kv_a.view(groups, ratio, -1), gate.view(groups, ratio, -1)
            pooled = (kv_a * torch.softmax(gate, dim=1)).sum(1)
            latent = rms_norm(pooled.to(dt), w.float(f"{p}.compressor.norm.weight"), cfg.norm_eps)
        epos = torch.arange(latent.shape[0]) * ratio
        keys = rms_norm(plain_linear(latent, w, f"{p}.indexer.wk.weight", dt),
                        w.float(f"{p}.indexer.k_norm.weight"), cfg.norm_eps)
        keys = index_qdq(apply_rope(keys, epos, inv))
        self.slots["kv"] = compressed_qdq(apply_rope(latent, epos, inv))
        self.slots["keys"] = keys
        self.slots["ratio"] = ratio
        self.slots.setdefault("all_keys", {})[layer] = keys

    def _index(self, layer, u, qr, pos, ratio, inv, decode_from, out):
        cfg, w, num = self.cfg, self.w, self.num
        dt, a = num.dtype, acc_dtype(num.dtype)
        p = f"layers.{layer}.attn.indexer"
        n = u.shape[0]
        q = linear(qr, w, f"{p}.wq_b.weight", num).view(n, cfg.index_n_heads, cfg.index_head_dim)
        q = index_qdq(apply_rope(q, pos, inv))
        wts = plain_linear(u, w, f"{p}.weights_proj.weight", dt).to(a) \
            * (cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5)
        keys = self.slots["keys"]
        visible = (pos + 1) // ratio                                          # [N]
        width = keys.shape[0]
        scores = self._scores(q, keys, wts)
        if self.index_keys == "shipped" and decode_from is not None and ratio == 2 and cfg.is_kv_source(layer):
            last = self._published
            quirk = (pos >= decode_from) & ((pos + 1) % ratio != 0)
            if last is not None and bool(quirk.any()):
                alt = self._scores(q, last[:width], wts)
                scores = torch.where(quirk[:, None], alt, scores)
        ent = torch.arange(width)
        scores = scores.masked_fill(ent[None, :] >= visible[:, None], float("-inf"))
        if cfg.is_candidate_source(layer):
            self.slots["cand"] = candidate_blocks(scores, visible, cfg.candidate_topk_blocks,
                                                  cfg.candidate_block_size)
            out.candidates[layer] = self.slots["cand"]
        elif cfg.reads_candidates(layer):
            scores = scores.masked_fill(~self.slots["cand"], float("-inf"))
        k = min(cfg.index_topk, width)
        sel = topk_ids(scores, k) if k else torch.zeros(n, 0, dtype=torch.long)
        sel = torch.where(scores.gather(1, sel) > float("-inf"), sel, torch.full_like(sel, -1))
        self.slots["topk"] = sel
        out.scores[layer], out.topk[layer] = scores, sel

    def _scores(self, q, keys, wts):
        a = wts.dtype
        dots = torch.einsum("nhd,sd->nsh", q.to(a), keys.to(a))
        if self.num.act_quant:  # the reference's bf16 score arithmetic
            r = bf16_round(bf16_round(F.relu(bf16_round(dots))) * bf16_round(wts)[:, None, :])
            return bf16_round(r.sum(-1))
        return (F.relu(dots) * wts[:, None, :]).sum(-1)

    # --------------------------------------------------------------- MoE (§3.7)
    def _moe(self, layer, u):
        cfg, w, num = self.cfg, self.w, self.num
        a = acc_dtype(num.dtype)
        p = f"layers.{layer}.ffn"
        logits = (u.to(a) @ w.dense(f"{p}.gate.weight", a).t()) / cfg.gate_temp
        s = torch.sqrt(F.softplus(logits))
        idx = topk_ids(s + w.float(f"{p}.gate.bias"), cfg.n_activated_experts)
        wgt = s.gather(1, idx)
        if cfg.norm_topk_prob and cfg.n_activated_experts > 1:
            wgt = wgt / (wgt.sum(-1, keepdim=True) + 1e-20)
        wgt = wgt * cfg.route_scale
        y = torch.zeros(u.shape[0], cfg.dim, dtype=a)
        for e in range(cfg.n_routed_experts):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel():
                y[rows] += self._expert(f"{p}.experts.{e}", u[rows], wgt[rows, slot])
        y += self._expert(f"{p}.shared_experts", u, None)
        return y.to(num.dtype)

    def _expert(self, p, x, weight):
        cfg, w, num = self.cfg, self.w, self.num
        a = acc_dtype(num.dtype)
        lim = cfg.swiglu_limit
        g = linear(x, w, f"{p}.w1.weight", num).to(a).clamp(max=lim)
        up = linear(x, w, f"{p}.w3.weight", num).to(a).clamp(-lim, lim)
        act = F.silu(g) * up
        if weight is not None:
            act = act * weight[:, None]
        return linear(act.to(num.dtype), w, f"{p}.w2.weight", num).to(a)
