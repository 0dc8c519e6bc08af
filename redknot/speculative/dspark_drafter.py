"""DSpark drafting in the engine (reference dspark.md §7.2-7.3): fill the stages' rings from the
target's taps, then draft one block per request.

After every target step, each request's *committed* rows of the step (a prefill chunk's rows;
for a verify step the anchor and the accepted drafts, positions P..P+tau) have their taps turned
into context K/V and written into every stage's window ring at ``pos % W``. Rejected rows write
nothing, so the rings never need a rollback, and a position is read (by a block at anchor
position > pos) only after it was committed. A request that sampled then drafts the whole
trained block from its new anchor: one parallel forward of all drafting requests, the Markov
chain with drafting-time sampling (:class:`MarkovSampler`), and the confidence of every slot
``sigmoid(logit_k / T_k)`` (per-position STS temperatures from ``features.dspark.sts_path``;
``features.dspark.confidence_activation`` picks the activation, ``block_attention`` the block's
attention pattern; dspark.md §2.3, §8 item 3).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from redknot.config.schema import BlockAttention, ConfidenceActivation, DraftSampling
from redknot.speculative.draft_sampling import MarkovSampler
from redknot.speculative.drafter import Draft
from redknot.speculative.schedule import draft_limit


def load_sts(path: Optional[str], block_size: int) -> List[float]:
    """Per-position confidence temperatures from ``features.dspark.sts_path`` (identity when None).
    The file is JSON with ``sts_temperatures`` (or ``temperatures``): one positive number per slot."""
    if not path:
        return [1.0] * block_size
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        temps = data.get("sts_temperatures", data.get("temperatures")) if isinstance(data, dict) else data
        temps = [float(t) for t in temps]
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"features.dspark.sts_path={path}: not a temperature file ({err}); expected JSON "
                         f'{{"sts_temperatures": [t_1, ..., t_{block_size}]}}') from err
    if len(temps) != block_size or any(not t > 0 for t in temps):
        raise ValueError(f"features.dspark.sts_path={path}: needs {block_size} positive temperatures (one per draft "
                         f"position of the checkpoint's block), got {temps}")
    return temps


def _choice(enum, key: str, value):
    """``value`` as ``enum``; a bad value names the key, the value and the allowed values."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"features.dspark.{key}={value!r}: allowed values are "
                         f"{[e.value for e in enum]}") from None


def confidence_probs(logits: torch.Tensor, temperatures: torch.Tensor, activation) -> torch.Tensor:
    """Survival probabilities of the raw confidence logits [B, g] over per-position temperatures [g]:
    ``sigmoid(z/T)`` (vLLM, SGLang) or ``clamp(z/T, 0, 1)`` (``features.dspark.confidence_activation``)."""
    z = logits.float() / temperatures
    if ConfidenceActivation(activation) == ConfidenceActivation.clamp:
        return z.clamp(0.0, 1.0)
    return torch.sigmoid(z)


@dataclass
class _Req:
    """One request's part of the step."""
    req_id: str
    slot: int
    rows: List[int]          # step rows of its committed positions written to the rings
    positions: List[int]
    anchor: Optional[int] = None
    anchor_pos: int = 0
    limit: int = 0
    row: object = None       # its sampling row (params, seed)


class DSparkDrafter:
    """Rings + block drafting over a DSpark draft model (``redknot.models.family.DSPARK``)."""

    def __init__(self, draft, state, sampler, features, max_model_len: int, replay=None) -> None:
        cfg = features.dspark
        self.draft = draft
        self.block_size = draft.block_size
        if replay is not None and draft.compact_replay_skips_taps():
            raise ValueError(f"features.swa_replay.mode=compact skips early rows of window-only top layers, but the "
                             f"DSpark stages tap layers {list(draft.dcfg.target_layer_ids)} among them; set "
                             f"features.swa_replay.mode=off")
        if cfg.max_draft > self.block_size:
            raise ValueError(f"features.dspark.max_draft={cfg.max_draft} exceeds the checkpoint's dspark_block_size="
                             f"{self.block_size}: drafting always runs the trained block, max_draft only caps how "
                             f"many of its drafts are verified; set features.dspark.max_draft <= {self.block_size}")
        self.max_draft, self.max_model_len = cfg.max_draft, max_model_len
        self.sampler = MarkovSampler(sampler, cfg.draft_sampling)
        self.probabilistic = self.sampler.mode == DraftSampling.probabilistic  # sampled requests keep q
        self.temperatures = torch.tensor(load_sts(cfg.sts_path, self.block_size), dtype=torch.float32,
                                         device=draft.device)
        self.causal = _choice(BlockAttention, "block_attention", cfg.block_attention) == BlockAttention.causal
        self.activation = _choice(ConfidenceActivation, "confidence_activation", cfg.confidence_activation)
        spec = getattr(draft, "ring_spec", None)  # a family whose state has no float window cache says
        hd, dtype = spec(state) if spec is not None else (state.layers[0].swa.shape[-1], state.layers[0].swa.dtype)
        ring = dict(dtype=dtype, device=draft.device)
        # One window ring of context K/V per stage and slot (the state's slots incl. graph padding).
        self.rings = [torch.zeros(state.num_slots, draft.window, hd, **ring) for _ in range(draft.dcfg.num_stages)]
        self.num_mtp_rows = 0   # ring rows written (context K/V)
        self.num_drafted = 0
        self.num_steps = 0
        self.graphs = None      # DraftGraphs: the block forward replayed per batch tier (use_graphs)

    def use_graphs(self, capture, max_num_seqs: int, padding_slot: int, pool=None):
        """Draft through :class:`redknot.speculative.draft_graphs.DraftGraphs` recorded with ``capture``
        (captured by :meth:`capture_graphs`, e.g. at the engine's warm-up) -> the graphs."""
        from redknot.speculative.draft_graphs import DraftGraphs

        self.graphs = DraftGraphs(self.draft, self.rings, self.causal, max_num_seqs, padding_slot, capture, pool)
        return self.graphs

    def capture_graphs(self, pool=None):
        """Capture the draft graphs (sharing ``pool``) -> the pool they use (None without graphs)."""
        if self.graphs is None:
            return pool
        if pool is not None and not self.graphs.graphs:
            self.graphs.pool = pool
        self.graphs.capture()
        return self.graphs.pool

    def _forward_block(self, anchors: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
        """(h [B, g, D], base logits [B, g, V]) of the drafting requests: a graph replay when one holds B."""
        if self.graphs is not None:
            return self.graphs.forward_block(anchors, positions, slots)
        return self.draft.forward_block(anchors, positions, self.rings, slots, self.causal)

    # ------------------------------------------------------------------ one step
    def propose(self, batch, streams: torch.Tensor, sampled: Dict[str, List[int]]) -> Dict[str, Draft]:
        reqs = self._plan(batch, sampled)
        if not reqs:
            return {}
        self.num_steps += 1
        self.write_context(streams.shape[0], [r.slot for r in reqs for _ in r.rows],
                           [p for r in reqs for p in r.positions], [x for r in reqs for x in r.rows])
        drafting = [r for r in reqs if r.limit > 0]
        return self.draft_blocks(drafting) if drafting else {}

    def write_context(self, num_rows: int, slots: Sequence[int], positions: Sequence[int], rows: Sequence[int]) -> None:
        """Ring rows of committed positions from the taps of the target's last forward."""
        computed = getattr(self.draft, "computed_rows", None)  # bounded replay: tail layers' taps on late rows
        if computed is not None and rows:
            ok = computed(num_rows).tolist()
            kept = [k for k, r in enumerate(rows) if ok[r]]
            slots, positions, rows = [slots[k] for k in kept], [positions[k] for k in kept], [rows[k] for k in kept]
        if not rows:
            return
        device = self.draft.device
        taps = self.draft.last_taps(num_rows)[torch.tensor(list(rows), dtype=torch.long, device=device)]
        pos = torch.tensor(list(positions), dtype=torch.long, device=device)
        kv = self.draft.context_kv(taps, pos)  # [stages, R, hd]
        flat = torch.tensor(list(slots), dtype=torch.long, device=device) * self.draft.window + pos % self.draft.window
        for ring, rows_kv in zip(self.rings, kv):
            ring.view(-1, ring.shape[-1]).index_copy_(0, flat, rows_kv.to(ring.dtype))
        self.num_mtp_rows += len(rows)

    def draft_blocks(self, reqs: List[_Req]) -> Dict[str, Draft]:
        device = self.draft.device
        anchors = torch.tensor([r.anchor for r in reqs], dtype=torch.long, device=device)
        positions = torch.tensor([r.anchor_pos for r in reqs], dtype=torch.long, device=device)
        slots = torch.tensor([r.slot for r in reqs], dtype=torch.long, device=device)
        h, base = self._forward_block(anchors, positions, slots)  # [B, g, D], [B, g, V]
        blocks = self.sampler.sample(base, self.draft.markov_bias, anchors, [r.row for r in reqs],
                                     [r.anchor_pos + 1 for r in reqs])
        tokens = torch.tensor([b.token_ids for b in blocks], dtype=torch.long, device=device)  # [B, g]
        prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)  # x_0 .. x_{g-1}
        conf = confidence_probs(self.draft.confidence_logits(h, prev), self.temperatures, self.activation).tolist()
        out = {}
        for r, block, c in zip(reqs, blocks, conf):
            self.num_drafted += len(block.token_ids)
            out[r.req_id] = Draft(token_ids=list(block.token_ids), confidences=list(c), first_position=r.anchor_pos + 1,
                                  limit=r.limit, probs=block.probs)
        return out

    @torch.no_grad()
    def dry_run(self, num_requests: int, slot: int, block: int) -> None:
        """The drafting work of ``num_requests`` requests on ``slot`` (start-up profiling)."""
        device = self.draft.device
        anchors = torch.zeros(num_requests, dtype=torch.long, device=device)
        positions = torch.full((num_requests,), self.draft.window, dtype=torch.long, device=device)
        slots = torch.full((num_requests,), slot, dtype=torch.long, device=device)
        h, base = self._forward_block(anchors, positions, slots)   # what drafting runs: replayed when captured
        prev = anchors
        for k in range(self.block_size):
            prev = (base[:, k] + self.draft.markov_bias(prev)).argmax(dim=-1)
        self.draft.confidence_logits(h, torch.zeros(num_requests, self.block_size, dtype=torch.long, device=device))

    # ------------------------------------------------------------------ planning
    def _plan(self, batch, sampled: Dict[str, List[int]]) -> List[_Req]:
        window = self.draft.window
        reqs, logits_row = [], 0
        for b, sr in enumerate(batch.inputs.sched.requests):
            first_row, logits_row = logits_row, logits_row + sr.num_logits
            s0 = batch.inputs.meta.query_start_list[b]
            tokens = sampled.get(sr.req_id) if sr.num_logits else None
            if sr.num_logits and not tokens:
                continue  # failed in this step
            kept = sr.num_tokens - (len(sr.draft_token_ids) + 1 - len(tokens)) if tokens else sr.num_tokens
            lo = max(0, kept - window)  # older rows of a long chunk are never read again
            req = _Req(sr.req_id, sr.slot, list(range(s0 + lo, s0 + kept)),
                       list(range(sr.start_pos + lo, sr.start_pos + kept)))
            if tokens:
                self._set_anchor(req, batch.rows[first_row], int(tokens[-1]), sr.start_pos + kept, len(tokens))
            reqs.append(req)
        return reqs

    def _set_anchor(self, req: _Req, row, anchor: int, anchor_pos: int, num_tokens: int) -> None:
        params = row.params
        if row.req_id != req.req_id or params.logits_processors or params.structured_output is not None:
            return  # grammar and logits-processor requests are never drafted
        req.anchor, req.anchor_pos, req.row = anchor, anchor_pos, row
        req.limit = draft_limit(self.max_draft, row.output_index + num_tokens, params.max_tokens, anchor_pos,
                                self.max_model_len)
