"""``StepMetadata.build`` (the engine's and the benchmarks' step inputs) against a statement of its contract
written per token: the concatenated ids, each row's absolute position (its sequence's context length plus its
index in the sequence), the row offsets, the block tables zero-padded to the widest, the last row of each
sequence as the logits rows; for prefill chunks, mixed prefill/decode batches and decode batches, with ids
given as lists and tuples; and ``build_step_inputs``'s rows of tokens still in flight."""
import random

import pytest
import torch

from redknot.step.metadata import StepMetadata


def _by_token(token_ids, context_lens, block_tables):
    ids, pos, starts = [], [], [0]
    for t, c in zip(token_ids, context_lens):
        for i, x in enumerate(t):
            ids.append(int(x))
            pos.append(c + i)
        starts.append(starts[-1] + len(t))
    width = max(1, max(len(bt) for bt in block_tables))
    table = [list(bt) + [0] * (width - len(bt)) for bt in block_tables]
    return ids, pos, starts, table


@pytest.mark.parametrize("shape", ["prefill", "mixed", "decode"])
def test_build_matches_the_per_token_statement(shape):
    rng = random.Random(hash(shape) & 0xFFFF)
    counts = {"prefill": [4099], "mixed": [7, 1, 300, 1, 2], "decode": [1] * 37}[shape]
    token_ids = [[rng.randrange(0, 129280) for _ in range(n)] for n in counts]
    token_ids[0] = tuple(token_ids[0])  # any sequence of ints
    context_lens = [rng.randrange(0, 1 << 20) for _ in counts]
    tables = [[rng.randrange(0, 4096) for _ in range(rng.randrange(1, 9))] for _ in counts]
    meta = StepMetadata.build(token_ids, context_lens, list(range(len(counts))), tables)
    ids, pos, starts, table = _by_token(token_ids, context_lens, tables)
    assert meta.input_ids.dtype == torch.long and meta.input_ids.tolist() == ids
    assert meta.positions.dtype == torch.long and meta.positions.tolist() == pos
    assert meta.query_start_loc.tolist() == starts
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == table
    assert meta.logits_indices.tolist() == [s - 1 for s in starts[1:]]
    assert meta.num_tokens_per_seq == counts and meta.context_lens == context_lens


def test_build_refuses_an_empty_sequence():
    with pytest.raises(ValueError, match="at least one new token"):
        StepMetadata.build([[1, 2], []], [0, 0], [0, 1], [[0], [1]])


def test_step_inputs_mark_the_in_flight_tokens_and_fill_them():
    """``build_step_inputs``: each PLACEHOLDER_TOKEN row (a token the step in flight is still sampling) is noted
    with its request, wherever the request sits in the step, and ``fill_placeholders`` writes that request's
    newest sampled token there (a request that got none: 0); a prefill chunk has no such row."""
    from redknot.engine.inputs import build_step_inputs
    from redknot.engine.messages import (
        PLACEHOLDER_TOKEN,
        ModelRunnerOutput,
        ScheduledRequest,
        SchedulerOutput,
    )

    reqs = [ScheduledRequest("p", 0, [0, 1], 0, list(range(7, 7 + 300)), 0),           # a prefill chunk
            ScheduledRequest("d1", 1, [2], 40, [PLACEHOLDER_TOKEN], 1),                 # decode, token in flight
            ScheduledRequest("v", 2, [3], 50, [PLACEHOLDER_TOKEN, 11, 12], 3),          # verify: in flight + drafts
            ScheduledRequest("d2", 3, [4], 60, [PLACEHOLDER_TOKEN], 1)]
    inputs = build_step_inputs(SchedulerOutput(step_id=5, requests=reqs))
    assert inputs.placeholder_rows == [(300, "d1"), (301, "v"), (304, "d2")]
    inputs.fill_placeholders(ModelRunnerOutput(step_id=4, sampled_token_ids={"d1": [91], "v": [92, 93]}))
    ids = inputs.meta.input_ids.tolist()
    assert ids[:300] == list(range(7, 307)) and ids[300:] == [91, 93, 11, 12, 0]
    assert inputs.placeholder_rows == []
