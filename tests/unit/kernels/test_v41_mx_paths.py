"""The size-chosen paths of ``linear_mx`` and ``moe_mx`` (split-K weight streams; exact bf16 decoding +
library GEMMs) against ``ref_v41`` at small sizes with fresh random inputs, and their exact decoders
against ``mx_formats`` bit for bit. Runs on the GPU when there is one, else under Triton's interpreter."""
import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from redknot.kernels import mx_formats as mx  # noqa: E402
from redknot.kernels import ref_v41  # noqa: E402
from redknot.kernels.triton import dequant_mx, gemm_mx, moe_mx, splitk_mx  # noqa: E402
from redknot.kernels.triton.checks_mx import TOY_V41, V41Dims, moe_inputs  # noqa: E402
from slow_grid import rotated_grid  # noqa: E402

ODD = V41Dims(hidden=96, experts=7, topk_experts=3, moe_inter=96, tokens=9)


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def test_qdq_bf16_equals_the_reference_quantise_dequantise(kernel_device):
    g = torch.Generator(device=kernel_device).manual_seed(1)
    x = (torch.randn(19, 256, generator=g, device=kernel_device)
         * torch.logspace(-5, 4, 256, device=kernel_device)).to(torch.bfloat16)
    x[3] = 0  # an all-zero row: the scale floor
    want = mx.act_quant_ref(x.float(), "fp8").to(torch.bfloat16)
    assert torch.equal(dequant_mx.qdq_bf16(x), want)
    halves = dequant_mx.qdq_bf16(x, split=True)
    assert torch.equal(halves[0], want[:, 0::2]) and torch.equal(halves[1], want[:, 1::2])


@pytest.mark.parametrize("block", [32, 128])
def test_fp8_weight_decodes_exactly(block, kernel_device):
    g = torch.Generator(device=kernel_device).manual_seed(block)
    w, ws = mx.quant_fp8_blocks(torch.randn(200, 320, generator=g, device=kernel_device)
                                * torch.logspace(-3, 1, 200, device=kernel_device)[:, None], block)
    want = mx.dequant_fp8_blocks(w, ws, block)
    assert torch.equal(dequant_mx.dequant_fp8_bf16(w, ws, block).float(), want)
    assert torch.equal(dequant_mx.dequant_fp8_bf16(w, ws, block, 40, 170).float(), want[40:170])


def test_mxfp4_experts_decode_exactly(kernel_device):
    _, _, _, (w1, s1, *_rest) = moe_inputs(ODD, kernel_device, seed=3)
    e, n, kh = w1.shape
    out = torch.zeros(3, 2 * n, 2 * kh, dtype=torch.bfloat16, device=kernel_device)
    dequant_mx.dequant_fp4_bf16(w1, s1, 2, 5, out[:, n:])  # experts 2..4 into the second half of the rows
    for j in range(3):
        assert torch.equal(out[j, n:].float(), mx.dequant_mxfp4(w1[2 + j], s1[2 + j]))
        assert not out[j, :n].any()


def test_chunk_rows_move_only_the_chunk(kernel_device):
    offs = torch.tensor([2, 2, 5, 9], dtype=torch.int32, device=kernel_device)  # expert 1 is empty
    bounds = torch.cat([offs.new_zeros(1), offs])
    src = torch.arange(40, dtype=torch.float32, device=kernel_device).view(10, 4)
    rowid = torch.tensor([9, 8, 7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.int32, device=kernel_device)
    dst = torch.full((9, 4), -1.0, device=kernel_device)
    dequant_mx.chunk_rows(src, dst, bounds, 1, 3, gather=True, rowid=rowid)  # experts 1, 2: sorted rows 2..4
    assert torch.equal(dst[:3], src[[7, 6, 5]]) and bool((dst[3:] == -1).all())
    back = torch.full((9, 4), -1.0, device=kernel_device)
    dequant_mx.chunk_rows(dst, back, bounds, 1, 3, gather=False)
    assert torch.equal(back[2:5], src[[7, 6, 5]]) and bool((back[:2] == -1).all()) and bool((back[5:] == -1).all())


def test_tile_map_covers_every_row_once(kernel_device):
    counts = [0, 3, 0, 17, 1, 19, 0, 0, 37]
    offs = torch.tensor(counts, device=kernel_device).cumsum(0).to(torch.int32)
    for bm in (4, 16):
        group, row0, end, bound = splitk_mx.tile_map(offs, bm, int(offs[-1]))
        seen = []
        for g, r0, e in zip(group.tolist(), row0.tolist(), end.tolist(), strict=True):
            if g < 0:
                continue
            assert e == int(offs[g]) and int(offs[g]) - counts[g] <= r0 < e
            seen += list(range(r0, min(r0 + bm, e)))
        assert sorted(seen) == list(range(int(offs[-1])))
        assert int((group >= 0).sum()) == sum(-(-c // bm) for c in counts) <= bound


@pytest.mark.parametrize("rows,path,block", rotated_grid([(r, p) for p in ["splitk", "dequant"] for r in [1, 7, 37]],
                                                        [(32,), (128,)]))
def test_linear_paths_match_reference(path, block, rows, kernel_device):
    g = torch.Generator(device=kernel_device).manual_seed(rows * block)
    w, ws = mx.quant_fp8_blocks(torch.randn(160, 512, generator=g, device=kernel_device) * 0.02, block)
    x = torch.randn(rows, 512, generator=g, device=kernel_device).to(torch.bfloat16)
    out = gemm_mx.linear_mx(x, w, ws, block, path=path)
    assert out.shape == (rows, 160) and out.dtype == torch.bfloat16
    assert _rel(out, ref_v41.linear_mx(x, w, ws, block)) <= 1e-2


@pytest.mark.parametrize("block_m,swap", [(16, True), (32, False), (32, True)])
def test_splitk_launch_shapes_match_reference(block_m, swap, kernel_device):
    """Row tiles and the swapped MMA (weights as the first operand) compute the same linear."""
    g = torch.Generator(device=kernel_device).manual_seed(block_m)
    w, ws = mx.quant_fp8_blocks(torch.randn(96, 256, generator=g, device=kernel_device) * 0.02, 32)
    x = torch.randn(21, 256, generator=g, device=kernel_device).to(torch.bfloat16)
    p = splitk_mx.splitk_mm(dequant_mx.qdq_bf16(x), w, ws, 21, w_fp4=False, block_m=block_m, swap=swap)
    out = splitk_mx.reduce_rows(p, torch.empty(21, 96, dtype=torch.bfloat16, device=kernel_device))
    assert _rel(out, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2


def test_linear_dequant_path_in_weight_chunks(kernel_device, monkeypatch):
    monkeypatch.setattr(gemm_mx, "DEQUANT_MAX_ELEMS", 64 * 256)  # 64 rows per chunk of a [200, 256] weight
    g = torch.Generator(device=kernel_device).manual_seed(9)
    w, ws = mx.quant_fp8_blocks(torch.randn(200, 256, generator=g, device=kernel_device) * 0.02, 32)
    x = torch.randn(3, 5, 256, generator=g, device=kernel_device).to(torch.bfloat16)
    out = gemm_mx.linear_mx(x, w, ws, 32, path="dequant")
    assert out.shape == (3, 5, 200)
    assert _rel(out, ref_v41.linear_mx(x, w, ws, 32)) <= 1e-2


def test_linear_splitk_rows_are_batch_invariant(kernel_device):
    g = torch.Generator(device=kernel_device).manual_seed(5)
    w, ws = mx.quant_fp8_blocks(torch.randn(96, 1024, generator=g, device=kernel_device) * 0.02, 32)
    x = torch.randn(40, 1024, generator=g, device=kernel_device).to(torch.bfloat16)
    full = gemm_mx.linear_mx(x, w, ws, 32, path="splitk")
    assert torch.equal(gemm_mx.linear_mx(x[17:18], w, ws, 32, path="splitk"), full[17:18])


def test_paths_by_size_and_bad_path():
    assert gemm_mx.linear_path(1) == "splitk" and gemm_mx.linear_path(gemm_mx.SPLITK_MAX_ROWS + 1) == "dequant"
    assert gemm_mx.moe_path(1) == "splitk" and gemm_mx.moe_path(moe_mx.GROUPED_MIN_TOKENS + 1) == "prefill"
    with pytest.raises(ValueError, match="path='fast'"):
        gemm_mx.linear_path(4, "fast")
    with pytest.raises(ValueError, match="path='fast'"):
        gemm_mx.moe_path(4, "fast")


MOE_PATHS = [("splitk", 0), ("grouped", 2), ("grouped", 3), ("tiled", 0)]


@pytest.mark.parametrize("tokens,path,chunk,dims", rotated_grid([(t, p, c) for p, c in MOE_PATHS for t in [1, 11]],
                                                                [(TOY_V41,), (ODD,)], second_ids=["toy", "odd"]))
def test_moe_paths_match_reference(dims, path, chunk, tokens, kernel_device, monkeypatch):
    monkeypatch.setattr(moe_mx, "CHUNK_EXPERTS", chunk or moe_mx.CHUNK_EXPERTS)
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=tokens + chunk, tokens=tokens)
    out = gemm_mx.moe_mx(x, idx, wt, *w, 10.0, path=path)
    want = ref_v41.moe_mx(x, idx, wt, *w, 10.0)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert _rel(out, want) <= 3e-2


def test_moe_splitk_token_is_batch_invariant(kernel_device):
    x, idx, wt, w = moe_inputs(ODD, kernel_device, seed=8, tokens=9)
    full = gemm_mx.moe_mx(x, idx, wt, *w, 10.0, path="splitk")
    alone = gemm_mx.moe_mx(x[4:5], idx[4:5], wt[4:5], *w, 10.0, path="splitk")
    assert torch.equal(alone, full[4:5])


def test_moe_paths_detect_a_wrong_weight(kernel_device):
    """The tolerance separates right from wrong: swapped nibbles (element order) fail it."""
    x, idx, wt, (w1, s1, w3, s3, w2, s2) = moe_inputs(TOY_V41, kernel_device, seed=2)
    want = ref_v41.moe_mx(x, idx, wt, w1, s1, w3, s3, w2, s2, 10.0)
    swapped = ((w2 >> 4) | (w2 << 4)).to(torch.uint8)
    for path in ("splitk", "grouped", "tiled", "prefill"):
        assert _rel(gemm_mx.moe_mx(x, idx, wt, w1, s1, w3, s3, swapped, s2, 10.0, path=path), want) > 0.1


def test_stored_dtypes_are_read_as_bytes(kernel_device):
    """Scales as ``float8_e8m0fnu`` and packed FP4 as int8 (how checkpoints may type them) give the same result."""
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=12, tokens=5)
    typed = [t.view(torch.int8) if i % 2 == 0 else t.view(torch.float8_e8m0fnu) for i, t in enumerate(w)]
    for path in ("splitk", "grouped"):
        assert torch.equal(gemm_mx.moe_mx(x, idx, wt, *typed, 10.0, path=path),
                           gemm_mx.moe_mx(x, idx, wt, *w, 10.0, path=path))
    wf, ws = mx.quant_fp8_blocks(torch.randn(64, 128, device=kernel_device) * 0.02, 32)
    xl = torch.randn(3, 128, device=kernel_device).to(torch.bfloat16)
    for path in ("splitk", "dequant"):
        assert torch.equal(gemm_mx.linear_mx(xl, wf, ws.view(torch.float8_e8m0fnu), 32, path=path),
                           gemm_mx.linear_mx(xl, wf, ws, 32, path=path))


@pytest.mark.parametrize("tokens,k,experts", [(1, 6, 384), (37, 6, 384), (9, 3, 7)])
def test_routing_kernel_equals_the_stable_sort(tokens, k, experts, kernel_device, monkeypatch):
    g = torch.Generator(device=kernel_device).manual_seed(tokens)
    idx = torch.randint(0, experts, (tokens, k), generator=g, device=kernel_device)  # repeats allowed
    w = torch.rand(tokens, k, generator=g, device=kernel_device)
    got = moe_mx._sorted_pairs(idx, w, experts)
    monkeypatch.setattr(moe_mx, "ROUTE_KERNEL_MAX_PAIRS", 0)
    flat = idx.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=experts)
    rows, inv, offs, wt = got
    assert torch.equal(rows.long(), order // k) and torch.equal(wt, w.reshape(-1)[order])
    assert torch.equal(inv.long()[order], torch.arange(flat.numel(), device=kernel_device))
    assert torch.equal(offs.long(), counts.cumsum(0))
    assert all(torch.equal(a, b) for a, b in zip(moe_mx._sorted_pairs(idx, w, experts), got, strict=True))


def test_in_kernel_quantisation_equals_the_separate_pass(kernel_device, monkeypatch):
    """Decode sizes quantise activations inside the split-K kernel; the bits equal the separate QDQ pass."""
    g = torch.Generator(device=kernel_device).manual_seed(21)
    w, ws = mx.quant_fp8_blocks(torch.randn(64, 256, generator=g, device=kernel_device) * 0.02, 32)
    x = (torch.randn(5, 256, generator=g, device=kernel_device) * 30).to(torch.bfloat16)
    xm, idx, wt, wm = moe_inputs(ODD, kernel_device, seed=21, tokens=4)
    fused = gemm_mx.linear_mx(x, w, ws, 32, path="splitk"), gemm_mx.moe_mx(xm, idx, wt, *wm, 10.0, path="splitk")
    monkeypatch.setattr(splitk_mx, "RAW_MAX_ROWS", 0)
    monkeypatch.setattr(moe_mx, "RAW_MAX_ROWS", 0)
    assert torch.equal(gemm_mx.linear_mx(x, w, ws, 32, path="splitk"), fused[0])
    assert torch.equal(gemm_mx.moe_mx(xm, idx, wt, *wm, 10.0, path="splitk"), fused[1])


@pytest.mark.parametrize("rows,decode,block", rotated_grid([(r, d) for d in splitk_mx.DECODES for r in [1, 20, 37]],
                                                          [(32,), (128,)]))
def test_linear_splitk_decodes_match_reference(decode, block, rows, kernel_device):
    """Both weight decodes of the split-K stream (row tiles of 16 / 32 / 64 rows for ``scaled``)."""
    g = torch.Generator(device=kernel_device).manual_seed(rows + block)
    w, ws = mx.quant_fp8_blocks(torch.randn(96, 1024, generator=g, device=kernel_device) * 0.02, block)
    x = torch.randn(rows, 1024, generator=g, device=kernel_device).to(torch.bfloat16)
    out = gemm_mx.linear_mx(x, w, ws, block, path="splitk", decode=decode)
    assert _rel(out, ref_v41.linear_mx(x, w, ws, block)) <= 1e-2


@pytest.mark.parametrize("tokens,decode,dims", rotated_grid([(t, d) for d in splitk_mx.DECODES for t in [1, 11]],
                                                            [(TOY_V41,), (ODD,)], second_ids=["toy", "odd"]))
def test_moe_splitk_decodes_match_reference(decode, dims, tokens, kernel_device):
    x, idx, wt, w = moe_inputs(dims, kernel_device, seed=tokens + 40, tokens=tokens)
    out = moe_mx.moe_splitk(x, idx, wt, *w, 10.0, decode=decode)
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2


def test_scaled_stream_quantising_in_kernel_equals_the_separate_pass(kernel_device, monkeypatch):
    """``scaled`` / ``fp8`` with activations quantised inside the kernel give the bits of the separate pass."""
    x, idx, wt, w = moe_inputs(TOY_V41, kernel_device, seed=4, tokens=5)
    g = torch.Generator(device=kernel_device).manual_seed(6)
    wl, wls = mx.quant_fp8_blocks(torch.randn(64, 256, generator=g, device=kernel_device) * 0.02, 32)
    xl = torch.randn(3, 256, generator=g, device=kernel_device).to(torch.bfloat16)
    sep = (moe_mx.moe_splitk(x, idx, wt, *w, 10.0, decode="scaled"),
           gemm_mx.linear_mx(xl, wl, wls, 32, path="splitk", decode="scaled"))
    fp8 = gemm_mx.linear_mx(xl, wl, wls, 32, path="splitk", decode="fp8")
    monkeypatch.setattr(splitk_mx, "SCALED_RAW_MAX_ROWS", 128)
    monkeypatch.setattr(splitk_mx, "FP8_INKERNEL_QUANT_MAX_ROWS", 128)
    assert torch.equal(moe_mx.moe_splitk(x, idx, wt, *w, 10.0, decode="scaled"), sep[0])
    assert torch.equal(gemm_mx.linear_mx(xl, wl, wls, 32, path="splitk", decode="scaled"), sep[1])
    assert torch.equal(gemm_mx.linear_mx(xl, wl, wls, 32, path="splitk", decode="fp8"), fp8)


def test_fast_decode_failure_falls_back_and_is_recorded(monkeypatch):
    """On a CUDA device a ``scaled`` / ``fp8`` decode that fails to build (or its self-check) is recorded
    and ``registers`` runs; off the GPU the error propagates (interpreter tests exercise the kernel)."""
    from redknot.kernels.triton import stream_guard
    monkeypatch.setattr(stream_guard, "DECODE_ERRORS", {})
    monkeypatch.setattr(stream_guard, "_CHECKED", {"scaled", "fp8"})  # the self-check needs a GPU

    def broken():
        raise RuntimeError("PassManager::run failed")
    with pytest.raises(RuntimeError):
        stream_guard.with_fallback(torch.device("cpu"), "scaled", broken, lambda: "registers")
    assert not stream_guard.DECODE_ERRORS
    with pytest.warns(UserWarning, match="decode='scaled' is not used"):
        assert stream_guard.with_fallback(torch.device("cuda"), "scaled", broken, lambda: "registers") == "registers"
    assert "PassManager::run failed" in stream_guard.DECODE_ERRORS["scaled"]
    assert stream_guard.with_fallback(torch.device("cuda"), "scaled", lambda: "fast", lambda: "registers") == \
        "registers"
    assert stream_guard.with_fallback(torch.device("cuda"), "fp8", lambda: "fast", lambda: "registers") == "fast"


@pytest.mark.parametrize("decode", ["scaled", "fp8"])
def test_self_check_passes_and_detects_a_wrong_decode(decode, kernel_device, monkeypatch):
    """The first-use check agrees for the real kernels and catches a decode that computes something else."""
    from redknot.kernels.triton import stream_guard
    device = torch.device(kernel_device)
    assert stream_guard.self_check(decode, device) is None
    assert stream_guard.self_check("registers", device) is None  # the comparison itself
    real = splitk_mx.splitk_mm

    def off_by_one_scale(a, w, ws, *args, **kw):
        if kw.get("decode") != "registers":
            ws = (ws.view(torch.uint8) + 1).view(ws.dtype)
        return real(a, w, ws, *args, **kw)
    monkeypatch.setattr(splitk_mx, "splitk_mm", off_by_one_scale)
    assert "differs from decode='registers'" in stream_guard.self_check(decode, device)


def test_splitk_rejects_an_unknown_decode(kernel_device):
    w, ws = mx.quant_fp8_blocks(torch.randn(32, 64, device=kernel_device), 32)
    with pytest.raises(ValueError, match="decode='fast'"):
        splitk_mx.splitk_mm(torch.zeros(1, 64, dtype=torch.bfloat16, device=kernel_device), w, ws, 1,
                            w_fp4=False, decode="fast")


@pytest.mark.parametrize("tokens,dim", [(3, 96), (5, 1056)])
def test_routing_kernel_writes_the_qdq_rows(tokens, dim, kernel_device):
    """The routing kernel's QDQ'd rows are ``qdq_bf16``'s bits, and its routing equals the plain one."""
    g = torch.Generator(device=kernel_device).manual_seed(tokens)
    x = (torch.randn(tokens, dim, generator=g, device=kernel_device)
         * torch.logspace(-4, 3, dim, device=kernel_device)).to(torch.bfloat16)
    idx = torch.rand(tokens, 7, generator=g, device=kernel_device).topk(3, -1).indices
    wt = torch.rand(tokens, 3, generator=g, device=kernel_device)
    plain = moe_mx._sorted_pairs(idx, wt, 7)
    fused = moe_mx._sorted_pairs(idx, wt, 7, x)
    assert torch.equal(fused[4], dequant_mx.qdq_bf16(x))
    assert all(torch.equal(a, b) for a, b in zip(plain, fused[:4], strict=True))


@triton.jit
def _tiles_inline(offs_ptr, out_ptr, G, BLOCK_M: tl.constexpr, G_POW2: tl.constexpr):
    j = tl.program_id(0)
    grp, row0, end = splitk_mx.tile_of(offs_ptr, G, j, BLOCK_M, G_POW2)
    tl.store(out_ptr + j, grp)
    tl.store(out_ptr + tl.num_programs(0) + j, row0)
    tl.store(out_ptr + 2 * tl.num_programs(0) + j, end)


def test_inline_tile_equals_the_tile_map(kernel_device):
    """``tile_of`` (each ``scaled`` program's own tile) agrees with ``tile_map`` wherever a tile is live."""
    counts = [0, 3, 0, 17, 1, 19, 0, 0, 37, 5]
    offs = torch.tensor(counts, device=kernel_device).cumsum(0).to(torch.int32)
    for bm in (4, 16):
        group, row0, end, bound = splitk_mx.tile_map(offs, bm, int(offs[-1]))
        out = torch.empty(3, bound, dtype=torch.int32, device=kernel_device)
        _tiles_inline[(bound,)](offs, out, len(counts), BLOCK_M=bm, G_POW2=16)
        live = group >= 0
        assert torch.equal(out[0], group)
        assert torch.equal(out[1][live], row0[live]) and torch.equal(out[2][live], end[live])


@pytest.mark.parametrize("decode", ["scaled", "registers"])
def test_tiled_prefill_plan_decodes_match_reference(decode, kernel_device):
    """The ``tiled`` prefill plan (one K slice, larger row tiles) with either weight decode."""
    x, idx, wt, w = moe_inputs(ODD, kernel_device, seed=21, tokens=13)
    plan = moe_mx.MoePlan("tiled", 32, 32, 64, 4, True, decode)
    out = moe_mx.moe_prefill(x, idx, wt, *w, 10.0, plan=plan)
    assert _rel(out, ref_v41.moe_mx(x, idx, wt, *w, 10.0)) <= 3e-2
