"""The V4.1 engine path on a CUDA device against the CPU reference (fp64: device placement and
indexing only, no numeric slack): prefill in chunks, decode across ring wraps, bounded replay."""
from __future__ import annotations

import pytest
import torch

from v41_forward.v41util import Pair, Seq, tokens


@pytest.mark.gpu
@pytest.mark.parametrize("numerics", ["reference", "bf16"])
def test_engine_path_on_cuda_matches_the_cpu_reference(numerics):
    pair = Pair(numerics=numerics, device="cuda")
    ids = tokens(85)
    want = pair.ref.forward(ids).logits
    seq = Seq(pair.model, len(ids))
    got = [seq.step(ids[:23]), seq.step(ids[23:61])] + [seq.step([ids[p]]) for p in range(61, len(ids))]
    assert (torch.cat(got) - want).abs().max() < 1e-9
    first = 61 - 20
    compact = pair.ref.forward(ids[:61], replay_from=first).logits
    got = Seq(pair.model, len(ids), seed=3).step(ids[:61], replay_from=first)
    assert (got[first:] - compact).abs().max() < 1e-9
