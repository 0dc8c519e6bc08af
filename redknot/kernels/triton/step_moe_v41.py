"""V4.1's MoE router and shared expert at decode sizes in four or five launches instead of ~33 small ones.

At batch 1 a decode step's MoE (reference §3.7) is a dozen element-wise PyTorch ops around the router's
GEMV (division by the temperature, softplus, sqrt, bias, two sorts for the top-k, gather, sum, division,
route scale) and three FP8 linears for the shared expert (each: activation quantisation, split-K weight
stream, slice reduction) with their clamps, SiLU, product and casts, then the combine with the routed
experts. In a replayed graph each launch costs its fixed few microseconds, not its bytes. Here:

* :func:`route_topk`: one program per token takes the router's fp32 logits (the GEMV stays the library's,
  so the logits keep their bits) and writes the ids and weights of :func:`moe.route`: ``sqrt(softplus(l /
  temp))`` (``softplus``: ``l`` above 20, else ``log1p(exp(l))``, as PyTorch), ``k`` rounds of arg-max
  over ``s + bias`` (ties to the lower id, as the stable sort), ids ascending, weights ``s[id]`` normalised
  by their fp32 sum in id order plus 1e-20 (IEEE division), times the route scale.
* :func:`shared_expert_combine`: W1 | W3 in one FP8 weight stream (``stream_fp8``'s arithmetic: the token
  rows quantised per 32 inside, one FP8 MMA per 32-wide group scaled by both powers of two, K slices as
  ``splitk_mx.splitk_mm`` cuts them for ``decode="fp8"``), one program per row block that sums the slices,
  rounds each linear to bf16, clamps, applies SiLU · up, rounds to bf16 and quantises the W2 input per 32
  (the bits of ``act_quant_mx``), the W2 stream (``stream_fp8.fp8_stream``), and one reduction that sums
  W2's slices, rounds to bf16 and adds the routed experts' bf16 sum in fp32: ``bf16(routed + shared)``. With
  ``prologue=True`` (no row count by default: ``PROLOGUE_MAX_ROWS``) the W2 stream forms its slice of the W2
  input itself from the W1 | W3 partials (the same bits; three launches). At one to four bf16 rows the W1 | W3 stream and the W2
  stream may each be a CUDA-core GEMV (``gemv_mx``'s decode; ``step_proj_v41.STEP_SMALL_TUNER`` /
  ``STEP_W2_TUNER`` choose, ``fp8`` first): W2's GEMV reads the SwiGLU rows quantised once by
  ``_swiglu_quant`` (bf16 QDQ values, one launch more than the prologue stream). Not measured on the H200.

With the dense linears' ``fp8`` decode (``gemm_mx.LINEAR_DECODE_TUNER``'s first choice) every partial and
every sum is the one ``linear_mx`` computes, so the shared expert keeps its bits; with another decode the
results differ by summation order only. Transcendentals use libdevice's ``exp`` / ``log1p`` and
correctly rounded ``sqrt`` / division (what PyTorch's CUDA kernels call), not Triton's fast ``exp``; the
router's normalising sum adds the k weights in id order (PyTorch's reduction order may differ by an ulp).

The kernels and their host helpers live by role in ``step_moe_route_v41`` (the router and the W1 | W3 stream),
``step_moe_w2_v41`` (W2's input and stream forms) and ``step_moe_finish_v41`` (the combine and the post mix); this
module keeps the entry points with their stream choices and first-use checks, and re-exports those modules' names.
"""
from __future__ import annotations

import torch

from redknot.kernels.triton._common import cdiv, next_pow2
from redknot.kernels.triton.step_moe_finish_v41 import (  # noqa: F401
    _add_block,
    _finish,
    _mix_rows,
    _reduce_add,
    _reduce_add_post,
    _w2_fused,
    _w2_fused_launch,
    post_mix_fits,
)
from redknot.kernels.triton.step_moe_route_v41 import (  # noqa: F401
    _LIBDEVICE,
    _check_shared,
    _exp,
    _gate_up,
    _gate_up_gemv,
    _route_args,
    _route_gate_up,
    _route_gate_up_gemv,
    _route_row,
    _route_topk,
    _slices,
    _softplus,
    route_topk,
    route_topk_reference,
)
from redknot.kernels.triton.step_moe_w2_v41 import (  # noqa: F401
    _swiglu,
    _swiglu_quant,
    _w2_gemv,
    _w2_swiglu_gemv,
    _w2_swiglu_stream,
    _w2_swiglu_tile,
)

# Rows up to which the step runs these kernels (decode and speculative verify); above, the PyTorch ops and
# the registry's linears, whose per-row launch costs no longer dominate.
MAX_ROWS = 16

# Rows up to which the W2 stream forms its input itself (``_w2_swiglu_stream``: one launch fewer). Each of
# its D/64 column blocks re-reads the W1 | W3 partials of its K slice from L2 (about 7 MB at one V4.1 row).
# Measured on an H100 (8K decode in graphs, 2026-12-06): 0.114 ms a call at one row for 11.8 MB of weight, where
# the two-launch form's W2 stream took 0.0525 ms a call at 32 rows: the re-reads cost more than the launch
# saved, so no row count takes it by default (``prologue=True`` still runs it).
PROLOGUE_MAX_ROWS = 0


def _gate_up_launch(u, w1, s1, w3, s3, block: int, route=None, stream: str | None = None) -> torch.Tensor:
    """The W1 | W3 partials [S, T, 2I] (``_route_gate_up``); ``route``: (logits, bias, ids, w, k, temp, norm,
    scale), the router's programs (one per token) in the same launch. ``stream``: ``fp8`` (the FP8 MMA stream) or
    a ``step_proj_v41.STEP_SMALL_TUNER`` GEMV name (at most ``gemv_mx.MAX_ROWS`` bf16 rows: ``_route_gate_up_gemv``,
    ``qgemv*`` with the rows quantised once by a ``qdq_bf16`` launch before, ``pgemv*`` by each program first; each
    linear's slice sums the bits of ``gemv_mx.gemv_fp8``); None: ``step_proj_v41.small_choice``'s for (W1, W3)."""
    from redknot.kernels.triton import step_proj_v41 as sp
    T, D = u.shape
    inter = w1.shape[0]
    if stream is None:
        stream = sp.small_choice("gate_up", u, [w1, w3], block,
                                 lambda c: _gate_up_launch(u[:1], w1, s1, w3, s3, block, stream=c),
                                 tuner=sp.STEP_GATE_UP_TUNER) or "fp8"
    if stream != "fp8":
        return sp._with_check(u.device, stream, lambda: _gate_up_gemv(u, w1, s1, w3, s3, block, route, stream),
                              lambda: _gate_up_launch(u, w1, s1, w3, s3, block, route, "fp8"))
    S1, ks1, bm, bn = _slices(inter, D, T)
    p1 = torch.empty(S1, T, 2 * inter, dtype=torch.float32, device=u.device)
    groups = 4 if ks1 % 128 == 0 and D % 128 == 0 else 1
    nb = cdiv(inter, bn)
    rargs, rkw = _route_args(route, p1)
    _route_gate_up[(cdiv(T, bm), 2 * nb + (T if route is not None else 0), S1)](
        u, w1, s1, w3, s3, p1, T, inter, D, ks1, nb, u.stride(0), w1.stride(0), s1.stride(0), p1.stride(0),
        p1.stride(1), *rargs, WB=block, BLOCK_M=bm, BLOCK_N=bn, GROUPS=groups, LIBDEVICE=_LIBDEVICE, **rkw,
        num_warps=4, num_stages=4)
    return p1


def w2_self_check(name: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when :func:`_w2_gemv` with ``name`` computes, at one and three rows of random W1 | W3 partials, the W2
    sums the split-K ``registers`` stream computes on the ``fp8`` path's quantised SwiGLU rows (``_swiglu_quant``'s
    e4m3 + E8M0, dequantised) within ``stream_guard.CHECK_TOL``, else what differs: the first-use check of the
    shared expert's W2 GEMV (``stream_guard.first_use``, key ``("step_w2", name)``)."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import splitk_mx
    from redknot.kernels.triton.stream_guard import CHECK_TOL, _rel
    g = torch.Generator(device=device).manual_seed(seed)
    inter, D, S1, limit = 1024, 96, 3, 10.0
    w2, s2 = mx.quant_fp8_blocks(torch.randn(D, inter, generator=g, device=device) * 0.02, 32)
    s2 = s2.view(torch.uint8)
    worst = 0.0
    for rows in (1, 3):
        p1 = torch.randn(S1, rows, 2 * inter, generator=g, device=device) * 2
        aq = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=device)
        sa = torch.empty(rows, inter // 32, dtype=torch.uint8, device=device)
        _swiglu_quant[(rows, inter // 32 // 16)](p1, aq, sa, inter, S1, p1.stride(0), p1.stride(1), aq.stride(0),
                                                 sa.stride(0), limit, BLOCK_G=16, LIBDEVICE=_LIBDEVICE, num_warps=4)
        act = (aq.float().view(rows, -1, 32) * torch.exp2(sa.float() - 127)[..., None]).view(rows, inter)
        want = splitk_mx.splitk_mm(act.to(torch.bfloat16), w2, s2, rows, w_fp4=False, wb=32,
                                   decode="registers").sum(0)
        if name.startswith(("fpgemv", "fgemv")):  # the finish in W2's launch: the bits of the launches, twice
            w2b, s2b = mx.quant_fp8_blocks(torch.randn(1024, inter, generator=g, device=device) * 0.02, 32)
            routed = torch.randn(rows, 1024, generator=g, device=device).to(torch.bfloat16)
            h = torch.randn(rows, 4, 1024, generator=g, device=device).to(torch.bfloat16)
            mix = (h, torch.rand(rows, 4, generator=g, device=device), torch.rand(rows, 4, 4, generator=g,
                                                                                device=device))
            for m in (None, mix, None):
                got = shared_expert_finish(p1, w2b, s2b, limit, routed, mix=m, stream=name)
                if not torch.equal(got, shared_expert_finish(p1, w2b, s2b, limit, routed, mix=m, stream=name[1:])):
                    return f"shared expert W2 GEMV {name}: the finish in the W2 launch differs from the launches"
        else:
            worst = max(worst, _rel(_w2_gemv(p1, w2, s2, limit, 32, name).sum(0), want))
    return None if worst <= CHECK_TOL else (f"shared expert W2 GEMV {name} differs from decode='registers' by "
                                            f"{worst:.3g} (tolerance {CHECK_TOL:g})")


def shared_expert_finish(p1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float, routed: torch.Tensor,
                         block: int = 32, prologue: bool | None = None, mix=None,
                         stream: str | None = None) -> torch.Tensor:
    """bf16(routed + W2(SwiGLU)) [T, D] from the W1 | W3 partials ``p1`` [S, T, 2I] of :func:`route_and_gate_up`:
    the SwiGLU + quantisation, the W2 stream, the reduction with the combine (``prologue``: the W2 stream
    forms its input; None: up to ``PROLOGUE_MAX_ROWS`` rows). Same bits either way. ``mix`` = (h, post, comb): the
    last launch also runs ``mhc_post(out, h, post, comb)`` per block and returns h' [T, n, D] (the same bits;
    ``post_mix_fits`` must hold). ``stream``: W2's weight stream, ``fp8`` or (at most ``gemv_mx.MAX_ROWS`` bf16
    rows) a ``gemv_mx.PLANS`` dense shape (:func:`_w2_gemv`: one launch more, W2's sums those of
    ``gemv_mx.gemv_fp8``, behind ``stream_guard``'s first-use check of that shape) or that shape with a ``p``
    (the same sums, the SwiGLU formed in the W2 launch: no launch more); None:
    ``step_proj_v41.small_choice``'s with ``STEP_W2_TUNER`` (``fp8`` first)."""
    from redknot.kernels.triton import step_proj_v41 as sp
    from redknot.kernels.triton.stream_fp8 import fp8_stream

    S1, T, two_i = p1.shape
    inter = two_i // 2
    D = w2.shape[0]
    if w2.shape != (D, inter) or routed.shape != (T, D):
        raise ValueError(f"shared_expert_finish: W2 {tuple(w2.shape)} and routed {tuple(routed.shape)} must be "
                         f"[D, {inter}] and [{T}, D]")
    out = torch.empty(T, D, dtype=routed.dtype, device=p1.device)
    if T == 0:
        return out if mix is None else torch.empty_like(mix[0])
    s2 = s2.view(torch.uint8)
    if stream is None:
        def timed(c):  # STEP_W2_TUNER times a choice on the first row
            one = None if mix is None else (mix[0][:1], mix[1][:1], mix[2][:1])
            return shared_expert_finish(p1[:, :1], w2, s2, limit, routed[:1], block, prologue, one, stream=c)
        stream = sp.small_choice("w2", routed, [w2], block, timed, tuner=sp.STEP_W2_TUNER) or "fp8"
    if stream != "fp8":
        def fast():
            if stream.startswith(("fpgemv", "fgemv")):
                return _w2_fused_launch(p1, w2, s2, limit, block, stream, routed, out, mix)
            return _finish(_w2_gemv(p1, w2, s2, limit, block, stream), routed, out, mix)
        if p1.device.type != "cuda":
            return fast()
        from redknot.kernels.triton import stream_guard
        return stream_guard.first_use(("step_w2", stream), stream_guard._CHECKED, stream_guard.DECODE_ERRORS,
                                      lambda: w2_self_check(stream, p1.device), fast,
                                      lambda: shared_expert_finish(p1, w2, s2, limit, routed, block, prologue, mix,
                                                                   stream="fp8"), stream_guard._fail)
    S2, ks2, bm2, bn2 = _slices(D, inter, T)
    p2 = torch.empty(S2, T, D, dtype=torch.float32, device=p1.device)
    if prologue is None:
        prologue = T <= PROLOGUE_MAX_ROWS
    if prologue:
        g2 = 4 if ks2 % 128 == 0 and inter % 128 == 0 else 1
        _w2_swiglu_stream[(cdiv(T, bm2), cdiv(D, bn2), S2)](
            p1, w2, s2, p2, T, D, inter, S1, ks2, p1.stride(0), p1.stride(1), w2.stride(0), s2.stride(0),
            p2.stride(0), p2.stride(1), float(limit), WB=block, BLOCK_M=bm2, BLOCK_N=bn2, GROUPS=g2,
            LIBDEVICE=_LIBDEVICE, num_warps=4, num_stages=4)
    else:
        aq = torch.empty(T, inter, dtype=torch.float8_e4m3fn, device=p1.device)
        sa = torch.empty(T, inter // 32, dtype=torch.uint8, device=p1.device)
        bg = min(16, next_pow2(inter // 32))
        _swiglu_quant[(T, cdiv(inter // 32, bg))](p1, aq, sa, inter, S1, p1.stride(0), p1.stride(1), aq.stride(0),
                                                  sa.stride(0), float(limit), BLOCK_G=bg, LIBDEVICE=_LIBDEVICE,
                                                  num_warps=4)
        fp8_stream(aq, sa, w2, s2, p2, ks2, block, bm2, bn2, num_warps=4)
    return _finish(p2, routed, out, mix)


def route_and_gate_up(logits: torch.Tensor, bias: torch.Tensor, k: int, temp: float, norm: bool, scale: float,
                      u: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                      block: int = 32, stream: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, weights) of :func:`route_topk` and the shared expert's W1 | W3 partials [S, T, 2I] in one launch
    (u bf16 [T, D]; W1, W3 e4m3 [I, D] with E8M0 tiles of ``block``); :func:`shared_expert_finish` ends it.
    ``stream``: the W1 | W3 weight stream (:func:`_gate_up_launch`; None: the step's 1-4-row choice)."""
    T, E = logits.shape
    if logits.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"route_and_gate_up: logits {logits.dtype} and bias {bias.dtype} must be float32")
    if not 0 < k <= E:
        raise ValueError(f"route_and_gate_up: k={k} must be in 1..{E} (the expert count)")
    if u.shape[0] != T:
        raise ValueError(f"route_and_gate_up: u has {u.shape[0]} rows, the logits {T}")
    s1, s3 = s1.view(torch.uint8), s3.view(torch.uint8)
    _check_shared(u, w1, s1, w3, s3, None, block, "route_and_gate_up")
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, w, torch.empty(1, 0, 2 * w1.shape[0], dtype=torch.float32, device=u.device)
    p1 = _gate_up_launch(u, w1, s1, w3, s3, block, (logits, bias.contiguous(), ids, w, k, temp, norm, scale),
                         stream)
    return ids, w, p1


def shared_expert_combine(u: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor, s3: torch.Tensor,
                          w2: torch.Tensor, s2: torch.Tensor, limit: float, routed: torch.Tensor,
                          block: int = 32, prologue: bool | None = None) -> torch.Tensor:
    """bf16(routed + W2(SwiGLU(u))) [T, D]: u bf16 [T, D]; W1, W3 e4m3 [I, D] and W2 e4m3 [D, I] with E8M0
    tiles of ``block``; routed [T, D] 16-bit (the routed experts' sum). Four launches (module docstring), three
    with ``prologue`` (the W2 stream forms its input; None: up to ``PROLOGUE_MAX_ROWS`` rows). Same bits."""
    T, D = u.shape
    s1, s3 = s1.view(torch.uint8), s3.view(torch.uint8)
    _check_shared(u, w1, s1, w3, s3, w2, block, "shared_expert_combine")
    if routed.shape != (T, D):
        raise ValueError(f"shared_expert_combine: routed {tuple(routed.shape)} must be [{T}, {D}]")
    if T == 0:
        return torch.empty(T, D, dtype=routed.dtype, device=u.device)
    u = u if u.stride(-1) == 1 else u.contiguous()
    return shared_expert_finish(_gate_up_launch(u, w1, s1, w3, s3, block), w2, s2, limit, routed, block, prologue)
