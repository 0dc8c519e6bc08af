"""One V4 layer: attention and MoE sub-blocks, each wrapped by mHC (reference §2-3), and the
MTP layer built on it (reference §6)."""
from __future__ import annotations

import torch
from torch import nn

from redknot.models.deepseek_v4.attention import Attention
from redknot.models.deepseek_v4.config import V4Config
from redknot.models.deepseek_v4.layers import Linear, Norm
from redknot.models.deepseek_v4.moe import MoE
from redknot.models.deepseek_v4.params import ParamFactory
from redknot.models.deepseek_v4.state import LayerState
from redknot.step.context import StepContext


class Block(nn.Module):
    """A decoder layer on hc_mult residual streams: mHC-wrapped attention, then mHC-wrapped MoE."""

    def __init__(self, f: ParamFactory, cfg: V4Config, ratio: int, hash_layer: bool):
        super().__init__()
        d, n = cfg.hidden_size, cfg.hc_mult
        self.cfg = cfg
        self.attn_norm = Norm(f, d, cfg.rms_norm_eps)
        self.ffn_norm = Norm(f, d, cfg.rms_norm_eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", f.fp32((2 + n) * n, n * d))
            setattr(self, f"hc_{site}_base", f.fp32((2 + n) * n))
            setattr(self, f"hc_{site}_scale", f.fp32(3))
        self.attn = Attention(f, cfg, ratio)
        self.ffn = MoE(f, cfg, hash_layer)

    def _site(self, site: str):
        """The mHC and norm arguments of site ``site`` (attn, ffn) after its streams."""
        cfg, norm = self.cfg, getattr(self, f"{site}_norm")
        return (getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale"),
                cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, norm.weight, norm.eps)

    def pre_norm(self, ks, streams: torch.Tensor, site: str):
        """(the site's sublayer input: its norm of the mHC collapse, post, comb), one registry op."""
        return ks.mhc_pre_norm(streams, *self._site(site))

    def post_pre_norm(self, ks, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      site: str):
        """(the streams after the sublayer output ``y``'s post mix, then :meth:`pre_norm`'s three of the next site
        ``site``), one registry op."""
        return ks.mhc_post_pre_norm(y, streams, post, comb, *self._site(site))

    def forward(self, ks, streams: torch.Tensor, ctx: StepContext, st: LayerState,
                input_ids: torch.Tensor) -> torch.Tensor:
        """streams [T, n, D] -> [T, n, D]."""
        x, post, comb = self.pre_norm(ks, streams, "attn")
        a = self.attn(ks, x, ctx, st)
        streams, x, post, comb = self.post_pre_norm(ks, a, streams, post, comb, "ffn")
        y = self.ffn(ks, x, input_ids)
        return ks.mhc_post(y, streams, post, comb)


class MTPLayer(Block):
    """Next-token predictor: combines the target's pre-head streams at position t with the
    embedding of token t+1, runs one sliding-window block, and has its own HyperHead."""

    def __init__(self, f: ParamFactory, cfg: V4Config):
        super().__init__(f, cfg, ratio=0, hash_layer=False)
        d, n = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(f, d, d, f.linear_fmt)
        self.h_proj = Linear(f, d, d, f.linear_fmt)
        self.enorm = Norm(f, d, cfg.rms_norm_eps)
        self.hnorm = Norm(f, d, cfg.rms_norm_eps)
        self.norm = Norm(f, d, cfg.rms_norm_eps)
        self.hc_head_fn = f.fp32(n, n * d)
        self.hc_head_base = f.fp32(n)
        self.hc_head_scale = f.fp32(1)

    def embed_streams(self, ks, prev_streams: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        """X[k] = e_proj(enorm(e)) + h_proj(hnorm(H[k])) for every stream k: [T, n, D]."""
        e = self.e_proj(ks, self.enorm(ks, next_embed))  # [T, D]
        h = self.h_proj(ks, self.hnorm(ks, prev_streams))  # [T, n, D]
        return h + e.unsqueeze(1)
