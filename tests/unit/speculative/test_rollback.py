"""Rollback of rejected drafts: drafts are forced so that verification accepts exactly
0, 1, ..., max_draft of them; after every step the state a later step can read (every layer's
SWA ring, compressor rows, CSA/HCA entries, indexer keys, the MTP layer's ring) equals a
non-speculative run's at the same position, bit for bit, and everything else is then
overwritten with NaN without changing what follows."""
import itertools

import torch
from spec_testutil import MAX_DRAFT, BlockSpy, live_state, poison_dead_state

from redknot.engine import SamplingParams

PROMPT = [(37 * i + 11) % 4000 + 3 for i in range(29)]
MAX_TOKENS = 40
PATTERN = [0, 1, 2, 3, 4, 2, 0, 4, 1, 3, 0, 0, 4, 4]  # accepted drafts per verify step


def _step_until(llm, rid, length):
    """Step a plain-decoding engine until the request's state holds ``length`` positions."""
    while llm.scheduler.requests[rid].num_computed_tokens < length:
        llm.step()
    assert llm.scheduler.requests[rid].num_computed_tokens == length


def _assert_same_state(got, ref, where):
    assert got.keys() == ref.keys()
    for name in ref:
        assert torch.equal(got[name], ref[name]), f"{where}: {name} differs"
        assert not torch.isnan(got[name]).any(), f"{where}: {name} read a poisoned row"


def test_forced_acceptance_counts_leave_the_state_of_a_plain_run(engines):
    # Batch-invariant kernels: a position's values do not depend on how many rows its step had,
    # so the speculative and the plain run must agree exactly.
    spec = engines(batch_invariant=True, tag="spec")
    ref = engines(batch_invariant=True, tag="plain")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ref.runner.speculator.draft_hook = lambda rid, pos, drafts: []  # MTP runs, nothing is verified
    ref.add_request("full", PROMPT, params)
    while ref.has_unfinished_requests():
        done = [o for o in ref.step() if o.finished]
    full = done[0].token_ids
    forced = itertools.cycle(PATTERN)
    wanted = []

    def hook(rid, first_pos, drafts):
        a = next(forced)
        i = first_pos - len(PROMPT)
        wanted.append(a)
        good = full[i:i + a]
        return good + [(full[i + a] + 1) % 4096] * (MAX_DRAFT - a) if i + a < len(full) else full[i:i + MAX_DRAFT]
    spec.runner.speculator.draft_hook = hook
    spy = BlockSpy(spec)
    spec.add_request("r", PROMPT, params)
    ref.add_request("r", PROMPT, params)
    checked = 0
    try:
        while spec.has_unfinished_requests():
            finished = [o for o in spec.step() if o.finished]
            if finished:
                break
            length = spec.scheduler.requests["r"].num_computed_tokens
            _step_until(ref, "r", length)
            _assert_same_state(live_state(spec, "r"), live_state(ref, "r"), f"length {length}")
            assert poison_dead_state(spec, "r") > 0
            checked += 1
        while ref.has_unfinished_requests():
            ref.step()
    finally:
        spy.close()
    assert finished[0].token_ids == full
    accepted = [len(b) - 1 for b in spy.blocks["r"]][:-1]  # the last block may be cut by max_tokens
    assert accepted == wanted[:len(accepted)] and set(PATTERN) <= set(accepted)
    assert checked >= len(PATTERN)
