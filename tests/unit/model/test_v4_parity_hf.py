"""Parity with transformers' DeepseekV4ForCausalLM (fp32, randomised parameters, reference §11):
one full forward, uneven chunked prefill, token-by-token decode, a varlen batch of several
sequences, and speculative rollback; max relative error <= 1e-5 against the oracle's full forward."""
import pytest
import torch

from redknot.models.deepseek_v4.single import SingleSequence, full_logits
from redknot.step.metadata import StepMetadata
from redknot.models.deepseek_v4.state import V4State
from v4_testutil import PARITY_CONFIG, VARIANT_CONFIG, hf_model, native_model_from_hf, rel_err

TOL = 1e-5
T = 70


@pytest.fixture(scope="module", params=[("reference_s11", PARITY_CONFIG), ("variant", VARIANT_CONFIG)],
                ids=lambda p: p[0])
def pair(request, tmp_path_factory):
    hf = hf_model(request.param[1], seed=0)
    ours = native_model_from_hf(hf, str(tmp_path_factory.mktemp("ckpt")))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (3, T), generator=gen)
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits  # [3, T, V]
    return ours, ids, ref


def test_oracle_exercises_every_path(pair):
    ours, ids, _ = pair
    cfg = ours.cfg
    assert {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"} <= set(cfg.layer_types)
    assert T // cfg.csa_ratio > cfg.index_topk and T // cfg.hca_ratio >= 2  # real selection, >= 2 HCA entries
    assert cfg.index_n_heads >= 16
    sinks = [b.attn.attn_sink for b in ours.layers]
    assert all(s.abs().min() > 0 for s in sinks)


def test_full_forward(pair):
    ours, ids, ref = pair
    assert rel_err(full_logits(ours, ids[0].tolist()), ref[0]) <= TOL


def test_uneven_chunked_prefill_on_shuffled_blocks(pair):
    ours, ids, ref = pair
    seq = SingleSequence(ours, T, shuffle_blocks=7)
    cuts = [0, 29, 32, 35, 40, 41, 53, 70]
    out = [seq.step(ids[0, a:b].tolist(), all_logits=True)[1] for a, b in zip(cuts, cuts[1:])]
    assert rel_err(torch.cat(out), ref[0]) <= TOL


def test_token_by_token_decode(pair):
    ours, ids, ref = pair
    seq = SingleSequence(ours, T)
    out = [seq.step([int(t)])[1] for t in ids[1]]
    assert rel_err(torch.cat(out), ref[1]) <= TOL


def test_varlen_batch_rows_do_not_depend_on_other_sequences(pair):
    """Three sequences in different slots, mixing prefill chunks and decodes in the same steps."""
    ours, ids, ref = pair
    cfg = ours.cfg
    layout = SingleSequence(ours, T).layout
    per_seq = layout.blocks_for(T)
    state = V4State.allocate(cfg, layout, num_slots=4, num_blocks=3 * per_seq + 2, device="cpu")
    tables = [list(range(2 + s * per_seq, 2 + (s + 1) * per_seq))[::-1] for s in range(3)]
    slots = [3, 0, 2]
    plans = [[40, 1, 1, 28], [5, 30, 1, 34], [1, 1, 60, 8]]  # tokens per step for each sequence
    done = [0, 0, 0]
    got = [[], [], []]
    for step in range(4):
        chunks = [ids[s, done[s]:done[s] + plans[s][step]].tolist() for s in range(3)]
        starts = [sum(len(c) for c in chunks[:s]) for s in range(3)]
        rows = [starts[s] + i for s in range(3) for i in range(len(chunks[s]))]
        meta = StepMetadata.build(chunks, done, slots, tables, rows)
        logits = ours.compute_logits(ours(meta, state)[meta.logits_indices])
        for s in range(3):
            got[s].append(logits[starts[s]:starts[s] + len(chunks[s])])
            done[s] += len(chunks[s])
    for s in range(3):
        assert rel_err(torch.cat(got[s]), ref[s]) <= TOL


def test_rollback_of_rejected_draft_tokens(pair):
    """Verify steps of the true token + max_backtrack wrong drafts, roll the drafts back, continue
    with 1..5 accepted tokens (every ring phase is hit): logits equal the oracle's."""
    ours, ids, ref = pair
    backtrack = 5
    seq = SingleSequence(ours, T + backtrack, max_backtrack=backtrack)
    out = [seq.step(ids[2, :19].tolist(), all_logits=True)[1]]
    pos, k = 19, 0
    gen = torch.Generator().manual_seed(5)
    while pos < T:
        n = min(1 + k % 5, T - pos)
        k += 1
        draft = torch.randint(0, ours.cfg.vocab_size, (backtrack,), generator=gen).tolist()
        out.append(seq.step([int(ids[2, pos])] + draft, all_logits=True)[1][:1])
        seq.rollback(backtrack)
        if n > 1:
            out.append(seq.step(ids[2, pos + 1:pos + n].tolist(), all_logits=True)[1])
        pos += n
    assert rel_err(torch.cat(out), ref[2]) <= TOL
