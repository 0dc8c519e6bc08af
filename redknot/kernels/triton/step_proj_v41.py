"""Two decode-size FP8 linears that read the same rows, with their row epilogues, in two launches.

A V4.1 attention layer projects its input ``u`` twice (``wq_a`` -> the q latent, ``wkv`` -> the kv latent) and
the normalised q latent once more (``wq_b`` -> the query heads), each through ``linear_mx`` (at decode sizes
with the ``fp8`` decode: activation quantisation, split-K FP8 weight stream, slice reduction: three launches)
followed by a row kernel (``step_rope_v41.rope_rows``: norm, RoPE, FP4 grid). :func:`proj_rows` runs up to two
such linears over the same rows and their row epilogues in two launches:

* one FP8 weight stream over both weights (``stream_fp8._fp8_stream`` with the rows quantised per 32 inside,
  the bits of ``act_quant_mx``): the column blocks of the first weight, then those of the second, each with
  the K slices ``splitk_mx.splitk_mm`` cuts for its own shape with ``decode="fp8"`` (the same partials);
* one program per output row (a token's head): the slice sum in slice order cast to the row dtype (the bits of
  ``splitk_mx.reduce_rows``) into a scratch row, then ``rope_rows``'s own per-row code on that row (same loads,
  shapes and warps: the same bits).

So the outputs are bit for bit ``rope_rows(linear_mx(x, W), ...)`` with the ``fp8`` decode, which the tests
check. Two launches instead of up to eight; not measured on the H200.

At 1-4 rows (decode at batch 1-4) the first launch may instead be a CUDA-core GEMV over both weights
(:func:`gemv_partials`: ``gemv_mx``'s word-wise FP8 decode, the rows quantised per 32 inside with the bits of
``qdq_bf16``, each weight's K slices as ``gemv_mx.slices`` cuts them), writing the same [S, T, N] fp32 partials
that the same epilogue launch sums: still two launches, and the bits of ``gemv_mx.gemv_fp8`` followed by the
row epilogue (the same exact products as the ``fp8`` stream in another summation order). ``STEP_SMALL_TUNER``
chooses per launch (the weights' shapes) between ``fp8`` (first: taken untimed off the GPU, under capture, with
tuning off), ``gemv_mx.PLANS``' dense shapes and the same shapes with the rows quantised once (``qgemv*``: one
``qdq_bf16`` launch before the stream, which then runs ``gemv_fp8``'s own loop instead of quantising in every
program: 984 SASS instead of 1128 for the two-weight kernel at one row on sm_90a; three launches, the same bits),
timed on one row on the first call outside capture, each GEMV behind its first-use check (:func:`self_check`
through ``stream_guard.first_use``); a launch first met under capture keeps ``fp8`` for the process, so eager
and graph steps compute the same bits. :func:`linear_post` (``STEP_POST_TUNER``) also has ``fpgemv*``: ``pgemv*``
with its epilogue in the stream launch (``_gemv_post``: the last program of each column block, found by an
acquire-release counter, sums the block's slices in slice order and mixes it; one launch, the same bits).
Both tuners also hold the ``*_wave`` names (``WAVE_NAMES``): the same shapes with both weights on one flat
program index (no program that exits at once) and K slices cut against the programs resident on an SM (the wave
shape and program length of each launch; a function of the weight shapes only, so a token's bits do not depend
on the call's rows; the bits of the shape where the slice counts agree). ``tuning_cache.small_rows_class()``
False or ``gemm_mx.SMALL_ROWS_CLASS`` False: ``fp8`` always (the bits of
the tensor-core stream at every row count). Not measured on the H200.

The kernels and their host helpers live by launch in ``step_proj_stream_v41`` (the weight streams) and
``step_proj_epilogue_v41`` (the row and post epilogues, and the GEMV with the post epilogue inside); this module
keeps the entry points, the stream choice (``small_choice``) with its first-use checks, and re-exports those
modules' names.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from redknot.kernels.triton._common import ConfigTuner, interpreting, next_pow2
from redknot.kernels.triton.step_proj_epilogue_v41 import (  # noqa: F401
    _COUNTERS,
    _counters,
    _epilogue2,
    _epilogue_post,
    _gemv_post,
    _post_block,
    _post_fused,
    _reduce_row,
    _row_epilogue,
)
from redknot.kernels.triton.step_proj_stream_v41 import (  # noqa: F401
    _fma_rows,
    _fp8_tile,
    _gemv2,
    _gemv2f,
    _gemv_tile,
    _qdq_slice,
    _qdq_words,
    _row_fma_qdq,
    _stream2,
    _stream_partials,
    gemv_partials,
    grid_form,
    plan_name,
    quantise_mode,
    slices,
    wave_slices,
)

# Rows up to which the step runs these kernels (decode and speculative verify), as the MoE's step kernels.
MAX_ROWS = 16
# The first launch's weight stream at up to ``gemv_mx.MAX_ROWS`` rows, per launch (key: the weights' shapes):
# the ``fp8`` tensor-core stream (first), a ``gemv_mx.PLANS`` dense GEMV shape with the rows quantised inside every
# program, or the same shape with a ``q`` in front: the rows quantised once (``qdq_bf16``, one small launch before
# the stream) and read as ``gemv_mx._gemv_fp8`` reads them, or with a ``p``: each program quantises its K slice of
# the rows first (no launch more), then ``_gemv_fp8``'s loop (module docstring).
# Last, the same shapes on the flat grid with K slices cut against the resident programs (``*_wave``:
# ``step_proj_stream_v41._gemv2f`` / ``wave_slices``; new, not measured on the H200: the tuner keeps them only where
# the device times them faster). ``_route_gate_up_gemv`` (the ``gate_up`` launch) runs a ``*_wave`` name as its shape
# on its own grid.
GEMV_NAMES = ("gemv", "gemv_n16", "gemv_k128")
WAVE_NAMES = tuple(p + n + "_wave" for p in ("", "q", "p") for n in GEMV_NAMES)
STEP_SMALL_TUNER = ConfigTuner("step_proj_small", ["fp8", *GEMV_NAMES, *("q" + n for n in GEMV_NAMES),
                                                   *("p" + n for n in GEMV_NAMES), *WAVE_NAMES])
# The shared expert's W1 | W3 launch with the router (``step_moe_v41.route_and_gate_up``, kind ``gate_up``):
# ``STEP_SMALL_TUNER``'s names less the ``*_wave`` ones, which that launch would run as their base shapes on its own
# grid (the same launch timed twice).
STEP_GATE_UP_TUNER = ConfigTuner("step_gate_up_small", [c for c in STEP_SMALL_TUNER.candidates if c not in WAVE_NAMES])
# The shared expert's W2 stream at up to ``gemv_mx.MAX_ROWS`` rows (``step_moe_v41.shared_expert_finish``; key:
# W2's shape): ``fp8`` (first), a ``gemv_mx.PLANS`` dense shape on the quantised SwiGLU rows (a launch before),
# that shape with a ``p``: the W2 launch forms its input itself, or with ``fp``: and runs the finish too (the last
# program of each column block; one launch for W2 and its combine), or with ``f``: ``_swiglu_quant`` then W2 with
# the combine (two launches, no re-read of the W1 | W3 partials per column block).
# ``linear_post``'s launch (wo_b + the mHC post mix): ``STEP_SMALL_TUNER``'s candidates and the ``pgemv*`` shapes
# with the epilogue in the stream launch (``fpgemv*``: the last program of each column block sums its slices and
# mixes the block; one launch instead of two).
STEP_POST_TUNER = ConfigTuner("step_post_small", [*STEP_SMALL_TUNER.candidates, *("fp" + n for n in GEMV_NAMES)])
STEP_W2_TUNER = ConfigTuner("step_w2_small", ["fp8", *GEMV_NAMES, *("p" + n for n in GEMV_NAMES),
                                             *("fp" + n for n in GEMV_NAMES), *("f" + n for n in GEMV_NAMES)])
# A ``STEP_SMALL_TUNER`` candidate every launch takes instead of the tuner's choice (tests and the launch count of
# ``benchmarks/step_kernels_v41.py``); None: the tuner's. The small-row class off still gives ``fp8``.
FORCE_SMALL = None


def self_check(name: str, device: torch.device, seed: int = 1234) -> str | None:
    """None when :func:`gemv_partials` with the GEMV shape ``name`` computes, for two weights at one and three
    rows, the fp32 sums the split-K ``registers`` stream computes (within ``stream_guard.CHECK_TOL``), else what
    differs: the first-use check of the step's GEMV launch (``stream_guard.first_use``)."""
    from redknot.kernels import mx_formats as mx
    from redknot.kernels.triton import splitk_mx
    from redknot.kernels.triton.dequant_mx import qdq_bf16
    from redknot.kernels.triton.stream_guard import CHECK_TOL, _rel
    g = torch.Generator(device=device).manual_seed(seed)
    K, block = 1024, 32
    weights = [mx.quant_fp8_blocks(torch.randn(n, K, generator=g, device=device) * 0.02, block) for n in (96, 64)]
    worst = 0.0
    for rows in (1, 3):
        x = torch.randn(rows, K, generator=g, device=device).to(torch.bfloat16)
        for p, (w, ws) in zip(gemv_partials(x, weights, block, name), weights):
            want = splitk_mx.splitk_mm(qdq_bf16(x), w, ws, rows, w_fp4=False, wb=block, decode="registers").sum(0)
            worst = max(worst, _rel(p.sum(0), want))
        if name.startswith("fpgemv"):  # the epilogue in the stream launch: the two launches' bits
            w, ws = mx.quant_fp8_blocks(torch.randn(1024, K, generator=g, device=device) * 0.02, block)
            h = torch.randn(rows, 4, 1024, generator=g, device=device).to(torch.bfloat16)
            post = torch.rand(rows, 4, generator=g, device=device)
            comb = torch.rand(rows, 4, 4, generator=g, device=device)
            for _ in range(2):  # twice: the block counters are zero again after a launch
                got = linear_post(x, w, ws, h, post, comb, block, stream=name)
                if not torch.equal(got, linear_post(x, w, ws, h, post, comb, block, stream=name[1:])):
                    return f"step GEMV {name}: the epilogue in the stream launch differs from the two launches"
    return None if worst <= CHECK_TOL else (f"step GEMV {name} differs from decode='registers' by {worst:.3g} "
                                            f"(tolerance {CHECK_TOL:g})")


def small_choice(kind: str, x: torch.Tensor, weights: Sequence[torch.Tensor], block: int,
                 run, tuner: ConfigTuner | None = None) -> str | None:
    """The GEMV shape (a ``gemv_mx.PLANS`` name) the step's launch ``kind`` streams these weights with at this
    call's rows, or None (the ``fp8`` stream): None above ``gemv_mx.MAX_ROWS`` rows, for 16-bit rows other than
    bf16, with the small-row class off (``tuning_cache.small_rows_class()`` / ``gemm_mx.SMALL_ROWS_CLASS``), and
    where ``STEP_SMALL_TUNER`` (key: the launch's weight shapes; ``run(choice)`` times one) keeps ``fp8``. A key
    first met under CUDA-graph capture keeps ``fp8`` for the process (eager and graph steps: one choice).
    ``tuner``: another tuner of the same pattern (``STEP_W2_TUNER``)."""
    from redknot.kernels import tuning_cache
    from redknot.kernels.triton import gemm_mx, gemv_mx
    if (x.shape[0] > gemv_mx.MAX_ROWS or x.dtype != torch.bfloat16 or not gemm_mx.SMALL_ROWS_CLASS
            or not tuning_cache.small_rows_class()):
        return None
    tuner = STEP_SMALL_TUNER if tuner is None else tuner
    if FORCE_SMALL is not None:  # where not a candidate: fpgemv* -> pgemv*, qgemv* -> gemv* (W2), else the shape
        forced = next((n for n in (FORCE_SMALL, FORCE_SMALL[1:]) if n in tuner.candidates), plan_name(FORCE_SMALL))
        return None if forced == "fp8" else forced
    key = (kind, tuple(tuple(w.shape) for w in weights), block)
    if key not in tuner.choices and x.is_cuda and torch.cuda.is_current_stream_capturing():
        tuner.choices[key] = tuner.candidates[0]
    got = tuner.pick(key, run, x.device)
    return None if got == "fp8" else got


def _with_check(device: torch.device, name: str, fast, fallback):
    """``fast()`` behind the first-use check of the step's GEMV ``name`` on a CUDA device (``fallback()``, the
    ``fp8`` stream, where it fails); off the GPU ``fast()`` (errors propagate to the tests)."""
    if device.type != "cuda":
        return fast()
    from redknot.kernels.triton import stream_guard
    key = ("step_proj", name)
    return stream_guard.first_use(key, stream_guard._CHECKED, stream_guard.DECODE_ERRORS,
                                  lambda: self_check(name, device), fast, fallback, stream_guard._fail)


def linear_post(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, block: int = 32, stream: str | None = None) -> torch.Tensor:
    """``mhc_post(linear_mx(x, weight, scale), h, post, comb)`` with the ``fp8`` decode in two launches, the same
    bits: the FP8 stream, then one program per (token, column block of ``mhc_post``'s width) that sums the slices
    and mixes the block into the n streams. x [T, K] 16-bit, weight e4m3 [D, K], h [T, n, D] (n a power of two),
    post [T, n] / comb [T, n, n] fp32 -> h' [T, n, D] in h's dtype. ``stream``: the weight stream, ``fp8`` or a
    ``gemv_mx.PLANS`` dense shape (:func:`proj_rows`); None: :func:`small_choice`'s."""
    T, K = x.shape
    D = weight.shape[0]
    n = h.shape[1]
    bd = min(512, next_pow2(D))
    if (h.shape != (T, n, D) or D % bd or bd % 2 or n & (n - 1) or weight.dtype != torch.float8_e4m3fn
            or weight.shape[1] != K or K % 32 or block % 32 or x.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"linear_post: x {tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, h "
                         f"{tuple(h.shape)}: need h [T, n, D] (n a power of two), D a multiple of min(512, D's "
                         "power of two), K and block multiples of 32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    s = h.contiguous()
    out = torch.empty_like(s)
    if T == 0:
        return out
    scale = scale.view(torch.uint8)
    if stream is None:
        stream = small_choice("post", x, [weight], block, lambda c: linear_post(
            x[:1], weight, scale, h[:1], post[:1], comb[:1], block, stream=c), tuner=STEP_POST_TUNER) or "fp8"

    def launches(dec: str) -> torch.Tensor:
        if dec.startswith("fpgemv"):
            return _post_fused(x, weight, scale, s, post, comb, out, block, bd, dec)
        if dec == "fp8":
            part = _stream_partials(x, [(weight, scale)], block)[0]
        else:
            part = gemv_partials(x, [(weight, scale)], block, dec)[0]
        y = torch.empty(T, D, dtype=x.dtype, device=x.device)
        _epilogue_post[(T * (D // bd),)](part, y, part.shape[0], part.stride(0), part.stride(1), D // bd, s,
                                         post.float().contiguous(), comb.float().contiguous(), out, s.stride(0),
                                         s.stride(1), out.stride(0), out.stride(1), D=bd, N=n, num_warps=4)
        return out
    if stream != "fp8":
        return _with_check(x.device, stream, lambda: launches(stream), lambda: launches("fp8"))
    return launches("fp8")


def epilogue_warps(specs: Sequence[Proj]) -> int | None:
    """The warps of the epilogue launch: those ``rope_rows`` runs each row kind with (1 up to 128 columns, else
    4). A normalised row's sum of squares depends on them, so its kind decides; None: two normalised kinds
    that ``rope_rows`` would run with different warps (one launch cannot give both their bits)."""
    def warps(d):
        return 1 if d <= 128 else 4
    normed = {warps(s.dim) for s in specs if s.norm_w is not None}
    if len(normed) > 1:
        return None
    return normed.pop() if normed else max(warps(s.dim) for s in specs)


class Proj:
    """One linear of :func:`proj_rows` and its row epilogue: ``weight`` e4m3 [H·dim, K] with E8M0 ``scale``
    tiles, output rows [T, H, dim]; ``norm_w``: RMS norm first (``eps``); ``rope``: rotate the last ``2·half``
    dims by the call's cos/sin; ``qdq``: the FP4 grid after (``rope_rows``'s options)."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, dim: int, norm_w: torch.Tensor | None = None,
                 eps: float = 0.0, rope: bool = False, qdq: bool = False):
        self.weight, self.scale, self.dim = weight, scale.view(torch.uint8), dim
        self.norm_w, self.eps, self.rope, self.qdq = norm_w, eps, rope, qdq
        self.heads = weight.shape[0] // dim


def check(x: torch.Tensor, specs: Sequence[Proj], half: int, block: int) -> None:
    if not 1 <= len(specs) <= 2:
        raise ValueError(f"proj_rows: {len(specs)} linears (1 or 2)")
    K = x.shape[-1]
    for s in specs:
        N = s.weight.shape[0]
        if s.weight.dtype != torch.float8_e4m3fn or s.weight.shape[1] != K or N % s.dim:
            raise ValueError(f"proj_rows: weight {tuple(s.weight.shape)} {s.weight.dtype} must be e4m3 [H·{s.dim}, "
                             f"{K}]")
        if s.dim % 2 or (s.rope and 2 * half > s.dim) or (s.qdq and (s.dim & (s.dim - 1) or s.dim < 32)):
            raise ValueError(f"proj_rows: row width {s.dim} must be even and >= 2*half ({2 * half}), a power of "
                             "two >= 32 with qdq")
    if K % 32 or block % 32 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"proj_rows: K={K} and block={block} must be multiples of 32, x 16-bit ({x.dtype})")
    if epilogue_warps(specs) is None:
        raise ValueError("proj_rows: two normalised row widths that rope_rows runs with different warps")


def proj_rows(x: torch.Tensor, specs: Sequence[Proj], cos: torch.Tensor, sin: torch.Tensor,
              block: int = 32, pack: torch.Tensor | None = None,
              stream: str | None = None) -> list[torch.Tensor]:
    """[rope_rows(linear_mx(x, s.weight, s.scale).view(T, H, dim), cos, sin, norm_w, eps, qdq) for s in specs]
    with ``linear_mx``'s ``fp8`` decode, bit for bit, in two launches (module docstring): x [T, K] 16-bit,
    cos/sin [T, half] (``rope_table``; rows without ``rope`` ignore them). ``pack`` uint8 [T·H, dim + dim/32]: the
    second linear's output rows also as window-cache bytes there (``cache_insert_mx(pack, arange, rows,
    "window")``'s bytes; needs two linears, the second's width a multiple of 32). ``stream``: the first launch's
    weight stream, ``fp8`` or a ``gemv_mx.PLANS`` dense shape (at most ``gemv_mx.MAX_ROWS`` bf16 rows: the bits
    of ``gemv_mx.gemv_fp8`` then the same epilogue); None: :func:`small_choice`'s."""
    half = cos.shape[-1]
    check(x, specs, half, block)
    if pack is not None:
        s = specs[-1]
        if (len(specs) != 2 or s.dim % 32 or s.qdq or pack.dtype != torch.uint8
                or pack.shape != (x.shape[0] * s.heads, s.dim + s.dim // 32) or pack.stride(0) != pack.shape[1]):
            raise ValueError(f"proj_rows: pack {tuple(pack.shape)} {pack.dtype} must be contiguous uint8 "
                             f"[T·H, dim + dim/32] of a second linear (width a multiple of 32, no qdq)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    T = x.shape[0]
    dev = x.device
    outs = [torch.empty(T, s.heads, s.dim, dtype=x.dtype, device=dev) for s in specs]
    if T == 0:
        return outs
    if stream is None:
        def timed(c):  # STEP_SMALL_TUNER times a choice on the first row
            one = None if pack is None else torch.empty(specs[-1].heads, pack.shape[1], dtype=pack.dtype, device=dev)
            return proj_rows(x[:1], specs, cos[:1], sin[:1], block, pack=one, stream=c)
        stream = small_choice("proj", x, [s.weight for s in specs], block, timed) or "fp8"
    if stream != "fp8":
        return _with_check(dev, stream, lambda: _proj_launches(x, specs, cos, sin, block, pack, outs, stream),
                           lambda: _proj_launches(x, specs, cos, sin, block, pack, outs, "fp8"))
    return _proj_launches(x, specs, cos, sin, block, pack, outs, "fp8")


def _proj_launches(x, specs, cos, sin, block, pack, outs, stream: str):
    """:func:`proj_rows`' two launches: the weight stream (``fp8`` or a GEMV shape) and the epilogue."""
    T = x.shape[0]
    dev = x.device
    half = cos.shape[-1]
    weights = [(s.weight, s.scale) for s in specs]
    parts = _stream_partials(x, weights, block) if stream == "fp8" else gemv_partials(x, weights, block, stream)
    raws = [torch.empty(T * s.heads, s.dim, dtype=x.dtype, device=dev) for s in specs]
    two = list(zip(specs, parts, raws, outs))
    if len(two) == 1:
        two.append(two[0])
    (s0, p0, r0, o0), (s1, p1, r1, o1) = two
    n1 = len(specs) > 1
    cos, sin = cos.contiguous(), sin.contiguous()
    n0 = T * s0.heads
    n_all = n0 + (T * s1.heads if n1 else 0)

    def kind(s):
        w = s.norm_w if s.norm_w is not None else cos      # unread without NORM
        return (w, s.eps)

    (w0, e0), (w1, e1) = kind(s0), kind(s1)
    _epilogue2[(n_all,)](
        cos, sin, half, n0,
        p0, r0, o0, w0, p0.shape[0], p0.stride(0), p0.stride(1), e0, s0.heads,
        p1, r1, o1, w1, p1.shape[0], p1.stride(0), p1.stride(1), e1, s1.heads, pack if pack is not None else r1,
        D0=s0.dim, D2P0=next_pow2(s0.dim // 2), HALF0=half if s0.rope else 0, NORM0=s0.norm_w is not None,
        QDQ0=s0.qdq, D1=s1.dim, D2P1=next_pow2(s1.dim // 2), HALF1=half if s1.rope else 0,
        NORM1=s1.norm_w is not None, QDQ1=s1.qdq, PACK1=pack is not None, ASM=not interpreting() and x.is_cuda,
        num_warps=epilogue_warps(specs))
    return outs
