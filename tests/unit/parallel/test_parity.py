"""Data, expert and context parallel on 2 and 4 CPU processes (gloo, torchrun) against one process.

Every scenario drives the same six requests (staggered adds; some long enough for context
parallel to split them) and compares each request's greedy tokens with the single-process
engine, and in batch-invariant mode every logits row bitwise. The checks also make sure the
parallel machinery actually ran (requests on every DP rank, tokens crossing EP ranks, experts
re-placed by EPLB, sequences split by CP), so a silently single-rank path cannot pass.
"""
import pytest
import torch

from redknot.parallel.eplb import uniform_placement

from .conftest import ARCH, run_world

E = ARCH["n_routed_experts"]

WORLD2 = [
    dict(name="dp2", dp=2, ep=1, cp=1, batch_invariant=True),
    dict(name="dp2_ep2", dp=2, ep=2, cp=1, batch_invariant=True),
    dict(name="dp2_ep2_eplb", dp=2, ep=2, cp=1, batch_invariant=True, eplb=True, redundant=2, interval=2,
         abort="r5"),
    dict(name="cp2", dp=1, ep=1, cp=2, batch_invariant=True),
    dict(name="cp2_ep2_rebalance", dp=1, ep=2, cp=2, batch_invariant=True, eplb=True, redundant=2,
         interval=1000, rebalance_now=True),
    dict(name="dp2_ep2_reference_kernels", dp=2, ep=2, cp=1, batch_invariant=False),
    dict(name="dp2_harness_admission", dp=2, ep=2, cp=1, batch_invariant=True, admission=1),
    # DSpark drafting (MTP steps with replicated experts) and verify steps, on EP and on CP: tokens only
    # (verify steps produce other logits rows than plain decoding).
    dict(name="dp2_ep2_dspark", dp=2, ep=2, cp=1, batch_invariant=True, dspark=True),
    dict(name="cp2_ep2_dspark", dp=1, ep=2, cp=2, batch_invariant=True, dspark=True),
]
WORLD4 = [
    dict(name="dp4_ep4_eplb", dp=4, ep=4, cp=1, batch_invariant=True, eplb=True, redundant=4, interval=2),
    dict(name="dp2_cp2_ep4_eplb", dp=2, ep=4, cp=2, batch_invariant=True, eplb=True, redundant=4, interval=3),
    dict(name="cp4_ep2", dp=1, ep=2, cp=4, batch_invariant=True),
]


@pytest.fixture(scope="module")
def world2(model_cache, reference, tmp_path_factory):
    return run_world(2, WORLD2, model_cache, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world4(model_cache, reference, tmp_path_factory):
    return run_world(4, WORLD4, model_cache, tmp_path_factory.mktemp("world4"))


def check_scenario(sc: dict, ranks: list, reference: dict) -> None:
    name = sc["name"]
    ref_out, ref_logits = reference[sc["batch_invariant"]]
    front = ranks[0][name]
    out = front["outputs"]
    aborted = sc.get("abort")
    assert set(out) == set(ref_out), name
    for rid, ref in ref_out.items():
        if rid == aborted:
            assert out[rid]["reason"] == "abort"
            continue
        assert out[rid]["tokens"] == ref["tokens"], f"{name}: {rid} tokens differ from one process"
    # Each request's logits rows come from the rank(s) that computed them (CP ranks all hold them).
    logits = {}
    for rank in ranks:
        for rid, rows in rank[name]["logits"].items():
            logits.setdefault(rid.split(":")[-1], rows)  # the harness's request ids are "case:<id>"
    for rid, ref_rows in ref_logits.items():
        if rid == aborted or sc.get("dspark"):
            continue
        rows = logits[rid]
        assert len(rows) == len(ref_rows), (name, rid)
        for a, b in zip(rows, ref_rows):
            if sc["batch_invariant"]:
                assert torch.equal(a, b), f"{name}: {rid} logits not bitwise equal to one process"
            else:
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    check_machinery(sc, ranks)


def check_machinery(sc: dict, ranks: list) -> None:
    """The layout's parts did their work (not a disguised single-rank run)."""
    name = sc["name"]
    front = ranks[0][name]
    metrics = front["metrics"]
    assert sorted(metrics) == list(range(len(ranks)))
    owners = set(front["owner"].values())
    assert owners == set(range(sc["dp"])), f"{name}: requests reached DP ranks {owners}"
    if sc["ep"] > 1:
        forwards = {m["ep.forwards"] for m in metrics.values()}
        assert len(forwards) == 1 and forwards.pop() > 0, f"{name}: ranks ran different numbers of forwards"
        assert all(m["ep.routed_pairs"] > 0 or sc["cp"] > 1 for m in metrics.values())
    if sc.get("eplb"):
        assert all(m["eplb.rebalances"] >= 1 for m in metrics.values())
        initial = list(uniform_placement(E, sc["ep"], sc["redundant"]).phys_to_logical)
        finals = ranks[0][name]["placements"]
        assert any(p != initial for p in finals), f"{name}: no layer's experts were re-placed"
        assert all(set(p) == set(range(E)) for p in finals), "every expert keeps a replica"
        assert all(r[name]["placements"] == finals for r in ranks), "ranks disagree on the placement"
    if sc["cp"] > 1:
        assert all(m["cp.split_steps"] >= 1 for m in metrics.values()), f"{name}: no sequence was split"
    if sc.get("dspark"):
        assert front["stats"]["drafts"] > 0, f"{name}: no draft tokens were verified"


@pytest.mark.parametrize("sc", WORLD2, ids=[s["name"] for s in WORLD2])
def test_two_processes_match_one(sc, world2, reference):
    check_scenario(sc, world2, reference)


@pytest.mark.parametrize("sc", WORLD4, ids=[s["name"] for s in WORLD4])
def test_four_processes_match_one(sc, world4, reference):
    check_scenario(sc, world4, reference)


def test_harness_admission_respects_dp_ranks(world2):
    """The harness's runner admits at most admission_batch_size requests per DP rank, and the rank it
    records for each case is the rank the engine ran it on."""
    sc = next(s for s in WORLD2 if s.get("admission"))
    front = world2[0][sc["name"]]
    assert front["peak_active"] == [sc["admission"]] * sc["dp"]
    for case_id, outcome in front["outputs"].items():
        assert outcome["status"] == "ok"
        assert outcome["dp_rank"] == front["owner"][f"case:{case_id}"], case_id
