"""Reference kernels against brute-force formulations (these are what fast kernels are tested against)."""
import math

import pytest
import torch

from redknot.kernels import KernelSet
from redknot.kernels.ref_quant import quantize_fp4, quantize_fp8_block
from redknot.step.metadata import StepMetadata

OPS = {"rms_norm", "linear", "grouped_linear", "rope", "mhc_pre", "mhc_post", "mhc_head", "compressor",
       "indexer_topk", "sparse_attention", "moe", "router_scores"}
ks = KernelSet()
g = torch.Generator().manual_seed(0)


def rnd(*shape):
    return torch.randn(*shape, generator=g)


def test_every_op_has_a_reference():
    assert OPS <= set(ks.choice) and all(ks.choice[op] == "reference" for op in OPS)


def test_rope_is_a_rotation_of_interleaved_pairs_and_inverse_undoes_it():
    x, ang = rnd(5, 3, 12), rnd(5, 4)
    y = ks.rope(x, ang.cos(), ang.sin())
    assert torch.equal(y[..., :4], x[..., :4])
    pairs = torch.view_as_complex(x[..., 4:].reshape(5, 3, 4, 2).contiguous())
    z = pairs * torch.polar(torch.ones(5, 1, 4), ang[:, None])
    assert torch.allclose(y[..., 4:], torch.view_as_real(z).flatten(-2), atol=1e-6)
    assert torch.allclose(ks.rope(y, ang.cos(), ang.sin(), inverse=True), x, atol=1e-6)


def test_quantised_linear_equals_dequantised():
    x, w = rnd(3, 256), rnd(130, 256)
    q8, s8 = quantize_fp8_block(w)
    deq = q8.float() * s8.repeat_interleave(128, 0).repeat_interleave(128, 1)[:130, :256]
    assert torch.allclose(ks.linear(x, q8, s8), x @ deq.T, atol=1e-5)
    q4, s4 = quantize_fp4(w)
    assert ks.linear(x, q4, s4).shape == (3, 130)


def test_mhc_pre_is_doubly_stochastic_and_mixes_by_columns():
    n, d = 4, 8
    streams = rnd(6, n, d)
    fn = rnd((2 + n) * n, n * d) / math.sqrt(n * d)
    collapsed, post, comb = ks.mhc_pre(streams, fn, rnd((2 + n) * n), 1 + 0.1 * rnd(3), 20, 1e-6, 1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(6, n), atol=1e-5)  # the last Sinkhorn step normalises columns
    assert torch.allclose(comb.sum(-1), torch.ones(6, n), atol=2e-2)
    y = rnd(6, d)
    out = ks.mhc_post(y, streams, post, comb)
    t, k = 2, 3
    want = post[t, k] * y[t] + sum(comb[t, j, k] * streams[t, j] for j in range(n))
    assert torch.allclose(out[t, k], want, atol=1e-5)
    assert collapsed.shape == (6, d) and post.min() > 0 and post.max() < 2


@pytest.mark.parametrize("overlap,has_prev", [(False, False), (True, False), (True, True)])
def test_compressor_pools_windows(overlap, has_prev):
    m, hd = 4, 6
    c = 2 * hd if overlap else hd
    n_win = 3 + has_prev
    kv, gate, ape = rnd(n_win * m, c), rnd(n_win * m, c), rnd(m, c)
    out = ks.compressor(kv, gate, ape, m, overlap, has_prev)
    rows = []
    first = 1 if has_prev else 0
    for w in range(first, n_win):
        slots = [(kv[w * m + r, -hd:], gate[w * m + r, -hd:] + ape[r, -hd:]) for r in range(m)]
        if overlap and w > 0:
            slots += [(kv[(w - 1) * m + r, :hd], gate[(w - 1) * m + r, :hd] + ape[r, :hd]) for r in range(m)]
        vals, gates = torch.stack([s[0] for s in slots]), torch.stack([s[1] for s in slots])
        rows.append((torch.softmax(gates, 0) * vals).sum(0))
    assert torch.allclose(out, torch.stack(rows), atol=1e-6)


def one_seq_meta(n, ctx, blocks):
    return StepMetadata.build([[0] * n], [ctx], [1], [blocks])


def test_indexer_ties_prefer_lower_entries_and_hide_future_ones():
    ih, d, ratio = 2, 4, 4
    keys = torch.zeros(2, 8, d)  # pool: 2 blocks of 8 entries
    table = [1, 0]
    logical = torch.zeros(16, d)
    logical[[2, 5, 9]] = torch.tensor([1.0, 0, 0, 0])  # three equal best entries
    logical[3] = torch.tensor([0.5, 0, 0, 0])
    for w in range(16):
        keys[table[w // 8], w % 8] = logical[w]
    q = torch.zeros(2, ih, d)
    q[..., 0] = 1.0
    meta = one_seq_meta(2, 62, table)  # queries at 62, 63 see 15 and 16 entries
    top = ks.indexer_topk(q, torch.ones(2, ih), keys, meta, ratio, 3, 1.0)
    assert top[0].tolist() == [2, 5, 9] and top[1].tolist() == [2, 5, 9]
    meta = one_seq_meta(1, 23, table)  # sees entries 0..5 only
    assert ks.indexer_topk(q[:1], torch.ones(1, ih), keys, meta, ratio, 3, 1.0)[0].tolist() == [2, 5, 3]
    meta = one_seq_meta(1, 5, table)  # one visible entry
    assert ks.indexer_topk(q[:1], torch.ones(1, ih), keys, meta, ratio, 3, 1.0)[0].tolist() == [0, -1, -1]


def test_sparse_attention_matches_explicit_key_lists():
    h, d, window, ring, ctx, n = 3, 8, 5, 7, 9, 4
    swa = rnd(2, ring, d)
    pool, table = rnd(3, 4, d), [2, 0, 1]
    q, kv, sinks = rnd(n, h, d), rnd(n, d), rnd(h)
    idx = torch.tensor([[3, -1, 0], [5, 1, -1], [-1, -1, -1], [8, 2, 7]])
    meta = one_seq_meta(n, ctx, table)
    out = ks.sparse_attention(q, kv, swa, sinks, 0.3, window, meta, pool, idx, q_tile=3)
    row_of = {p: swa[1, p % ring] for p in range(ctx)} | {ctx + i: kv[i] for i in range(n)}
    for i in range(n):
        t = ctx + i
        keys = [row_of[p] for p in range(t - window + 1, t + 1)]
        keys += [pool[table[w // 4], w % 4] for w in idx[i].tolist() if w >= 0]
        k = torch.stack(keys)
        logits = torch.cat([(q[i] @ k.T) * 0.3, sinks[:, None]], -1)
        p = torch.softmax(logits, -1)[:, :-1]
        assert torch.allclose(out[i], p @ k, atol=1e-6), i


def test_moe_matches_a_loop_and_rows_are_independent():
    t, d, inter, e, k, lim = 7, 16, 8, 5, 2, 0.7
    x, w1, w2, w3 = rnd(t, d), rnd(e, inter, d), rnd(e, d, inter), rnd(e, inter, d)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    wts = torch.rand(t, k, generator=g)
    out = ks.moe(x, idx, wts, w1, w2, w3, lim)
    for r in range(t):
        want = sum(wts[r, j] * w2[ei] @ (torch.nn.functional.silu((w1[ei] @ x[r]).clamp(max=lim))
                                         * (w3[ei] @ x[r]).clamp(-lim, lim)) for j, ei in enumerate(idx[r]))
        assert torch.allclose(out[r], want, atol=1e-5)
    alone = ks.moe(x[2:3], idx[2:3], wts[2:3], w1, w2, w3, lim)
    assert torch.allclose(alone[0], out[2], atol=1e-6)
