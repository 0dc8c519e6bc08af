"""Variable-length verify steps padded to captured total-token tiers: the device-built layout
equals the one written out request by request, padding rows go to the spare slot, and tiers
cover every mix of 1..g+1 tokens per request."""
import random

import pytest
import torch

from redknot.speculative.varlen import VerifyGraphs, tier_for, varlen_layout, verify_tiers


def _by_hand(lens, starts, slots, tier, pad):
    rows = [(r, starts[r] + j, slots[r]) for r in range(len(lens)) for j in range(lens[r])]
    rows += [(len(lens), 0, pad)] * (tier - len(rows))
    return rows


def test_tiers_cover_every_mix():
    tiers = verify_tiers(max_num_seqs=32, block=5)
    assert tiers[0] == 1 and tiers[-1] == 32 * 6 and tiers == sorted(set(tiers))
    assert tier_for(7, tiers) == 8 and tier_for(192, tiers) == 192 and tier_for(25, tiers) == 32
    with pytest.raises(ValueError, match="exceeds the largest captured tier 192"):
        tier_for(193, tiers)


def test_layout_matches_the_request_by_request_construction():
    rng = random.Random(0)
    tiers = verify_tiers(max_num_seqs=8, block=5)
    for _ in range(200):
        n = rng.randint(1, 8)
        lens = [rng.randint(1, 6) for _ in range(n)]
        starts = [rng.randint(0, 5000) for _ in range(n)]
        slots = rng.sample(range(20), n)
        tier = tier_for(sum(lens), tiers)
        lay = varlen_layout(torch.tensor(lens), torch.tensor(starts), torch.tensor(slots), tier, padding_slot=99)
        want = _by_hand(lens, starts, slots, tier, 99)
        got = list(zip(lay.row_request.tolist(), lay.positions.tolist(), lay.slots.tolist()))
        assert got == want
        assert lay.query_start_loc.tolist() == [sum(lens[:i]) for i in range(n + 1)]
        assert lay.valid.sum().item() == sum(lens) and lay.logits_rows.shape[0] == tier


def test_verify_graphs_are_off_for_a_model_without_varlen_tensor_path():
    class Runner:
        model = object()
    graphs = VerifyGraphs(Runner(), max_num_seqs=4, block=5)
    assert graphs.status.startswith("off: the model's tensor-only forward handles one token per sequence")
