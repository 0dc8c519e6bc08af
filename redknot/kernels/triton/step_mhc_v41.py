"""V4.1's lagged hyper-connection sites in three launches instead of a few dozen small ones.

A V4.1 sublayer site (reference §3.3) computes its own (pre, post, C) from the stream it sees, but
collapses the stream with the *previous* site's ``pre`` and normalises the collapse::

    pre, post, C = hc_mixes(h)                      # one (2+n)·n mixing GEMV, sigmoids, 20 Sinkhorn rounds
    u = rms_norm(bf16(Σ_c pre_in[c]·h_c), w)        # the sublayer's input
    h' = bf16(post[j]·y + Σ_i C[i, j]·h_i)          # after the sublayer (y its output)

In PyTorch each Sinkhorn round is two reductions and two divisions, so one site is ~60 launches; at
decode sizes each costs its launch, not its bytes. Here: :func:`site_pre` = the split mixing GEMV of
:mod:`redknot.kernels.triton.mhc` (``_mhc_mix``: partial dots and ``Σ h²`` over slices of the ``n·D``
values) + one program per token that sums the partials, runs the sigmoids and Sinkhorn in registers
(the reference's order: softmax + eps, a column normalisation, then ``iters - 1`` row/column rounds)
and writes the collapse with ``pre_in``, normalised (two passes over the token's streams: sum of
squares of the bf16-rounded collapse, then the scaled output). :func:`site_post` is ``mhc_post``.
Every sum is fp32, as in :mod:`redknot.models.deepseek_v41.mhc`; only summation orders differ.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from redknot.kernels.triton._common import ConfigTuner, cdiv, next_pow2, sm_count
from redknot.kernels.triton.mhc import _mhc_mix, _split3_dot, mhc_post


@triton.jit
def _mix_collapse(s_ptr, fn_ptr, pin_ptr, part_ptr, ssq_ptr, u_ptr, uss_ptr, T, D, stride_st, stride_sn, stride_ut,
                  d_chunk, N: tl.constexpr, NMIX: tl.constexpr, MIXP: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """``_mhc_mix`` (16-bit streams, ``fn`` in three bf16 parts) over a token tile and one slice of D of every
    stream, and in the same pass the lagged collapse Σ_c pre_in[c]·h_c of that slice, rounded to the stream
    dtype and stored, with its partial Σ u² (the norm's): the finish then reads u, not the streams twice."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = toks < T
    t64 = toks.to(tl.int64)
    d_lo = tl.program_id(1) * d_chunk
    d_hi = tl.minimum(d_lo + d_chunk, D)
    K = N * D
    offs_d = tl.arange(0, BLOCK_D)
    offs_m = tl.arange(0, MIXP)
    offs_n = tl.arange(0, N)
    pin = tl.load(pin_ptr + t64[:, None] * N + offs_n[None, :], mask=tmask[:, None], other=0.0)   # [BLOCK_T, N]
    mix = tl.zeros([BLOCK_T, MIXP], tl.float32)
    ssq = tl.zeros([BLOCK_T], tl.float32)
    uss = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        dd = d0 + offs_d
        dm = dd < d_hi
        m2 = tmask[:, None] & dm[None, :]
        u = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        for c in range(N):
            z = tl.load(s_ptr + t64[:, None] * stride_st + c * stride_sn + dd[None, :], mask=m2, other=0.0)
            kk = c * D + dd
            f = tl.load(fn_ptr + offs_m[None, :].to(tl.int64) * K + kk[:, None],
                        mask=(offs_m[None, :] < NMIX) & dm[:, None], other=0.0)   # [BLOCK_D, MIXP] fp32
            zf = z.to(tl.float32)
            ssq += tl.sum(zf * zf, 1)
            mix = _split3_dot(mix, z, f)
            pc = tl.sum(tl.where(offs_n[None, :] == c, pin, 0.0), 1)               # pre_in[:, c]
            u += pc[:, None] * zf
        ub = u.to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + t64[:, None] * stride_ut + dd[None, :], ub, mask=m2)
        uf = ub.to(tl.float32)
        uss += tl.sum(uf * uf, 1)
    row = tl.program_id(1) * T + toks
    tl.store(part_ptr + row[:, None].to(tl.int64) * MIXP + offs_m[None, :], mix, mask=tmask[:, None])
    tl.store(ssq_ptr + row, ssq, mask=tmask)
    tl.store(uss_ptr + row, uss, mask=tmask)


@triton.jit
def _site_finish(s_ptr, part_ptr, ssq_ptr, base_ptr, scale_ptr, pre_in_ptr, norm_ptr, u_ptr, pre_ptr, post_ptr,
                 comb_ptr, T, D, nsplit, stride_st, stride_sn, stride_ut, iters, hc_eps, norm_eps, rms_eps, uss_ptr,
                 N: tl.constexpr, NMIX: tl.constexpr, G_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                 GIVEN: tl.constexpr, NSP2: tl.constexpr = 0, OWN_PRE: tl.constexpr = False):
    """NSP2 (a power of two >= nsplit): the slices' partials loaded at once and added as a tree (one load latency
    instead of nsplit dependent ones; another fp32 order); 0: added one after another in slice order. OWN_PRE (V4's
    site, not lagged): the collapse takes this site's own ``pre``; ``pre_in_ptr`` is not read."""
    MIXP: tl.constexpr = G_P2 * N
    tok = tl.program_id(0)
    t64 = tok.to(tl.int64)
    offs_m = tl.arange(0, MIXP)
    if NSP2:
        spv = tl.arange(0, NSP2)
        spm = spv < nsplit
        rowv = (spv * T + tok).to(tl.int64)
        mix = tl.sum(tl.load(part_ptr + rowv[:, None] * MIXP + offs_m[None, :], mask=spm[:, None], other=0.0), 0)
        ssq = tl.sum(tl.load(ssq_ptr + rowv, mask=spm, other=0.0), 0)
    else:
        mix = tl.zeros([MIXP], tl.float32)
        ssq = 0.0
        for sp in range(nsplit):
            row = (sp * T + tok).to(tl.int64)
            mix += tl.load(part_ptr + row * MIXP + offs_m)
            ssq += tl.load(ssq_ptr + row)
    mix = mix * tl.rsqrt(ssq / (N * D) + norm_eps)
    x = tl.reshape(mix, [G_P2, N])
    g = tl.arange(0, G_P2)[:, None]
    col = tl.arange(0, N)[None, :]
    flat = g * N + col
    base = tl.load(base_ptr + flat, mask=flat < NMIX, other=0.0)
    sc = tl.load(scale_ptr + tl.minimum(g, 2))              # scale[0] pre, [1] post, [2] comb
    x = x * sc + base
    offs_n = tl.arange(0, N)
    pre = tl.sum(tl.where(g == 0, tl.sigmoid(x), 0.0), 0) + hc_eps          # [N]
    post = tl.sum(tl.where(g == 1, 2.0 * tl.sigmoid(x), 0.0), 0)
    is_c = (g >= 2) & (g < 2 + N)                                          # rows 2..: C[i, :], i = g - 2
    e = tl.where(is_c, tl.exp(x - tl.max(tl.where(is_c, x, float("-inf")), 1)[:, None]), 0.0)
    c = tl.where(is_c, e / tl.where(is_c, tl.sum(e, 1)[:, None], 1.0) + hc_eps, 0.0)
    c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        c = tl.where(is_c, c / (tl.sum(c, 1)[:, None] + hc_eps), 0.0)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    tl.store(pre_ptr + t64 * N + offs_n, pre)
    tl.store(post_ptr + t64 * N + offs_n, post)
    tl.store(comb_ptr + t64 * (N * N) + (g - 2) * N + col, c, mask=is_c)
    # The collapse with the previous site's pre, rounded to the stream dtype, then RMS-normalised.
    if GIVEN:   # ``_mix_collapse`` stored the rounded collapse in u and its partial Σ u²: normalise u in place
        if NSP2:
            uss = tl.sum(tl.load(uss_ptr + rowv, mask=spm, other=0.0), 0)
        else:
            uss = 0.0
            for sp in range(nsplit):
                uss += tl.load(uss_ptr + (sp * T + tok).to(tl.int64))
        rg = tl.rsqrt(uss / D + rms_eps)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dm = dd < D
            ug = tl.load(u_ptr + t64 * stride_ut + dd, mask=dm, other=0.0).to(tl.float32)
            wg = tl.load(norm_ptr + dd, mask=dm, other=0.0).to(tl.float32)
            tl.store(u_ptr + t64 * stride_ut + dd, (wg * (ug * rg)).to(u_ptr.dtype.element_ty), mask=dm)
    else:
        if OWN_PRE:
            pin = pre
        else:
            pin = tl.load(pre_in_ptr + t64 * N + offs_n)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dm = dd < D
            xs = tl.load(s_ptr + t64 * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dm[None, :],
                         other=0.0).to(tl.float32)
            u = tl.sum(pin[:, None] * xs, 0).to(u_ptr.dtype.element_ty).to(tl.float32)
            acc += u * u
        r = tl.rsqrt(tl.sum(acc, 0) / D + rms_eps)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            dm = dd < D
            xs = tl.load(s_ptr + t64 * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dm[None, :],
                         other=0.0).to(tl.float32)
            u = tl.sum(pin[:, None] * xs, 0).to(u_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(norm_ptr + dd, mask=dm, other=0.0).to(tl.float32)
            tl.store(u_ptr + t64 * stride_ut + dd, (w * (u * r)).to(u_ptr.dtype.element_ty), mask=dm)


ONE_PASS_MIN_ROWS = 17   # rows from which a 16-bit site collapses in the mixing pass (prefill; the step: ``_mhc_mix``)
# Below ``ONE_PASS_MIN_ROWS`` 16-bit rows (decode) the site's launches by name: (the collapse in the mixing pass
# ``_mix_collapse`` instead of ``_mhc_mix`` and the finish's two passes over the streams, the finish's partial sums
# loaded at once (``_site_finish``'s NSP2), the finish's D block (0: min(1024, D's power of two)), its warps, the
# most slices of the mixing pass). At one row the finish is one program: ``split`` (what ran before) adds ~54
# slices' partials one load after another and reads the 4 x 5120 streams twice in blocks of 1024 (H100 run 3:
# 12.5 us a launch); the other forms are the same arithmetic in other fp32 orders (1-2 warps: the Sinkhorn rounds'
# reductions within fewer warps; ``*_s256``: up to 256 mixing programs of fewer steps each). ``SITE_TUNER`` (key:
# rows, streams, D, dtype) chooses; ``split`` first (taken untimed off the GPU and for a key first met under
# CUDA-graph capture). Not measured on the H200.
SITE_FORMS = {"split": (False, False, 0, 4, 64), "split_v": (False, True, 0, 4, 64),
              "split_v_w8": (False, True, 2048, 8, 64), "split_v_s256": (False, True, 0, 4, 256),
              "one_pass": (True, False, 0, 4, 64), "one_pass_v": (True, True, 0, 4, 64),
              "one_pass_v_w8": (True, True, 2048, 8, 64), "one_pass_v_w2": (True, True, 2048, 2, 64),
              "one_pass_v_w1": (True, True, 2048, 1, 64), "one_pass_v_s256": (True, True, 0, 4, 256)}
SITE_TUNER = ConfigTuner("step_mhc_site_small", list(SITE_FORMS))
# V4's site (``pre_in=None``: the collapse takes the site's own pre, known only after the mixing pass): the forms
# that collapse in the finish, and finishes of 1-2 warps (the Sinkhorn rounds' reductions without a barrier
# between warps; D blocks that fit their registers). Not measured on the H200.
SITE_FORMS.update({"split_v_w2": (False, True, 1024, 2, 64), "split_v_w1": (False, True, 512, 1, 64)})
SITE_OWN_TUNER = ConfigTuner("mhc_site_norm_small", [f for f, form in SITE_FORMS.items() if not form[0]])


def _pick_form(tuner: ConfigTuner, h: torch.Tensor, run) -> str:
    """``tuner``'s form for streams ``h`` (key: rows, streams, D, dtype); ``run(form)`` runs one. A class first met
    under CUDA-graph capture takes the first candidate, so eager and graph steps keep one choice."""
    key = (h.shape[0], h.shape[1], h.shape[2], str(h.dtype).replace("torch.", ""))
    if key not in tuner.choices and h.is_cuda and torch.cuda.is_current_stream_capturing():
        tuner.choices[key] = tuner.candidates[0]
    return tuner.pick(key, run, h.device)


def _site_form(args, kw) -> str:
    """``SITE_TUNER``'s form (``SITE_OWN_TUNER``'s without ``pre_in``) for ``site_pre(*args, **kw)`` at fewer than
    ``ONE_PASS_MIN_ROWS`` rows."""
    tuner = SITE_OWN_TUNER if args[1] is None else SITE_TUNER
    return _pick_form(tuner, args[0], lambda c: site_pre(*args, **kw, form=c))


def site_pre(h: torch.Tensor, pre_in: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor,
             scale: torch.Tensor, norm_w: torch.Tensor, iters: int, hc_eps: float, norm_eps: float,
             one_pass: bool = True, form: str | None = None, rms_eps: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, n, D] (bf16 or fp32), pre_in [T, n] -> (u = rms_norm(collapse(h, pre_in), norm_w) [T, D] in
    h.dtype, pre [T, n], post [T, n], C [T, n, n] fp32). ``pre_in=None`` (V4's site, not lagged): the collapse
    takes the site's own ``pre``, so only the forms that collapse in the finish run (``SITE_OWN_TUNER``).
    ``norm_eps`` is the eps of the mixing RMS factor and, unless ``rms_eps`` is given, of the norm (V4.1 uses one
    ``norm_eps`` for both). ``one_pass`` (16-bit streams, at least
    ``ONE_PASS_MIN_ROWS`` rows): the collapse comes out of the mixing pass (``_mix_collapse``), so the streams
    are read once instead of three times (0.67 GB less per site at 8192 rows of 4 x 5120; not measured on the
    H200); the same arithmetic in another summation order. Fewer rows (16-bit, ``one_pass``): the ``SITE_FORMS``
    form ``form`` (None: ``SITE_TUNER``'s choice)."""
    T, n, D = h.shape
    if n & (n - 1):
        raise ValueError(f"site_pre: hc_mult={n} must be a power of two")
    s = h.contiguous()
    dev = h.device
    u = torch.empty(T, D, dtype=h.dtype, device=dev)
    pre = torch.empty(T, n, dtype=torch.float32, device=dev)
    post = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return u, pre, post, comb
    groups = 2 + n
    g_p2 = max(next_pow2(groups), cdiv(16, n))                  # the mixing dot needs >= 16 columns
    mixp, K = g_p2 * n, n * D
    split_fn = h.dtype in (torch.bfloat16, torch.float16)
    own = pre_in is None
    if one_pass and split_fn and T >= ONE_PASS_MIN_ROWS and not own:
        return _site_pre_one_pass(s, pre_in, fn, base, scale, norm_w, iters, hc_eps, norm_eps, u, pre, post, comb,
                                  g_p2, groups)
    if form is None and one_pass and split_fn and T < ONE_PASS_MIN_ROWS:
        form = _site_form((h, pre_in, fn, base, scale, norm_w, iters, hc_eps, norm_eps),
                          {"one_pass": True, "rms_eps": rms_eps})
    collapse, vec, fin_d, warps, most = SITE_FORMS[form or "split"]
    if collapse and own:
        raise ValueError(f"site_pre: form {form!r} collapses with pre_in in the mixing pass; pre_in=None takes "
                         f"one of {SITE_OWN_TUNER.candidates}")
    if collapse:
        return _site_pre_one_pass(s, pre_in, fn, base, scale, norm_w, iters, hc_eps, norm_eps, u, pre, post, comb,
                                  g_p2, groups, vec, fin_d, warps, most)
    block_t = 16 if T <= 256 or not split_fn else 64
    block_k = 128 if split_fn else 64
    tiles = cdiv(T, block_t)
    k_blocks = cdiv(K, block_k)
    nsplit = max(1, min(cdiv(2 * sm_count(h), tiles), k_blocks, most))   # fill the device at decode sizes
    k_chunk = cdiv(k_blocks, nsplit) * block_k
    nsplit = cdiv(K, k_chunk)
    part = torch.empty(nsplit * T, mixp, dtype=torch.float32, device=dev)
    ssq = torch.empty(nsplit * T, dtype=torch.float32, device=dev)
    _mhc_mix[(tiles, nsplit)](s, fn.float().contiguous(), part, ssq, T, K, s.stride(0), k_chunk, NMIX=groups * n,
                              MIXP=mixp, BLOCK_T=block_t, BLOCK_K=block_k, SPLIT_FN=split_fn, num_warps=4)
    block_d = min(fin_d or 1024, next_pow2(D))
    extra = {"NSP2": next_pow2(nsplit)} if vec else {}
    _site_finish[(T,)](s, part, ssq, base.float().contiguous(), scale.float().contiguous(),
                       pre if own else pre_in.float().contiguous(), norm_w.contiguous(), u, pre, post, comb, T, D,
                       nsplit, s.stride(0), s.stride(1), u.stride(0), iters, hc_eps, norm_eps,
                       norm_eps if rms_eps is None else rms_eps, ssq, N=n, NMIX=groups * n, G_P2=g_p2,
                       BLOCK_D=block_d, GIVEN=False, OWN_PRE=own, num_warps=warps, **extra)
    return u, pre, post, comb


def _d_slices(t: torch.Tensor, D: int, block_d: int, tiles: int, most: int) -> tuple[int, int]:
    """(slices, D values a slice) of a mixing pass over ``tiles`` token tiles that splits D in blocks of ``block_d``
    into at most ``most`` slices, enough to give the device two programs an SM."""
    d_blocks = cdiv(D, block_d)
    nsplit = max(1, min(cdiv(2 * sm_count(t), tiles), d_blocks, most))
    d_chunk = cdiv(d_blocks, nsplit) * block_d
    return cdiv(D, d_chunk), d_chunk


def _site_pre_one_pass(s, pre_in, fn, base, scale, norm_w, iters, hc_eps, norm_eps, u, pre, post, comb, g_p2, groups,
                       vec: bool = False, fin_d: int = 0, warps: int = 4, most: int = 64):
    T, n, D = s.shape
    dev = s.device
    mixp = g_p2 * n
    block_t, block_d = 64, 32   # 128 registers on sm_90a (64 x 64: 227, occupancy halved)
    tiles = cdiv(T, block_t)
    nsplit, d_chunk = _d_slices(s, D, block_d, tiles, most)
    part = torch.empty(nsplit * T, mixp, dtype=torch.float32, device=dev)
    ssq = torch.empty(nsplit * T, dtype=torch.float32, device=dev)
    uss = torch.empty(nsplit * T, dtype=torch.float32, device=dev)
    pin = pre_in.float().contiguous()
    _mix_collapse[(tiles, nsplit)](s, fn.float().contiguous(), pin, part, ssq, u, uss, T, D, s.stride(0), s.stride(1),
                                   u.stride(0), d_chunk, N=n, NMIX=groups * n, MIXP=mixp, BLOCK_T=block_t,
                                   BLOCK_D=block_d, num_warps=4)
    _site_finish[(T,)](s, part, ssq, base.float().contiguous(), scale.float().contiguous(), pin,
                       norm_w.contiguous(), u, pre, post, comb, T, D, nsplit, s.stride(0), s.stride(1), u.stride(0),
                       iters, hc_eps, norm_eps, norm_eps, uss, N=n, NMIX=groups * n, G_P2=g_p2,
                       BLOCK_D=min(fin_d or 1024, next_pow2(D)), GIVEN=True, num_warps=warps,
                       **({"NSP2": next_pow2(nsplit)} if vec else {}))
    return u, pre, post, comb


def site_post(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h'[:, j] = post[:, j]·y + Σ_i C[:, i, j]·h[:, i] (fp32 mix, h.dtype out): -> [T, n, D]."""
    return mhc_post(y, h, post, comb)


@triton.jit
def _post_mix_part(y_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, part_ptr, ssq_ptr, T, D, stride_y, stride_st,
                   stride_sn, stride_ot, stride_on, d_chunk, N: tl.constexpr, NMIX: tl.constexpr, MIXP: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    """One token's post mix over one slice of D of every stream (``_post_mix``'s arithmetic), stored in the stream
    dtype, and in the same pass the next site's partial mixing dots ``z · fnᵀ`` and ``Σ z²`` over the stored
    values of that slice (fp32 FMA), in ``_site_finish``'s partial layout (row ``slice · T + token``)."""
    tok = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    d_lo = sp * d_chunk
    d_hi = tl.minimum(d_lo + d_chunk, D)
    K = N * D
    offs_n = tl.arange(0, N)
    offs_m = tl.arange(0, MIXP)
    cm = tl.load(comb_ptr + tok * N * N + offs_n[:, None] * N + offs_n[None, :])   # [N(j), N(k)]
    p = tl.load(post_ptr + tok * N + offs_n)
    mix = tl.zeros([MIXP], tl.float32)
    ssq = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        dm = dd < d_hi
        y = tl.load(y_ptr + tok * stride_y + dd, mask=dm, other=0.0).to(tl.float32)
        x = tl.load(s_ptr + tok * stride_st + offs_n[:, None] * stride_sn + dd[None, :], mask=dm[None, :],
                    other=0.0).to(tl.float32)                                   # [N(j), BLOCK_D]
        o = p[:, None] * y[None, :] + tl.sum(cm[:, :, None] * x[:, None, :], 0)   # [N(k), BLOCK_D]
        ob = o.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + tok * stride_ot + offs_n[:, None] * stride_on + dd[None, :], ob, mask=dm[None, :])
        z = ob.to(tl.float32)
        ssq += tl.sum(z * z, 0)
        f = tl.load(fn_ptr + offs_m[:, None, None].to(tl.int64) * K + offs_n[None, :, None] * D + dd[None, None, :],
                    mask=(offs_m[:, None, None] < NMIX) & dm[None, None, :], other=0.0)   # [MIXP, N, BLOCK_D]
        mix += tl.sum(tl.sum(f * z[None, :, :], 2), 1)
    row = (sp * T + tok).to(tl.int64)
    tl.store(part_ptr + row * MIXP + offs_m, mix)
    tl.store(ssq_ptr + row, tl.sum(ssq, 0))


# ``post_site_pre``'s forms at 1-4 rows: ``SITE_FORMS``' finish forms (the partial sums loaded at once, the finish's
# D block, its warps, the most slices of the mixing pass). Not measured on a GPU.
POST_SITE_TUNER = ConfigTuner("mhc_post_site_small", list(SITE_OWN_TUNER.candidates))


def post_site_pre(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                  base: torch.Tensor, scale: torch.Tensor, norm_w: torch.Tensor, iters: int, hc_eps: float,
                  norm_eps: float, rms_eps: float | None = None, form: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The post mix of a sublayer's output ``y`` into the streams ``h`` [T, n, D] (16-bit) and the next V4 site's
    input in two launches: ``_post_mix_part`` (the new streams and the next site's partial mixing dots in one pass)
    and ``_site_finish`` (Sinkhorn, the collapse with the site's own pre, the norm). -> (h' [T, n, D], u [T, D],
    pre, post', comb'). ``form``: a ``POST_SITE_TUNER`` candidate (None: its choice)."""
    T, n, D = h.shape
    if n & (n - 1) or h.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"post_site_pre: streams of a power-of-two count in 16 bits, got {n} of {h.dtype}")
    if form is None:
        form = _pick_form(POST_SITE_TUNER, h, lambda c: post_site_pre(y, h, post, comb, fn, base, scale, norm_w,
                                                                      iters, hc_eps, norm_eps, rms_eps, form=c))
    _, vec, fin_d, warps, most = SITE_FORMS[form]
    dev = h.device
    s, yc = h.contiguous(), y.contiguous()
    out = torch.empty_like(s)
    u = torch.empty(T, D, dtype=h.dtype, device=dev)
    pre_new = torch.empty(T, n, dtype=torch.float32, device=dev)
    post_new = torch.empty(T, n, dtype=torch.float32, device=dev)
    comb_new = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    if T == 0:
        return out, u, pre_new, post_new, comb_new
    groups = 2 + n
    g_p2 = max(next_pow2(groups), cdiv(16, n))
    mixp = g_p2 * n
    block_d = 64
    nsplit, d_chunk = _d_slices(h, D, block_d, T, most)
    part = torch.empty(nsplit * T, mixp, dtype=torch.float32, device=dev)
    ssq = torch.empty(nsplit * T, dtype=torch.float32, device=dev)
    _post_mix_part[(T, nsplit)](yc, s, post.float().contiguous(), comb.float().contiguous(), out,
                                fn.float().contiguous(), part, ssq, T, D, yc.stride(0), s.stride(0), s.stride(1),
                                out.stride(0), out.stride(1), d_chunk, N=n, NMIX=groups * n, MIXP=mixp, BLOCK_D=block_d, num_warps=4)
    _site_finish[(T,)](out, part, ssq, base.float().contiguous(), scale.float().contiguous(), pre_new,
                       norm_w.contiguous(), u, pre_new, post_new, comb_new, T, D, nsplit, out.stride(0),
                       out.stride(1), u.stride(0), iters, hc_eps, norm_eps, norm_eps if rms_eps is None else rms_eps,
                       ssq, N=n, NMIX=groups * n, G_P2=g_p2, BLOCK_D=min(fin_d or 1024, next_pow2(D)), GIVEN=False,
                       OWN_PRE=True, num_warps=warps, **({"NSP2": next_pow2(nsplit)} if vec else {}))
    return out, u, pre_new, post_new, comb_new


@triton.jit
def _embed_streams(ids_ptr, table_ptr, out_ptr, D, stride_t, stride_o, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    src = table_ptr + tl.load(ids_ptr + t).to(tl.int64) * stride_t
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        row = tl.load(src + d, mask=d < D)
        for c in tl.static_range(N):
            tl.store(out_ptr + t * stride_o + c * D + d, row, mask=d < D)


def embed_streams(ids: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The streams entering layer 0: [T, n, D], every stream the token's embedding row (``table[ids]``
    repeated; a copy, the same bits) in one launch instead of a gather and a broadcast copy."""
    t, d = ids.shape[0], table.shape[1]
    out = torch.empty(t, n, d, dtype=table.dtype, device=table.device)
    if t and d:
        if table.stride(1) != 1:
            table = table.contiguous()
        block = min(1024, next_pow2(d))
        _embed_streams[(t,)](ids.contiguous(), table, out, d, table.stride(0), out.stride(0), N=n, BLOCK_D=block,
                             num_warps=4 if block >= 512 else 1)
    return out
