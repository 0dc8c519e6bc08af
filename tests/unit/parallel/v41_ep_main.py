"""One rank of the DeepSeek-V4.1 expert-parallel check (started by torchrun, gloo on CPU).

Every rank builds the unsharded model from the same seeded native weights, and the rank's
expert-parallel model from only its routed experts and its slice of each Engram table; it
runs its own sequence (different tokens per rank, so tokens cross ranks) through both and
saves the logits. Rank 0 then runs one more decode step while the other ranks join with
``ExpertParallel.idle_forward`` (a rank without tokens still hosts experts and table rows).
A direct check of the sharded Engram lookup against the full table follows.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "v41_forward"))

from v41util import Seq, random_weights, test_config, token_map_for, tokens  # noqa: E402

from redknot.models.deepseek_v41.model import DeepseekV41  # noqa: E402
from redknot.models.deepseek_v41.parallel import EngramLookup, expert_layers  # noqa: E402
from redknot.models.deepseek_v41.ref_math import Numerics, Weights  # noqa: E402
from redknot.parallel.ep import EplbSettings, ExpertParallel  # noqa: E402
from redknot.parallel.eplb import uniform_placement  # noqa: E402

PROMPT, DECODE = 24, 5


def shard(cfg, tensors, rank, world):
    """This rank's tensors: its routed experts only, its row slice of each Engram table."""
    mine = uniform_placement(cfg.n_routed_experts, world, 0).rank_experts(rank)
    out, tables = {}, {}
    for name, t in tensors.items():
        if ".ffn.experts." in name and not name.startswith("mtp."):
            if int(name.split(".experts.")[1].split(".")[0]) not in mine:
                continue
        out[name] = t
    for layer, total in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        p = f"layers.{layer}.engram"
        c = -(-total // world)
        lo, hi = min(total, rank * c), min(total, (rank + 1) * c)
        out[f"{p}.embed.weight"] = tensors[f"{p}.embed.weight"][lo:hi].clone()
        out[f"{p}.embed.scale"] = tensors[f"{p}.embed.scale"][lo:hi].clone()
        tables[p] = (out[f"{p}.embed.weight"], out[f"{p}.embed.scale"], lo, total)
    return out, tables, mine


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    cfg = test_config()
    num = Numerics("reference", torch.float64)
    full = random_weights(cfg, 0)
    tmap = token_map_for(cfg)
    pad_c = int(tmap[cfg.engram_pad_id])
    single = DeepseekV41(cfg, Weights(full, torch.float64), tmap, pad_c, num)
    part, tables, mine = shard(cfg, full, rank, world)
    model = DeepseekV41(cfg, Weights(part, torch.float64), tmap, pad_c, num)
    model.expert_ids = {i: mine for i in range(cfg.n_layers)}
    model.w.engram_lookup = EngramLookup("sharded", tables, group, rank, world)
    ep = ExpertParallel(model, expert_layers(model), group, rank, world, EplbSettings(), torch.device("cpu"))

    ids = tokens(PROMPT + DECODE + 1, seed=10 + rank)
    res = {"single": [], "ep": []}
    for net, key in ((single, "single"), (model, "ep")):
        seq = Seq(net, PROMPT + DECODE + 1)
        res[key].append(seq.step(ids[:PROMPT]))
        for j in range(DECODE):
            res[key].append(seq.step(ids[PROMPT + j:PROMPT + j + 1]))
        if key == "ep":  # rank 0 alone: the others join with zero rows
            if rank == 0:
                res[key].append(seq.step(ids[PROMPT + DECODE:PROMPT + DECODE + 1]))
            else:
                ep.idle_forward()
        elif rank == 0:
            res[key].append(seq.step(ids[PROMPT + DECODE:PROMPT + DECODE + 1]))
    # Bounded replay: rank 1's chunk lies wholly below its replay start (no tail rows), rank 0's
    # does not; rank 1 must still join the tail layers' exchanges.
    first = 8 if rank == 0 else 100
    res["replay"] = [Seq(net, 20).step(ids[:16], replay_from=first)[8:] for net in (single, model)]
    res["routed_pairs"] = int(ep.total_load.sum() + ep.load.sum())
    res["rows_received"] = model.w.engram_lookup.rows_received
    res["local_experts"] = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in model.w.tensors
                                   if ".ffn.experts." in n})

    # The lookup alone: random ids over the whole table plus every shard's first and last row;
    # rank 1 asks for nothing in the second call.
    lookup = model.w.engram_lookup
    gen = torch.Generator().manual_seed(100 + rank)
    checks = []
    for layer, total in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        p = f"layers.{layer}.engram"
        c = -(-total // world)
        edges = sorted({min(total - 1, v) for r in range(world) for v in (r * c, (r + 1) * c - 1)})
        for n in (37, 0 if rank == 1 else 5):
            want = torch.cat([torch.randint(0, total, (n,), generator=gen), torch.tensor(edges if n else [])]).long()
            q, s = lookup(p, want)
            checks.append(torch.equal(q, full[f"{p}.embed.weight"].view(torch.uint8)[want])
                          and torch.equal(s, full[f"{p}.embed.scale"].view(torch.uint8)[want]))
    res["lookup_equal"] = checks
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
