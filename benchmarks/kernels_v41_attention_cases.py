"""Timed launch shapes of ``sparse_attention_mx`` in prefill (``kernels_v41.py``, attention section): the
earlier kernel (``attention_mx``, heads on the MMA's M side) at its prefill shapes next to the transposed
prefill kernel (``attention_prefill_mx``), one 4096-query chunk (16 under ``--smoke``) at one context, each
row checked against ``ref_v41`` first, then the prefill tuner's choice for that class."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from redknot.kernels import mx_formats as mx
from redknot.kernels import ref_v41 as ref
from redknot.kernels.triton import attention_mx
from redknot.kernels.triton.attention_mx import ATTN_MX_PREFILL_TUNER, AttnMxConfig
from redknot.kernels.triton.attention_prefill_mx import PrefillAttnConfig
from redknot.kernels.triton.checks_mx import V41Dims

# the earlier kernel's shapes that keep all heads (or 16 of them) in one program, then the new kernel's
EARLIER = [AttnMxConfig(64, 32, 8), AttnMxConfig(64, 32, 16), AttnMxConfig(16, 32, 8)]


def _inputs(dims: V41Dims, device, t: int, ctx: int):
    """The prefill case of ``attention_cases``: a sliding window over the chunk's own rows, a sorted random
    top-k of the compressed entries per query."""
    from kernels_v41_cases import _packed_rows
    comp = _packed_rows(mx.pack_compressed_entries, ctx, dims.latent, device)
    win = _packed_rows(mx.pack_window_rows, t + dims.window, dims.latent, device)
    widx = (torch.arange(t, device=device, dtype=torch.int32)[:, None]
            + torch.arange(dims.window, device=device, dtype=torch.int32))
    k = min(dims.attn_topk, ctx)
    cidx = torch.rand(t, ctx, device=device).topk(k, -1).indices.sort(-1).values.to(torch.int32) \
        if t * ctx <= 2 ** 28 else torch.randint(0, ctx, (t, k), device=device, dtype=torch.int32)
    q = torch.randn(t, dims.heads, dims.latent, device=device).to(torch.bfloat16)
    sinks = torch.randn(dims.heads, device=device)
    flops = 4 * t * dims.heads * (dims.window + k) * dims.latent
    nbytes = win.numel() + min(ctx, t * k) * comp.shape[1] + 2 * t * dims.heads * dims.latent * 2
    return (q, win, widx, sinks, dims.latent ** -0.5, comp, cidx), flops, nbytes, k


def attention_variant_cases(dims: V41Dims, device, ctx: int, smoke: bool) -> Iterator[tuple[str, Callable]]:
    from kernels_v41_cases import _case, _checked
    t = 16 if smoke else 4096
    state = {}

    def inputs():
        if not state:
            args, flops, nbytes, k = _inputs(dims, device, t, ctx)
            state.update(args=args, flops=flops, nbytes=nbytes, k=k, want=ref.sparse_attention_mx(*args))
        return state

    shapes = EARLIER + [c for c in ATTN_MX_PREFILL_TUNER.candidates if isinstance(c, PrefillAttnConfig)]
    for cfg in shapes:
        def build(cfg=cfg):
            s = inputs()
            run = lambda: attention_mx.sparse_attention_mx(*s["args"], config=cfg)
            kernel = "transposed prefill kernel" if isinstance(cfg, PrefillAttnConfig) else "earlier kernel"
            note = f"{kernel}; " + _checked("sparse_attention_mx", str(cfg), run, lambda: s["want"], 1e-2)
            return _case("sparse_attention_mx", f"ctx={ctx} T={t} prefill {cfg}", run, s["flops"], s["nbytes"],
                         "bf16", note)
        yield f"sparse_attention_mx prefill {cfg}", build

    def build_tuned():
        s = inputs()
        run = lambda: attention_mx.sparse_attention_mx(*s["args"])
        note = _checked("sparse_attention_mx", "tuned", run, lambda: s["want"], 1e-2)
        chosen = {k: v for k, v in ATTN_MX_PREFILL_TUNER.choices.items() if k[0] == min(t, 4096)}
        return _case("sparse_attention_mx", f"ctx={ctx} T={t} prefill tuned", run, s["flops"], s["nbytes"], "bf16",
                     f"tuner chose {list(chosen.values()) or 'the first candidate (no GPU timing)'}; {note}")
    yield "sparse_attention_mx prefill tuned", build_tuned
