"""DeepSeek-V4.1 real-dimension cut on the engine path: parity of the kernel path against the PyTorch
path, chunked prefill time / peak memory / cache bytes per token, decode steps, each against the cost
model's floor (FP8 1451 TFLOP/s, 4.17 TB/s), and time shares per registry op (CUDA events; the rest of the
step is "outside the registry ops") and per kernel (torch.profiler).

The cut keeps the real widths (dim 5120, 64 heads x 512, 384 experts top-6; FP8 32x32-tile weights and
MXFP4 experts kept in memory as random bytes) and five layers with the roles of the full schedule:
0 ratio-2 kv/index source with Engram (like layer 14), 1 ratio-2 consumer, 2 ratio-1 kv source and
candidate source (layer 20), 3 ratio-1 consumer, 4 candidate index source (layer 24). Engram tables are
cut to ``--engram-vocab`` (their row count does not change the per-token work).

Parity runs layer by layer: each attention block, MoE and Engram of the PyTorch path is run again
through the kernel path on the same inputs and a copy of the state (so one quantisation step flipped by
rounding cannot make the two models drift apart), under ``reference`` numerics (every op routed) and
``bf16`` numerics (attention, caches, indexer, Engram routed; linears are plain bf16 there). The
indexer's selections (top-k, and layer 20's candidate blocks, which the consumers then read from the
PyTorch path on both sides) are compared tie-aware against the PyTorch path's scores: rows equal,
equal up to ties at the cut score, and different. Reference numerics rounds the scores to bf16 (the
reference's einsum) and FP4 x FP4 dots take few values, so most long rows tie at the 512th score:
an exact comparison found 3618/6156 rows equal on the H200. At the real indexer width on a CPU
(random FP4 queries and keys, Triton interpreter) the kernel's scores equal the PyTorch path's bit for
bit, 35 of 64 rows have a tie straddling the 512th score, and the 28 rows whose sets differed all
differed only inside that tie. The streamed top-k breaks ties to the lower entry, as the PyTorch path
does.

Every prefill first runs one untimed chunk per new shape class (kernel tuners key on the power of two
above the entries a chunk scores), and a profiled prefill chunk runs once untimed at the same
position first, so the timings and shares are steady-state.

Decode runs eager; ``--decode-graphs`` also runs it through the tensor-only step
(``deepseek_v41/tensor_step.py``) captured in a CUDA graph, timed per replay and compared with the
eager step (that step's attention and indexer are PyTorch math, not the registry's span kernels), and
(unless ``--skip-profile``) profiled: ``--profile-steps`` eager steps and as many replays under torch.profiler,
device time per kernel and per step region, busy time against the replay's wall time (the launch gaps),
in the report's "Decode step profile" sections (``step_profile_v41``).
``--smoke`` runs every step at toy width on a CPU (kernel ops: their PyTorch references). The V4 cut
is ``benchmarks/e2e_cut.py``.

    python benchmarks/e2e_v41.py --out outputs/e2e_v41      (or: benchmarks/e2e_cut.py --model v41 ...)
    python benchmarks/e2e_v41.py --out outputs/e2e_v41_1m --prefill 32768,131072,1048576 --decode-batch '' \
        --decode-context '' --skip-parity --skip-profile --budget-s 540   # long prefills, up to 1M tokens
    python benchmarks/e2e_v41.py --out outputs/e2e_v41_dec --prefill '' --decode-context 8192,131072,1048576 \
        --decode-synthetic --decode-graphs --budget-s 300   # decode in graphs at 1M without the 1M prefill
    python benchmarks/e2e_v41.py --out outputs/e2e_v41_prof --prefill '' --decode-context 8192 --decode-batch 1,32 \
        --decode-synthetic --decode-graphs --skip-parity --profile-steps 10 --budget-s 240   # where a step's time goes

Each prefill is timed chunk by chunk (synchronised): the chunk times are fitted to ``a + b * start``
(``v41_prefill_profile.ChunkFit``; the indexer's scoring of every visible entry is the part that grows),
which projects the next context for the budget. The profiled chunk also gets a self-time breakdown by
region (registry ops and the PyTorch parts by function: ``v41_prefill_profile.region_shares``). Peak
memory is reported with and without the weights, and the global cache bytes per token against the cut's
expected value and scaled to V4.1-Flash's four kv sources (890 B/token).

Every case is skipped, with a note in the report, when its projected end passes ``--budget-s``.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import re
import sys
import time
from typing import Dict, List

import torch
from step_profile_v41 import format_views, step_views
from v41_prefill_profile import ChunkFit, cache_bytes, group_regions, region_shares

print = functools.partial(print, flush=True)  # noqa: A001  (progress unbuffered)

ROLES = dict(compress_ratios=[2, 2, 1, 1, 1], kv_source_layer_ids=[0, 2], index_source_layer_ids=[0, 2, 4],
             candidate_source_layer_id=2, engram_layer_ids=[0], num_nextn_predict_layers=0, num_hidden_layers=5)
SMOKE = dict(hidden_size=256, moe_intermediate_size=128, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
             q_lora_rank=64, o_lora_rank=64, o_groups=2, n_routed_experts=8, num_experts_per_tok=2,
             sliding_window=16, index_n_heads=4, index_head_dim=64, index_topk=8, candidate_topk_blocks=3,
             candidate_block_size=4, engram_n_heads=2, engram_head_dim=32, vocab_size=2048)
ATTENTION_OPS = ("cache_insert_mx", "sparse_attention_mx", "indexer_topk_mx", "indexer_source_mx", "engram_gather_mx")
H200_FP8_FLOPS, H200_BYTES_PER_S = 1451e12, 4.17e12
# Parity passes when: the cache bytes the ops wrote equal the PyTorch packing exactly (V41_OPS.md: bit-exact),
# every block's output is within a few bf16 ulps of its max (bf16 outputs, probabilities rounded to bf16
# before PV, sums in another order), and the indexer picked the same set up to ties on >= 95 % of rows.
# "Up to ties": the scores (under the PyTorch path) of the two sets are the same multiset, i.e. they differ
# only among entries tied at the cut score, whose order the contract leaves open (§3.5(d)). Under
# reference numerics the scores are bf16 (the reference's einsum): FP4 x FP4 dots rounded to 8 bits give
# few distinct values, so most long rows tie at the 512th score, and exact set equality is the wrong test.
# The rest ("different") are near-ties from an upstream rounding (below). Under reference numerics every
# FP8-quantised input inside a block (wq_b, wkv, wo_b, the experts) may round to the neighbouring e4m3 value
# (2^-4 relative) when its input differs by one bf16 ulp, hence the wider bound there.
PARITY_REL_TOL = {"bf16": 3e-2, "reference": 6e-2}
PARITY_TOPK_ROWS = 0.95


def cut_config(smoke: bool, engram_vocab: int):
    from redknot.models.deepseek_v41.config import V41Config

    over = dict(ROLES, engram_vocab_size=engram_vocab, engram_compressed_vocab_size=1027)
    if smoke:
        over.update(SMOKE)
    return V41Config().with_overrides(over)


def random_stored(cfg, device, include_draft: bool = False):
    """Random stored bytes per checkpoint tensor: FP8 e4m3 values with unit E8M0 scales (values ~1/sqrt(K)),
    MXFP4 random codes with a per-32 scale of the same spread (each layer's experts back to back in one
    stack, as the grouped kernel reads them), norms near 1, small mHC weights -> (backbone, draft) tensors
    (the draft empty unless ``include_draft``)."""
    from redknot.models.deepseek_v41.checkpoint import BF16, ENGRAM, F32, FP4, FP8, checkpoint_spec

    g = torch.Generator(device=device).manual_seed(0)
    main: Dict[str, torch.Tensor] = {}
    draft: Dict[str, torch.Tensor] = {}
    stacks: Dict[str, torch.Tensor] = {}
    for spec in checkpoint_spec(cfg, include_draft=include_draft):
        out, shape, name = (draft if spec.draft else main), spec.shape, spec.name
        if spec.kind == FP4:
            key = re.sub(r"\.experts\.\d+\.", ".experts.*.", name)
            if key not in stacks:
                n = cfg.dspark_n_routed_experts if spec.draft else cfg.n_routed_experts
                stacks[key] = torch.randint(0, 256, (n, *spec.stored_shape), generator=g, device=device,
                                            dtype=torch.uint8)
                e = 127 - round(math.log2(2.9 * math.sqrt(shape[-1])))
                stacks[key + "s"] = torch.full((n, *spec.scale_shape), e, dtype=torch.uint8, device=device)
            out[name] = stacks[key][spec.expert]
            out[spec.scale_name] = stacks[key + "s"][spec.expert]
        elif spec.kind in (FP8, ENGRAM):
            std = shape[-1] ** -0.5 if spec.kind == FP8 else 1.0
            out[name] = (torch.randn(shape, generator=g, device=device) * std).to(torch.float8_e4m3fn)
            out[spec.scale_name] = torch.full(spec.scale_shape, 127, dtype=torch.uint8, device=device)
        else:
            v = torch.randn(shape, generator=g, device=device)
            if name.endswith(("norm.weight", "q_weight", "k_weight")):
                v = 1 + 0.1 * v
            elif "hc_" in name:
                v = (0.5 + 0.1 * v) if name.endswith("_scale") else 0.05 * v
            elif name.endswith("attn_sink"):
                pass
            elif name == "embed.weight":
                v = 0.5 * v
            elif len(shape) > 1:
                v = v / math.sqrt(shape[-1])
            else:
                v = 0.1 * v
            out[name] = v.to(torch.bfloat16 if spec.kind == BF16 else torch.float32)
    return main, draft


def random_tensors(cfg, device) -> Dict[str, torch.Tensor]:
    """The backbone's tensors of :func:`random_stored`."""
    return random_stored(cfg, device)[0]


def build(cfg, tensors, numerics: str, ops, device):
    from redknot.models.deepseek_v41.model import DeepseekV41
    from redknot.models.deepseek_v41.ref_math import Numerics, Weights

    tmap = (torch.arange(cfg.vocab_size) * 7919) % cfg.engram_compressed_vocab_size
    w = Weights(dict(tensors), torch.bfloat16, keep=True)
    return DeepseekV41(cfg, w, tmap, int(tmap[cfg.engram_pad_id]), Numerics(numerics, torch.bfloat16),
                       device=device, ops=ops)


class Batch:
    """``b`` sequences of one model on a private paged state (sequence i: slot i, its own blocks)."""

    def __init__(self, model, b: int, max_tokens: int, block_size: int = 256):
        from redknot.models.deepseek_v41.state import allocate_state
        from redknot.models.deepseek_v41.state_layout import create_state_layout

        self.model, self.b = model, b
        self.layout = create_state_layout(model.cfg, block_size=block_size, max_backtrack=0)
        self.per = self.layout.blocks_for(max_tokens)
        # One spare slot and block last (the tensor-only step's padding target, as in the engine).
        self.state = allocate_state(model.cfg, self.layout, num_slots=b + 1, num_blocks=b * self.per + 1,
                                    device=model.device, dtype=torch.bfloat16)
        self.blocks = [list(range(i * self.per, (i + 1) * self.per)) for i in range(b)]
        self.lens = [0] * b

    def step(self, ids: List[List[int]], seqs=None) -> torch.Tensor:
        """New token ids of sequences ``seqs`` (default: all) -> pre-head rows."""
        from redknot.step.metadata import StepMetadata

        seqs = list(range(self.b)) if seqs is None else seqs
        n = sum(len(x) for x in ids)
        meta = StepMetadata.build([list(x) for x in ids], [self.lens[s] for s in seqs], seqs,
                                  [self.blocks[s] for s in seqs], list(range(n)), device=self.model.device)
        x = self.model.forward(meta, self.state)
        for s, x_ in zip(seqs, ids):
            self.lens[s] += len(x_)
        return x

    def clone_first(self) -> None:
        """Every sequence becomes a copy of sequence 0 (a batch of equal contexts without b prefills)."""
        st = self.state
        for i in range(1, self.b):
            for win in st.windows:
                win[i] = win[0]
            for src in st.sources.values():
                src.entries[self.blocks[i]] = src.entries[self.blocks[0]]
                src.keys[self.blocks[i]] = src.keys[self.blocks[0]]
                if src.kv_rows is not None:
                    src.kv_rows[i] = src.kv_rows[0]
                    src.gate_rows[i] = src.gate_rows[0]
            if st.engram_ids is not None:
                st.engram_ids[i] = st.engram_ids[0]
            self.lens[i] = self.lens[0]

    def global_cache_bytes(self, seq: int = 0) -> int:
        """Bytes of compressed entries + index keys in the pages sequence ``seq`` has filled."""
        blocks = self.layout.blocks_for(self.lens[seq])
        per_block = sum(src.entries[0].numel() + src.keys[0].numel() for src in self.state.sources.values())
        return blocks * per_block


def fill_synthetic(b: Batch, ctx: int, seed: int = 0, pool: int = 4096) -> None:
    """Every sequence of ``b`` at length ``ctx`` on caches of valid random bytes: rows packed from normal
    values by the stored formats' own packers (no NaN or out-of-range scale), tiled over every window slot
    and page; ratio-2 carry-over rows and Engram look-back ids random too. A decode step's work depends on
    the lengths and shapes, not on the values, so its timing equals a prefilled state's without the prefill
    (the indexer's selections differ, their cost does not)."""
    from redknot.kernels import mx_formats as mx

    cfg, dev = b.model.cfg, b.model.device
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rows(pack, dim):
        return pack(torch.randn(pool, dim, generator=g)).to(dev)

    def tile(dst: torch.Tensor, src: torch.Tensor) -> None:
        flat = dst.view(-1, dst.shape[-1])
        for s in range(0, flat.shape[0], 1 << 22):
            n = min(1 << 22, flat.shape[0] - s)
            flat[s:s + n] = src[torch.arange(s, s + n, device=dev) % pool]

    win = rows(mx.pack_window_rows, cfg.head_dim)
    ent = rows(mx.pack_compressed_entries, cfg.head_dim)
    key = rows(mx.pack_index_keys, cfg.index_head_dim)
    st = b.state
    for w in st.windows:
        tile(w, win)
    for src in st.sources.values():
        tile(src.entries, ent)
        tile(src.keys, key)
        for carry in (src.kv_rows, src.gate_rows):
            if carry is not None:
                carry.copy_(torch.randn(carry.shape, generator=g, dtype=carry.dtype))
    if st.engram_ids is not None:
        hi = int(b.model.token_map.max().item()) + 1 if b.model.token_map is not None else cfg.vocab_size
        st.engram_ids.copy_(torch.randint(0, hi, st.engram_ids.shape, generator=g))
    b.lens = [ctx] * b.b


def distinct_ids(base: int, n: int, vocab: int) -> List[int]:
    """``n`` different token ids from ``base``: every sequence of a decode batch feeds its own token, so the
    rows route to the experts independent rows would (one token for all cloned sequences would give
    identical rows routed to the same k experts, and a step that reads k experts' weights, not the distinct
    experts of the batch that the floor counts)."""
    return [(base + 7919 * i) % (vocab - 3) + 3 for i in range(n)]


def distinct_rows(base: int, n: int, vocab: int) -> List[List[int]]:
    return [[x] for x in distinct_ids(base, n, vocab)]


def graph_decode(b: Batch, bs: int, steps: int, device, profile: bool = False, profile_steps: int = 20,
                 profile_replay: bool = True) -> dict:
    """Decode of sequences 0..bs-1 through the tensor-only step (``deepseek_v41/tensor_step.py``): captured
    in a CUDA graph and replayed on a GPU, run as is on a CPU. The step's attention, indexer and
    compressor are PyTorch math (the registry's attention ops take host spans); linears and the MoE
    go through the registry. Parity: the replay against an eager step of the same rows (position-
    addressed writes, so running both at one position is harmless). ``profile``: also where the step's
    device time goes, ``profile_steps`` eager steps and as many replays under torch.profiler, against the
    replay's wall time (``step_profile_v41.step_views``; the replays only with ``profile_replay``)."""
    from redknot.models.deepseek_v41.tensor_step import TensorStep, tensor_forward

    dev = b.model.device
    seqs = list(range(bs))
    ids = distinct_ids(11, bs, b.model.cfg.vocab_size)
    step = TensorStep(torch.tensor(ids, dtype=torch.long, device=dev),
                      torch.tensor([b.lens[s] for s in seqs], dtype=torch.long, device=dev),
                      torch.arange(bs + 1, dtype=torch.int32, device=dev),
                      torch.arange(bs, dtype=torch.int32, device=dev),
                      torch.tensor([b.blocks[s] for s in seqs], dtype=torch.int32, device=dev))
    try:
        out = tensor_forward(b.model, step, b.state)     # warm-up (weight caches, tuning)
        sync(device)
        graph = None
        if device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = tensor_forward(b.model, step, b.state)
            graph.replay()
        else:
            out = tensor_forward(b.model, step, b.state)
        sync(device)
        got = out.float().clone()
        want = b.step([[x] for x in ids], seqs=seqs).float()
        for s in seqs:
            b.lens[s] -= 1
        rel = ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-30)).max().item()
        sync(device)
        t = time.perf_counter()
        for _ in range(steps):
            if graph is not None:
                graph.replay()
            else:
                tensor_forward(b.model, step, b.state)
        sync(device)
        ms = (time.perf_counter() - t) / steps * 1e3
        views = None
        if profile:
            def eager():
                return tensor_forward(b.model, step, b.state)
            replay = (graph.replay if graph is not None else eager) if profile_replay else None
            views = step_views(eager, replay, device, profile_steps, ms)
        del graph, out
    except RuntimeError as exc:   # capture refused (a host sync in a routed op) or out of memory
        return {"graph": f"failed: {str(exc).splitlines()[0][:200]}"}
    return {"graph": "captured" if device.type == "cuda" else "tensor-only step, not captured (CPU)",
            "graph_ms_per_step": ms, "graph_rel_err": rel, **({"step_views": views} if views else {})}


def warm_classes(model, ctx: int, chunk: int, device, warmed: set) -> None:
    """Run one chunk at the first start of every shape class a prefill to ``ctx`` meets and ``warmed``
    does not hold yet, so JIT compilation and tuning stay out of the timings. Kernel tuners key on the
    power of two above the number of cached entries a chunk scores, so a chunk at start s stands for
    every chunk whose entries round to the same powers of two (ratio 1 and 2). It runs at start s on
    an empty state (its length set, nothing prefilled): the caches read are zero bytes, the shapes
    those of the timed run. The indexer's stream tuner merges every entry count above 65536 into one
    class (``indexer_mx.STREAM_TUNE_ENTRIES``), so classes stop there too."""
    from redknot.kernels.triton.indexer_mx import STREAM_TUNE_ENTRIES

    cap = STREAM_TUNE_ENTRIES.bit_length()   # 17: every count above 65536
    starts = []
    for s in range(0, ctx, chunk):
        key = tuple(min(cap, (max(1, (s + chunk) // r) - 1).bit_length()) for r in (1, 2))   # log2 of the pow2s
        if key not in warmed:
            warmed.add(key)
            starts.append(s)
    if not starts:
        return
    w = Batch(model, 1, starts[-1] + chunk + 8)
    ids = tokens(chunk, model.cfg.vocab_size, 1)
    for s in starts:
        t = time.perf_counter()
        w.lens[0] = s
        w.step([ids])
        sync(device)
        print(f"warm-up chunk at {s}: {time.perf_counter() - t:.1f} s")
    del w


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tokens(n: int, vocab: int, seed: int) -> List[int]:
    return torch.randint(3, vocab - 3, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ------------------------------------------------------------------------------------------ parity
class Twins:
    """Wraps a PyTorch-path model so each block also runs on the kernel path with the same inputs."""

    def __init__(self, plain, routed):
        import redknot.models.deepseek_v41.model as model_mod

        self.mod = model_mod
        self.plain, self.routed = plain, routed
        self.err: Dict[str, float] = {}
        self.state_bytes = [0, 0]      # differing, compared
        # Selections compared per kind ("top-k": the indexer's entries, "candidate blocks": layer 20's
        # blocks): [rows equal, equal up to ties at the cut, compared, worst shortfall of a pick below the cut]
        self.sel: Dict[str, list] = {"top-k": [0, 0, 0, 0.0], "candidate blocks": [0, 0, 0, 0.0]}
        self.slots = None
        plain.attn = [self._attn(a, b) for a, b in zip(plain.attn, routed.attn)]

    def note(self, key: str, got: torch.Tensor, want: torch.Tensor) -> None:
        d = (got.float() - want.float()).abs().max().item()
        rel = d / max(want.float().abs().max().item(), 1e-30)
        a, r = self.err.get(key + " abs", 0.0), self.err.get(key + " rel", 0.0)
        self.err[key + " abs"], self.err[key + " rel"] = max(a, d), max(r, rel)

    def compare(self, kind: str, got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Rows [T] whose selected id sets (-1 pads) are equal. A row whose sets differ counts as equal
        up to ties when the PyTorch path's scores of both sets are the same multiset: the routed set is
        then a top-k of the same scores and differs only among ids tied at the cut score (whose order the
        op contract leaves open). The rest are truly different; the largest shortfall of a routed pick
        below the cut score, relative to it, is kept."""
        same = (got.sort(1).values == want.sort(1).values).all(1)
        ninf = torch.tensor(float("-inf"), device=scores.device)

        def picked(ids):   # scores of the picks, -inf for the -1 pads, descending
            v = scores.gather(1, ids.clamp(min=0).long())
            return torch.where(ids >= 0, v, ninf).sort(1, descending=True).values

        sg, sw = picked(got), picked(want)
        tie = (sg == sw).all(1) & ~same
        diff = ~same & ~tie
        acc = self.sel[kind]
        if bool(diff.any()):
            cut = sw.masked_fill(torch.isinf(sw), float("inf")).amin(1)          # the last finite picked score
            short = (cut[:, None] - sg).masked_fill(torch.isinf(sg), 0).clamp(min=0).amax(1)
            acc[3] = max(acc[3], float((short / cut.abs().clamp(min=1e-30))[diff].max()))
        acc[0] += int(same.sum())
        acc[1] += int(tie.sum())
        acc[2] += same.numel()
        return same

    @staticmethod
    def block_ids(mask: torch.Tensor, n_blocks: int, block: int) -> torch.Tensor:
        """The PyTorch path's candidate mask [T, n] (bool per entry) -> block ids [T, n_blocks] ascending, -1 pad."""
        keep = mask[:, ::block]
        ids = torch.arange(keep.shape[1], device=mask.device).expand_as(keep)
        big = torch.iinfo(torch.int32).max
        ids = torch.where(keep, ids, big).sort(1).values[:, :n_blocks]
        ids = torch.nn.functional.pad(ids, (0, max(0, n_blocks - ids.shape[1])), value=big)
        return torch.where(ids == big, -1, ids).to(torch.int32)

    @staticmethod
    def block_scores(scores: torch.Tensor, block: int) -> torch.Tensor:
        """Candidate-source entry scores [T, n] -> block scores (max; the newest visible block pinned to +inf)."""
        t, n = scores.shape
        nblk = -(-n // block)
        b = torch.nn.functional.pad(scores, (0, nblk * block - n), value=float("-inf")).view(t, nblk, block).amax(-1)
        vis = torch.isfinite(scores).sum(1)
        newest = ((vis - 1) // block).clamp(min=0)
        pin = (vis > 0)[:, None] & (torch.arange(nblk, device=scores.device)[None] == newest[:, None])
        return b.masked_fill(pin, float("inf"))

    def _attn(self, plain_layer, routed_layer):
        from redknot.models.deepseek_v41.attention import Slots

        def run(u, pos, spans, state, slots):
            if plain_layer.layer == 0:
                self.slots = Slots()
            mine = self.slots
            mine.topk = None if slots.topk is None else slots.topk.clone()
            st = copy.deepcopy(state)
            if slots.scores is None:
                slots.scores = {}   # the PyTorch indexer keeps the scores it selected from
            got = routed_layer(u, pos, spans, st, mine)
            want = plain_layer(u, pos, spans, state, slots)
            rows = slice(None)
            cfg, layer = plain_layer.cfg, plain_layer.layer
            if cfg.is_index_source(layer):
                scores = slots.scores.pop(layer)
                same = self.compare("top-k", mine.topk, slots.topk, scores)
                rows = same   # a row whose selection differs (a tie or a near-tie at the cut) is not compared
                if cfg.is_candidate_source(layer):
                    want_blocks = self.block_ids(slots.candidates, cfg.candidate_topk_blocks,
                                                 cfg.candidate_block_size)
                    self.compare("candidate blocks", mine.cand_blocks, want_blocks,
                                 self.block_scores(scores, cfg.candidate_block_size))
                    mine.cand_blocks = want_blocks   # the consumers read the same blocks on both paths
            if bool(torch.as_tensor(rows).any()) if not isinstance(rows, slice) else True:
                self.note(f"attention L{plain_layer.layer}", got[rows], want[rows])
            for a, b in zip(st.tensors(), state.tensors()):
                if a.dtype == torch.uint8:
                    self.state_bytes[0] += int((a != b).sum())
                    self.state_bytes[1] += a.numel()
            return want
        return run

    def __enter__(self):
        moe, engram = self.mod.moe_forward, self.mod.engram_forward
        self.saved = (moe, engram)
        rw = self.routed.w

        def moe_twin(u, w, layer, cfg, num):
            want = moe(u, w, layer, cfg, num)
            self.note(f"moe L{layer}", moe(u, rw, layer, cfg, num), want)
            return want

        def engram_twin(h, ids, w, layer, num, eps, token_mask=None):
            want = engram(h, ids, w, layer, num, eps, token_mask)
            self.note(f"engram L{layer}", engram(h, ids, rw, layer, num, eps, token_mask), want)
            return want

        self.mod.moe_forward, self.mod.engram_forward = moe_twin, engram_twin
        return self

    def __exit__(self, *exc):
        self.mod.moe_forward, self.mod.engram_forward = self.saved


def parity(cfg, tensors, kernels, device, n_tokens: int, chunk: int, numerics: str, route_all: bool) -> dict:
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    ops = V41Ops(kernels, route_all=route_all)
    plain = build(cfg, tensors, numerics, None, device)
    routed = build(cfg, tensors, numerics, ops, device)
    ids = tokens(n_tokens + 4, cfg.vocab_size, seed=7)
    t = time.perf_counter()
    with Twins(plain, routed) as tw:
        b = Batch(plain, 1, n_tokens + 8)
        for s in range(0, n_tokens, chunk):
            b.step([ids[s:min(n_tokens, s + chunk)]])
        for p in range(n_tokens, n_tokens + 4):
            b.step([[ids[p]]])
    sync(device)
    routed_ops = sorted(op for op, b_ in ops.choice.items() if b_ != "pytorch" and
                        not (numerics == "bf16" and op in ("linear_mx", "moe_mx")))
    worst = max((v for k, v in tw.err.items() if k.endswith("rel")), default=0.0)
    sel = {kind: {"equal": v[0], "equal_up_to_ties": v[1], "different": v[2] - v[0] - v[1], "rows": v[2],
                  "worst_shortfall_rel": v[3]} for kind, v in tw.sel.items()}
    top = sel["top-k"]
    ok = (tw.state_bytes[0] == 0 and worst <= PARITY_REL_TOL[numerics] and top["rows"] > 0
          and all(v["equal"] + v["equal_up_to_ties"] >= PARITY_TOPK_ROWS * v["rows"] for v in sel.values()))
    out = {"numerics": numerics, "ok": ok, "worst_rel": worst, "tokens": n_tokens, "chunk": chunk, "decode_steps": 4,
           "routed_ops": routed_ops,
           "errors": tw.err, "state_bytes_differing": tw.state_bytes[0], "state_bytes_compared": tw.state_bytes[1],
           "topk_rows_equal": top["equal"], "topk_rows": top["rows"], "selections": sel,
           "seconds": time.perf_counter() - t}
    return out


# ------------------------------------------------------------------------------------------ timing
def op_shares(fn, device, top: int = 12) -> List[dict]:
    """Device time by kernel (CPU time on a CPU) over one call of ``fn``; the largest ``top`` and the rest."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    rows = []
    for ev in prof.key_averages():
        t = ev.self_device_time_total if device.type == "cuda" else ev.self_cpu_time_total
        if t > 0:
            rows.append((ev.key, t, ev.count))
    total = sum(t for _, t, _ in rows) or 1.0
    rows.sort(key=lambda r: -r[1])
    out = [{"op": k[:80], "share": t / total, "ms": t / 1e3, "calls": c} for k, t, c in rows[:top]]
    rest = sum(t for _, t, _ in rows[top:])
    out.append({"op": "(rest)", "share": rest / total, "ms": rest / 1e3, "calls": sum(c for *_, c in rows[top:])})
    return out


def registry_shares(ops, fn, device) -> List[dict]:
    """Time of one call of ``fn`` by registry op (CUDA events around every routed op call, else wall
    time), and the rest of the step ("outside the registry ops": the PyTorch parts and launch gaps)."""
    from redknot.models.deepseek_v41.kernel_ops import OPS

    cuda = device.type == "cuda"
    marks: Dict[str, list] = {}
    saved = {op: getattr(ops, op) for op in OPS if getattr(ops, op) is not None}

    def timed(op, impl):
        def call(*args, **kw):
            if cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out = impl(*args, **kw)
                b.record()
                marks.setdefault(op, []).append((a, b))
            else:
                t = time.perf_counter()
                out = impl(*args, **kw)
                marks.setdefault(op, []).append(time.perf_counter() - t)
            return out
        return call

    for op, impl in saved.items():
        setattr(ops, op, timed(op, impl))
    try:
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        total = (time.perf_counter() - t) * 1e3
    finally:
        for op, impl in saved.items():
            setattr(ops, op, impl)
    rows = []
    for op, ms in marks.items():
        ms = sum(a.elapsed_time(b) for a, b in ms) if cuda else sum(ms) * 1e3
        rows.append({"op": op, "ms": ms, "share": ms / total, "calls": len(marks[op])})
    rows.sort(key=lambda r: -r["ms"])
    rest = total - sum(r["ms"] for r in rows)
    rows.append({"op": "(outside the registry ops)", "ms": rest, "share": rest / total, "calls": 0})
    rows.append({"op": "(step, wall)", "ms": total, "share": 1.0, "calls": 1})
    return rows


def decode_floor_s(cfg, ctx: int, batch: int) -> float:
    """Bandwidth/FLOP floor of one decode step of ``batch`` sequences at ``ctx``: the cost model's batch-1
    bytes, the per-sequence caches times the batch, and the extra routed experts a batch touches
    (expected distinct experts of batch*k uniform picks)."""
    from redknot.models.deepseek_v41.cost import CostModel

    d = CostModel(cfg).decode(ctx)
    e, k = cfg.n_routed_experts, cfg.n_activated_experts
    distinct = e * (1 - (1 - k / e) ** batch)
    per_expert = 3 * cfg.dim * cfg.moe_inter_dim * (0.5 + 1 / 32)
    extra = max(0.0, distinct - k) * per_expert * cfg.n_layers
    nbytes = d.weight_bytes + extra + batch * (d.kv_bytes + d.engram_bytes)
    return max(nbytes / H200_BYTES_PER_S, batch * d.flops / H200_FP8_FLOPS)


def prefill_floor_s(cfg, ctx: int) -> float:
    from redknot.models.deepseek_v41.cost import CostModel

    p = CostModel(cfg).prefill(ctx)
    bf16 = 796e12   # window / compressed attention run at the bf16 rate (cost model's split)
    return (p.linear + p.indexer) / H200_FP8_FLOPS + (p.window + p.compressed) / bf16


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="DeepSeek-V4.1 real-dimension cut (kernel path)")
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/e2e_v41"),
                    help="directory for e2e_v41.json / e2e_v41.md (default $OUT, else outputs/e2e_v41)")
    ap.add_argument("--smoke", action="store_true", help="toy width on the CPU (kernel ops: references)")
    ap.add_argument("--prefill", default="8192,32768,131072", help="contexts to prefill, ascending ('' skips)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--decode-batch", default="1,32,128", help="decode batches ('' skips)")
    ap.add_argument("--decode-context", default="8192,131072", help="decode contexts (each <= a prefilled one)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=2048)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--backend", default=None,
                    help="kernel backend of the V4.1 ops (default: triton on a GPU, reference with --smoke; "
                         "--smoke --backend triton runs the Triton kernels in Triton's CPU interpreter)")
    ap.add_argument("--engram-vocab", type=int, default=100000)
    ap.add_argument("--decode-synthetic", action="store_true",
                    help="decode contexts that no --prefill reaches run on a synthetic state (valid random cache "
                         "bytes, see fill_synthetic): CUDA-graph rows only, no prefill needed")
    ap.add_argument("--decode-graphs", action="store_true",
                    help="also time decode through the tensor-only step captured in a CUDA graph (its "
                         "attention/indexer are PyTorch math), with its error against the eager step")
    ap.add_argument("--profile-steps", type=int, default=20,
                    help="with --decode-graphs: eager steps and graph replays under torch.profiler per decode row "
                         "(step_profile_v41: device time by kernel and region, busy time vs the replay's wall)")
    ap.add_argument("--skip-replay-profile", action="store_true",
                    help="profile the eager steps only, not the graph replays (a profiler that fails on graphs)")
    ap.add_argument("--budget-s", type=float, default=320.0,
                    help="skip a prefill/decode case whose projected end passes this many seconds")
    a = ap.parse_args(argv)
    from redknot.kernels import KernelSet
    from redknot.models.deepseek_v41.cost import global_kv_bytes_per_token
    from redknot.models.deepseek_v41.kernel_ops import V41Ops

    t_start = time.perf_counter()
    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        torch.set_num_threads(1)   # toy shapes: a second thread only contends with whatever else runs
        smoke_prefill = a.prefill if a.prefill != ap.get_default("prefill") else "40"   # toy contexts may be given
        a.prefill, a.chunk, a.parity_tokens, a.decode_steps, a.engram_vocab = smoke_prefill, 32, 40, 1, 100
        a.decode_batch, a.decode_context, a.profile_steps = "1,3", "40", min(a.profile_steps, 2)
    cfg = cut_config(a.smoke, a.engram_vocab)
    backend = a.backend or ("reference" if a.smoke else "triton")
    if a.smoke and backend == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    kernels = KernelSet(default=backend)
    ops = V41Ops(kernels, route_all=backend == "reference")
    print(f"e2e_v41: device={device} ops={ops.choice}")
    tensors = random_tensors(cfg, device)
    wbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"weights {wbytes / 2**30:.2f} GiB ({time.perf_counter() - t_start:.1f} s)")
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "smoke": a.smoke,
              "ops": ops.choice, "weights_gib": wbytes / 2**30,
              "cut": "L0 ratio-2 kv/index source + Engram, L1 ratio-2 consumer, L2 ratio-1 candidate source, "
                     "L3 ratio-1 consumer, L4 candidate index source; 384 experts top-6" if not a.smoke else "toy",
              "ceilings": {"fp8_flops": H200_FP8_FLOPS, "bytes_per_s": H200_BYTES_PER_S},
              "parity": [], "prefill": [], "decode": [], "profile": {}, "op_shares": {},
              "decode_mode": ("eager, and the tensor-only step in CUDA graphs (--decode-graphs)" if a.decode_graphs
                              else "eager (--decode-graphs adds the tensor-only step in CUDA graphs)"),
              "expected_global_cache_bytes_per_token": global_kv_bytes_per_token(cfg)}

    def over_budget(projected: float) -> bool:
        return time.perf_counter() - t_start + projected > a.budget_s

    if not a.skip_parity:
        for numerics in ("reference", "bf16"):
            p = parity(cfg, tensors, kernels, device, a.parity_tokens, min(a.chunk, 1024 if not a.smoke else 32),
                       numerics, backend == "reference")
            worst = max((v for k, v in p["errors"].items() if k.endswith("rel")), default=0.0)
            print(f"parity {numerics}: {'ok' if p['ok'] else 'FAILED'}, worst block rel err {worst:.3g}, "
                  f"state bytes differing "
                  f"{p['state_bytes_differing']}/{p['state_bytes_compared']}; " + "; ".join(
                      f"{kind} rows of {v['rows']}: {v['equal']} equal, {v['equal_up_to_ties']} equal up to ties at "
                      f"the cut, {v['different']} different (worst shortfall {v['worst_shortfall_rel']:.2g})"
                      for kind, v in p["selections"].items()) + f" ({p['seconds']:.1f} s)")
            report["parity"].append(p)
    model = build(cfg, tensors, "reference", ops, device)   # timed: reference numerics, routed ops
    ctxs = [int(c) for c in a.prefill.split(",") if c]
    warmed: set = set()   # shape classes compiled and tuned (see warm_classes)
    dctx = {int(c) for c in a.decode_context.split(",") if c}
    batches = [int(x) for x in a.decode_batch.split(",") if x]
    last = None
    profiles = [1 if a.smoke else 100]   # the CPU profiler is slow to start: one profile in a smoke run
    fit = ChunkFit()   # per-chunk seconds = a + b * start, over the chunks of the last timed prefill

    def decode_rows(b, ctx: int, eager: bool) -> None:
        """Decode rows at context ``ctx`` for every batch: eager (``eager``) and through the CUDA-graph step."""
        for bs in batches:
            if over_budget(10 + a.decode_steps * bs * 0.01):
                print(f"decode ctx {ctx} batch {bs}: skipped (budget)")
                report["decode"].append({"context": ctx, "batch": bs, "skipped": "budget"})
                continue
            seqs = list(range(bs))
            floor_ms = decode_floor_s(cfg, ctx, bs) * 1e3
            if not eager:   # a synthetic state: the graph only (one eager step checks its replay)
                report["decode"].append({"context": ctx, "batch": bs, "ms_per_step": None, "floor_ms": floor_ms,
                                         "fraction_of_floor": None, "state": "synthetic"})
            else:
                b.step(distinct_rows(5, bs, cfg.vocab_size), seqs=seqs)   # warm-up
                sync(device)
                t = time.perf_counter()
                for i in range(a.decode_steps):
                    b.step(distinct_rows(7 + i, bs, cfg.vocab_size), seqs=seqs)
                sync(device)
                ms = (time.perf_counter() - t) / a.decode_steps * 1e3
                print(f"decode ctx {ctx} batch {bs}: {ms:.2f} ms/step eager ({100 * floor_ms / ms:.1f} % of the "
                      f"floor {floor_ms:.3f} ms)")
                report["decode"].append({"context": ctx, "batch": bs, "ms_per_step": ms, "floor_ms": floor_ms,
                                         "fraction_of_floor": floor_ms / ms})
            if a.decode_graphs and not over_budget(10 + a.decode_steps * bs * 0.01):
                g = graph_decode(b, bs, a.decode_steps, device, profile=not a.skip_profile,
                                 profile_steps=a.profile_steps, profile_replay=not a.skip_replay_profile)
                report["decode"][-1].update(g)
                if "graph_ms_per_step" in g:
                    print(f"decode ctx {ctx} batch {bs}: {g['graph_ms_per_step']:.2f} ms/step {g['graph']} "
                          f"({100 * floor_ms / g['graph_ms_per_step']:.1f} % of the floor), rel err vs "
                          f"eager {g['graph_rel_err']:.2e}")
                else:
                    print(f"decode ctx {ctx} batch {bs}: graph {g['graph']}")
                for view, v in g.get("step_views", {}).items():
                    print(f"decode ctx {ctx} batch {bs}: {view} profile: " + (v["error"] if "error" in v else
                          f"{v['launches_per_step']:.0f} launches/step, busy {v['busy_ms_per_step']:.3f} ms/step, "
                          f"replay wall - busy {v['gap_ms_per_step']:.3f} ms/step ({v['kind']})"))
            if eager and not a.skip_profile and not over_budget(10):
                report["op_shares"][f"decode b{bs} at {ctx}"] = registry_shares(
                    ops, lambda: b.step(distinct_rows(8, bs, cfg.vocab_size), seqs=seqs), device)
            if eager and not a.skip_profile and not over_budget(10) and profiles[0]:
                profiles[0] -= 1
                report["profile"][f"decode b{bs} at {ctx}"] = op_shares(
                    lambda: b.step(distinct_rows(9, bs, cfg.vocab_size), seqs=seqs), device)

    for ctx in ctxs:
        proj = None
        if last is not None:
            proj = fit.prefill(ctx, a.chunk)
            # The untimed warm-up chunks of its new shape classes (one per power of two of the entries,
            # each tuned a few times) stay below half of it.
            if over_budget(1.5 * proj + 20):
                print(f"prefill {ctx}: skipped (projected {proj:.0f} s from the chunk fit passes --budget-s)")
                report["prefill"].append({"context": ctx, "skipped": f"projected {proj:.0f} s"})
                continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t_w = time.perf_counter()
        warm_classes(model, ctx, a.chunk, device, warmed)   # JIT + tuning of its chunk shapes, untimed
        warm_s = time.perf_counter() - t_w
        peak_warm = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()   # the prefill's own peak (tuners allocate while they time)
        print(f"warm-up for {ctx} done ({warm_s:.1f} s; at {time.perf_counter() - t_start:.1f} s)")
        nseq = max(batches) if ctx in dctx and batches else 1
        b = Batch(model, nseq, ctx + 2 * a.chunk + (a.decode_steps + 4) * (len(batches) + 1) + 64)
        ids = tokens(ctx, cfg.vocab_size, seed=ctx)
        sync(device)
        t = time.perf_counter()
        points = []   # (chunk start, seconds): synchronised per chunk, so the growth with context shows
        for s in range(0, ctx, a.chunk):
            t_c = time.perf_counter()
            b.step([ids[s:min(ctx, s + a.chunk)]], seqs=[0])
            sync(device)
            points.append((s, time.perf_counter() - t_c))
        dt = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        floor = prefill_floor_s(cfg, ctx)
        full = [p for p in points if p[0] + a.chunk <= ctx]
        fit = ChunkFit.fit(full or points)
        cb = cache_bytes(b.state, b.layout, ctx, cfg)
        row = {"context": ctx, "chunk": a.chunk, "seconds": dt, "tokens_per_s": ctx / dt, "peak_gib": peak,
               "peak_above_weights_gib": peak - wbytes / 2**30 if device.type == "cuda" else 0.0,
               "warm_up_s": warm_s, "warm_up_peak_gib": peak_warm,
               "state_slots": nseq, "floor_s": floor, "fraction_of_floor": floor / dt,
               "global_cache_bytes_per_token": b.global_cache_bytes() / ctx, "cache_bytes": cb,
               "window_ring_bytes_per_sequence": sum(w[0].numel() for w in b.state.windows),
               "chunk_seconds": [[p, round(x, 5)] for p, x in points], "chunk_fit": fit.as_dict(),
               "projected_s": proj}   # from the previous context's chunk fit (None for the first)
        print(f"prefill {ctx}: {dt:.3f} s ({ctx / dt:.0f} tok/s, {100 * floor / dt:.1f} % of the floor), peak "
              f"{peak:.1f} GiB, global cache {row['global_cache_bytes_per_token']:.1f} B/token (cut expected "
              f"{cb['expected_cut_bytes_per_token']:.1f}; V4.1-Flash "
              f"{'n/a' if cb['v41_flash_bytes_per_token'] is None else format(cb['v41_flash_bytes_per_token'], '.1f')} "
              f"of {cb['v41_flash_expected']:.0f}); chunk s = {fit.a:.4f} + {fit.b * 1e6:.4f}e-6 * start "
              f"(first {points[0][1]:.3f} s, last {points[-1][1]:.3f} s)"
              + ("" if proj is None else f"; projected from the previous fit {proj:.2f} s"))
        report["prefill"].append(row)
        last = (ctx, dt)
        if ctx in dctx and batches:
            b.clone_first()
            decode_rows(b, ctx, eager=True)
        if not a.skip_profile and not over_budget(3 * dt * a.chunk / ctx + 10):
            # One chunk at one position, run three times (the lengths rolled back after each): once to
            # compile and tune its shapes, then under the registry-op timer, then under the profiler.
            chunk_ids = tokens(a.chunk, cfg.vocab_size, 4)

            def chunk():
                b.step([chunk_ids], seqs=[0])
                b.lens[0] -= a.chunk

            chunk()
            sync(device)
            name = f"prefill chunk {a.chunk} after {ctx}"
            report["op_shares"][name] = registry_shares(ops, chunk, device)
            regions = region_shares(chunk, device, ops)
            report.setdefault("regions", {})[name] = regions
            report.setdefault("region_groups", {})[name] = group_regions(regions)
            from v41_prefill_profile import rows_ab

            ab = report.setdefault("prefill_rows_ab", {})[name] = rows_ab(chunk, device)
            print(f"{name}: {ab['unfused_ms']:.1f} ms without the prefill row fusions, {ab['fused_ms']:.1f} ms "
                  f"with them; saving of each: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ab["saving_ms"].items()))
            if profiles[0] and not over_budget(dt * a.chunk / ctx + 10):
                profiles[0] -= 1
                report["profile"][name] = op_shares(chunk, device)
        del b
    for ctx in sorted(dctx - set(ctxs)) if a.decode_synthetic and batches else []:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        t_s = time.perf_counter()
        b = Batch(model, max(batches), ctx + (a.decode_steps + 4) * (len(batches) + 1) + 64)
        fill_synthetic(b, ctx, seed=ctx)
        sync(device)
        print(f"synthetic state at {ctx} for {max(batches)} sequences ({time.perf_counter() - t_s:.1f} s)")
        decode_rows(b, ctx, eager=False)
        del b
    report["seconds"] = time.perf_counter() - t_start
    write(report, a.out)
    return report


def write(report: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "e2e_v41.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    lines = ["# DeepSeek-V4.1 real-dimension cut", "", f"device: {report['device']}; cut: {report['cut']}",
             f"ops: {report['ops']}", f"decode: {report['decode_mode']}", "", "## Parity (block by block)", "",
             "| numerics | ok | routed | worst rel err | state bytes differing | top-k rows: equal / equal up to ties "
             "/ different of all (worst shortfall) | candidate-block rows: the same |",
             "|---|---|---|---|---|---|---|"]
    for p in report["parity"]:
        worst = max((v for k, v in p["errors"].items() if k.endswith("rel")), default=0.0)
        lines.append(f"| {p['numerics']} | {p['ok']} | {', '.join(p['routed_ops'])} | {worst:.3g} | "
                     f"{p['state_bytes_differing']}/{p['state_bytes_compared']} | "
                     + " | ".join(f"{v['equal']} / {v['equal_up_to_ties']} / {v['different']} of {v['rows']} "
                                  f"({v['worst_shortfall_rel']:.2g})" for v in p["selections"].values()) + " |")
    for p in report["parity"]:
        lines += ["", f"{p['numerics']}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(p["errors"].items()))]
    lines += ["", "## Prefill", "", "| context | s (projected from the previous context's chunk fit) | tok/s | "
              "% of floor | peak GiB (above weights) | global cache "
              "B/token (V4.1-Flash scaled) | chunk s: first / last | chunk fit a s + b s/token |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["prefill"]:
        if "skipped" in r:
            lines.append(f"| {r['context']} | skipped: {r['skipped']} | | | | | | |")
            continue
        cb, cs, fit = r.get("cache_bytes", {}), r.get("chunk_seconds") or [[0, 0.0]], r.get("chunk_fit", {})
        flash = cb.get("v41_flash_bytes_per_token")
        flash = "n/a" if flash is None else f"{flash:.1f}"
        pj = "" if r.get("projected_s") is None else f" ({r['projected_s']:.2f})"
        lines.append(f"| {r['context']} | {r['seconds']:.3f}{pj} | {r['tokens_per_s']:.0f} | "
                     f"{100 * r['fraction_of_floor']:.1f} | {r['peak_gib']:.1f} "
                     f"({r.get('peak_above_weights_gib', 0.0):.1f}) | {r['global_cache_bytes_per_token']:.1f} "
                     f"({flash}) | {cs[0][1]:.3f} / {cs[-1][1]:.3f} | "
                     f"{fit.get('a_s', 0.0):.4f} + {fit.get('b_s_per_token', 0.0):.3g} |")
    lines += ["", "expected global cache bytes/token for this cut: "
              f"{report['expected_global_cache_bytes_per_token']:.1f} (V4.1-Flash: 890)", "", "## Decode (eager)", "",
              "| context | batch | ms/step | floor ms | % of floor |", "|---|---|---|---|---|"]
    for r in report["decode"]:
        if "skipped" in r:
            lines.append(f"| {r['context']} | {r['batch']} | skipped | | |")
            continue
        if r["ms_per_step"] is None:
            lines.append(f"| {r['context']} | {r['batch']} (synthetic state) | graph only | {r['floor_ms']:.3f} | |")
        else:
            lines.append(f"| {r['context']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['floor_ms']:.3f} | "
                         f"{100 * r['fraction_of_floor']:.1f} |")
        if "graph_ms_per_step" in r:
            lines.append(f"| {r['context']} | {r['batch']} (graph, rel err {r['graph_rel_err']:.1e}) | "
                         f"{r['graph_ms_per_step']:.2f} | {r['floor_ms']:.3f} | "
                         f"{100 * r['floor_ms'] / r['graph_ms_per_step']:.1f} |")
        elif "graph" in r:
            lines.append(f"| {r['context']} | {r['batch']} (graph) | {r['graph']} | | |")
    for r in report["decode"]:
        if r.get("step_views"):
            lines += format_views(r["step_views"], f"tensor step, decode b{r['batch']} at {r['context']}")
    for name, rows in report["op_shares"].items():
        lines += ["", f"## Registry ops: {name}", "", "| op | share | ms | calls |", "|---|---|---|---|"]
        lines += [f"| {r['op']} | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['calls']} |" for r in rows]
    for name, rows in report.get("region_groups", {}).items():
        lines += ["", f"## Regions (grouped): {name}", "", "| group | share | ms |", "|---|---|---|"]
        lines += [f"| {r['group']} | {100 * r['share']:.1f} % | {r['ms']:.3f} |" for r in rows]
    for name, rows in report.get("regions", {}).items():
        lines += ["", f"## Regions (self time): {name}", "", "| region | share | ms | calls |", "|---|---|---|---|"]
        lines += [f"| {r['region']} | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['calls']} |" for r in rows]
    for name, ab in report.get("prefill_rows_ab", {}).items():
        lines += ["", (f"{name}: {ab['unfused_ms']:.2f} ms without the prefill row fusions, {ab['fused_ms']:.2f} ms "
                       f"with them; saving of each (all on but that one, less all on): "
                       + ", ".join(f"{k} {v:.2f} ms" for k, v in ab["saving_ms"].items()))]
    for name, rows in report["profile"].items():
        lines += ["", f"## Time shares: {name}", "", "| kernel / op | share | ms | calls |", "|---|---|---|---|"]
        lines += [f"| `{r['op']}` | {100 * r['share']:.1f} % | {r['ms']:.3f} | {r['calls']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "e2e_v41.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
    sys.exit(0)
