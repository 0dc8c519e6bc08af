"""DSpark and compact replay on a CUDA device (skipped without one): greedy equals plain decoding,
seeded sampling reproducible, compact replay equals mode off, forced rollbacks leave the state of a
plain run (float32, reference kernels)."""
import random

import pytest
import torch
from spec_testutil import MAX_DRAFT, WINDOW, live_state, lockstep, record_logits, run_all

from redknot.engine import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _prompts(seed, n, lo=3, hi=60):
    rng = random.Random(seed)
    return {f"g{seed}-{i}": [rng.randrange(3, 4096) for _ in range(rng.randrange(lo, hi))] for i in range(n)}


def test_greedy_and_seeded_sampling_on_gpu(engines):
    off, on = engines(dspark=False, cuda=True), engines(cuda=True)
    assert on.device.type == "cuda" and on.stats().cuda_graphs.startswith("off")
    prompts = _prompts(0, 5)
    ref, ref_lg = record_logits(off, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    got, got_lg = record_logits(on, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids
        torch.testing.assert_close(got_lg[rid], ref_lg[rid], atol=2e-4, rtol=0)
    assert sum(o.metrics.num_draft_accepted for o in got.values()) > 0
    params = {rid: SamplingParams(max_tokens=16, temperature=0.7, seed=i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    a, b = run_all(on, prompts, params), run_all(on, prompts, params)
    assert all(a[r].token_ids == b[r].token_ids for r in prompts)


def test_compact_replay_on_gpu(engines):
    keep = WINDOW + MAX_DRAFT + 1
    prompts = {f"L{n}": [(7 * i + n) % 4000 + 3 for i in range(n)] for n in (WINDOW - 1, keep, keep + 1, 3 * keep)}
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref, ref_lg = record_logits(engines(cuda=True, tag="off"), prompts, params)
    compact = engines(cuda=True, compact=True, keep_tokens=keep)
    for st in compact.runner.state.mtp:
        st.swa.normal_()
    got, got_lg = record_logits(compact, prompts, params)
    for rid in prompts:
        assert got[rid].token_ids == ref[rid].token_ids
        torch.testing.assert_close(got_lg[rid], ref_lg[rid], atol=2e-4, rtol=0)


def test_forced_rollback_state_on_gpu(engines):
    spec, ref = engines(cuda=True, tag="spec"), engines(cuda=True, tag="plain")
    prompt = [(11 * i) % 4000 + 3 for i in range(27)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref.runner.speculator.draft_hook = lambda rid, pos, drafts: []
    full = run_all(ref, {"full": prompt}, params)["full"].token_ids
    pattern = iter([0, 2, 4, 1, 3] * 10)

    def hook(rid, first_pos, drafts):
        i, a = first_pos - len(prompt), next(pattern)
        return full[i:i + a] + [(full[i + a] + 1) % 4096] * (MAX_DRAFT - a) if i + a < len(full) else []
    spec.runner.speculator.draft_hook = hook
    spec.add_request("r", prompt, params)
    ref.add_request("r", prompt, params)
    for _ in lockstep(spec, ref, "r"):
        got, want = live_state(spec, "r"), live_state(ref, "r")
        for name in want:  # float32 reference kernels on a GPU: row counts may change the last bits
            torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_dspark_stages_greedy_and_seeded_sampling_on_gpu(engines):
    """The V4-0731 layout (three DSpark stages): greedy equals plain decoding on the GPU, and seeded
    probabilistic drafts with block verification reproduce."""
    off = engines(arch="dspark", dspark=False, cuda=True)
    on = engines(arch="dspark", cuda=True, adaptive=True, verification="block", draft_sampling="probabilistic")
    rng = random.Random(5)
    prompts = {f"h{i}": [rng.randrange(2, 63) for _ in range(rng.randrange(3, 50))] for i in range(5)}
    ref = run_all(off, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    got = run_all(on, prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(got[r].token_ids == ref[r].token_ids for r in prompts)
    assert sum(o.metrics.num_draft_accepted for o in got.values()) > 0
    params = {rid: SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    a, b = run_all(on, prompts, params), run_all(on, prompts, params)
    assert all(a[r].token_ids == b[r].token_ids for r in prompts)
