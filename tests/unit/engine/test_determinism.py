"""features.deterministic: a seeded request gives the same tokens across runs, batch sizes and
batch positions; different seeds give different tokens."""
import random

from llm_testutil import run_all

from redknot.engine import SamplingParams


def _params(seed):
    return SamplingParams(max_tokens=10, temperature=1.0, top_k=200, top_p=0.95, seed=seed, ignore_eos=True)


def _fillers(rng, n):
    return ({f"f{i}": [rng.randrange(3, 120000) for _ in range(rng.randrange(3, 30))] for i in range(n)},
            {f"f{i}": SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.8, ignore_eos=True)
             for i in range(n)})


def test_same_seed_same_tokens_across_runs_and_batch_sizes(engines):
    rng = random.Random(0)
    prompt = [rng.randrange(3, 120000) for _ in range(23)]
    llm = engines(batch_invariant=True, deterministic=True)
    runs = []
    for size in (0, 3, 11):  # three runs: alone, then two batch sizes with the request at a random place
        prompts, params = _fillers(rng, size)
        order = list(prompts)
        order.insert(rng.randrange(size + 1), "target")
        prompts["target"], params["target"] = prompt, _params(1234)
        out, _ = run_all(llm, {rid: prompts[rid] for rid in order}, params)
        runs.append(out["target"].token_ids)
    assert runs[0] == runs[1] == runs[2]
    others = {s: run_all(llm, {"x": prompt}, _params(s))[0]["x"].token_ids for s in (1, 2, 3)}
    assert len({tuple(v) for v in others.values()} | {tuple(runs[0])}) == 4


def test_unseeded_requests_use_the_engine_seed(engines):
    llm = engines(batch_invariant=True, deterministic=True)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    a, _ = run_all(llm, {"a": [5, 6, 7, 8]}, params)
    b, _ = run_all(llm, {"b": [5, 6, 7, 8], "c": [9, 10]}, params)
    assert a["a"].token_ids == b["b"].token_ids
