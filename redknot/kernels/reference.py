"""Reference (plain PyTorch) implementations of every registered op.

Each fast backend keeps the signature of the op registered here and is tested
against it. Conventions: ``T`` rows (tokens of all sequences of a step,
concatenated), activations in the model dtype, reductions and mixing in fp32.

Ops registered here and in the ``ref_*`` modules this file imports:

==================  ==========================================================
rms_norm            x [..., N], weight [N] | None, eps -> x.dtype
linear              x [T, K] · W[N, K]ᵀ; W float, FP8 (+ block scale) or packed FP4 (+ group scale)
grouped_linear      x [T, G, K], W [G*R, K] (+ scale) -> [T, G, R] (block-diagonal projection)
rope                interleaved rotation of the trailing 2*len(cos) dims (inverse: rotate by -angle)
rope_inplace        rope written into x's own trailing dims (the other dims neither read nor written)
rms_norm_rope       rms_norm, then rope (a query's or a key's norm and rotation)
mhc_pre / mhc_post  manifold-constrained hyper-connection weights (Sinkhorn) and stream mixing
mhc_head            final hyper-connection collapse (no Sinkhorn, no post)
mhc_pre_norm        mhc_pre, then the sublayer's RMSNorm of the collapse
mhc_post_pre_norm   mhc_post of a sublayer's output, then the next site's mhc_pre_norm
router_scores       MoE router affinities sqrt(softplus(x · Wᵀ)) in fp32
route               expert ids (hash table or top-k of affinities + bias) and renormalised weights
compressor          softmax-gated pooling of raw projected rows into compressed entries
compressor_decode   a decode step's compressor update: ring writes, pooling, norm, RoPE, pool write
compressor_decode_rows  the index tensors compressor_decode takes, from the step's positions, slots, block tables
rope_cos_sin        cos / sin [T, r/2] fp32 of one fp32 angle product position · inverse frequency
ring_write          a decode step's rows into per-slot rings at position mod ring length
visible_entries     the ids of the compressed entries each row sees (every entry whose window has closed)
indexer_topk        lightning-indexer scores + top-k (ties: lower entry index first)
sparse_attention    queries x (SWA window ∪ chosen compressed entries) + sink, one softmax
moe                 routed experts: permutation, expert SwiGLU GEMMs, fixed-order combine
==================  ==========================================================
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from redknot.kernels.ref_quant import dequantize
from redknot.kernels.registry import register


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """y = x * rsqrt(mean(x²) + eps) (* weight), computed in fp32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, K] · W[N, K]ᵀ -> [T, N] in x.dtype. Quantised weights are dequantised on the fly."""
    return F.linear(x, dequantize(weight, scale, x.dtype))


@register("grouped_linear")
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, G, K], W [G*R, K] -> y [T, G, R] with y[:, g] = x[:, g] · W[g*R:(g+1)*R]ᵀ."""
    t, g, k = x.shape
    w = dequantize(weight, scale, x.dtype).view(g, -1, k)  # [G, R, K]
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


@register("rope_cos_sin")
def rope_cos_sin(positions: torch.Tensor, inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (integers), inverse frequencies inv [r/2] -> cos, sin [T, r/2] fp32; angle = fp32(position)
    · inv, one fp32 product."""
    angles = positions.float()[:, None] * inv.float()[None, :]
    return angles.cos(), angles.sin()


@register("ring_write")
def ring_write(values: torch.Tensor, ring: torch.Tensor, seq_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """A decode step (row b = sequence b's token): values [B, C] into ring [S, R, C] at row
    ``seq_slots[b] · R + positions[b] mod R``, cast to the ring's dtype."""
    dest = seq_slots.long() * ring.shape[1] + positions.long() % ring.shape[1]
    ring.view(-1, ring.shape[-1]).index_copy_(0, dest, values.to(ring.dtype))


@register("visible_entries")
def visible_entries(positions: torch.Tensor, ratio: int, width: int) -> torch.Tensor:
    """[T, width] int64: row t's entry ids 0 .. (positions[t] + 1) // ratio - 1 in order, then -1."""
    w = torch.arange(width, device=positions.device)
    visible = (positions + 1) // ratio  # [T]
    return torch.where(w[None, :] < visible[:, None], w[None, :], torch.full_like(w[None, :], -1))


@register("rope")
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the trailing ``2*cos.shape[-1]`` dims of
    x [T, ..., D] by the angle whose cos/sin [T, r/2] are given (fp32); ``inverse`` rotates back."""
    half = cos.shape[-1]
    r = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape).float(), sin.view(shape).float()
    if inverse:
        s = -s
    pairs = x[..., -r:].float().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


@register("rope_inplace")
def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """:func:`rope` of ``x`` written into ``x``'s own trailing ``2*cos.shape[-1]`` dims (the other dims are left
    as they are); returns ``x``. For a tensor nothing else reads, such as an attention output before its
    inverse rotation: only the rotated columns move through memory."""
    r = 2 * cos.shape[-1]
    x[..., -r:] = rope(x[..., -r:], cos, sin, inverse)
    return x


@register("rms_norm_rope")
def rms_norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """``rope(rms_norm(x, weight, eps), cos, sin)``: the norm rounded to x.dtype, then the rotation."""
    return rope(rms_norm(x, weight, eps), cos, sin)


def _hc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """fn · rmsnorm(flatten(streams)) in fp32: [T, n, D] -> [T, fn.shape[0]]."""
    z = streams.flatten(1).float()
    z = z * torch.rsqrt(z.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(z, fn.float())


@register("mhc_pre")
def mhc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            sinkhorn_iters: int, hc_eps: float, norm_eps: float
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D] -> (collapsed input [T, D] in streams.dtype, post [T, n] fp32,
    comb [T, n, n] fp32 doubly stochastic; comb[j, k] moves stream j into output stream k)."""
    n = streams.shape[1]
    mix = _hc_mix(streams, fn, norm_eps)  # [T, (2+n)n]
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    comb = mix[:, 2 * n:].view(-1, n, n) * scale[2] + base[2 * n:].view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
    return collapsed, post, comb


@register("mhc_pre_norm")
def mhc_pre_norm(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                 sinkhorn_iters: int, hc_eps: float, norm_eps: float, norm_weight: Optional[torch.Tensor],
                 rms_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's input: ``mhc_pre``, then ``rms_norm(collapsed, norm_weight, rms_eps)`` (the collapse rounded
    to streams.dtype first) -> (normalised input [T, D] in streams.dtype, post [T, n], comb [T, n, n])."""
    u, post, comb = mhc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return rms_norm(u, norm_weight, rms_eps), post, comb


@register("mhc_post")
def mhc_post(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[:, k] = post[:, k] * y + Σ_j comb[:, j, k] * streams[:, j]   (fp32 mix, streams.dtype out)."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), streams.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(1) + mixed).to(streams.dtype)


@register("mhc_post_pre_norm")
def mhc_post_pre_norm(y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, hc_eps: float,
                      norm_eps: float, norm_weight: Optional[torch.Tensor], rms_eps: float
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_post(y, streams, post, comb)``, then the next site's ``mhc_pre_norm`` of the new streams ->
    (new streams [T, n, D], the next sublayer's input [T, D], its post [T, n], its comb [T, n, n])."""
    out = mhc_post(y, streams, post, comb)
    return (out,) + mhc_pre_norm(out, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm_weight, rms_eps)


@register("mhc_head")
def mhc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the n streams [T, n, D] -> [T, D] with sigmoid weights (no Sinkhorn)."""
    pre = torch.sigmoid(_hc_mix(streams, fn, norm_eps) * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


@register("router_scores")
def router_scores(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D], router weight [E, D] -> [T, E] fp32 = sqrt(softplus(x · Wᵀ)) (logits in fp32)."""
    return F.softplus(F.linear(x.float(), weight.float())).sqrt()


@register("route")
def route(scores: torch.Tensor, bias: Optional[torch.Tensor], tid2eid: Optional[torch.Tensor],
          input_ids: torch.Tensor, top_k: int, scaling: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """MoE routing from the affinities scores [T, E] fp32: the experts ``tid2eid[input_ids]`` (hash layers) or the
    top ``top_k`` of ``scores + bias`` (best first), and their scores renormalised to sum 1, times ``scaling``
    -> (ids [T, k] int64, weights [T, k] fp32)."""
    if tid2eid is not None:
        idx = tid2eid[input_ids].long()
    else:
        idx = torch.topk(scores + bias, top_k, dim=-1).indices
    w = scores.gather(1, idx)
    return idx, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling


# The remaining ops live in their own modules; importing them registers them.
from redknot.kernels import ref_attention as _ref_attention  # noqa: E402,F401
from redknot.kernels import ref_moe as _ref_moe  # noqa: E402,F401
from redknot.kernels import ref_v41 as _ref_v41  # noqa: E402,F401
