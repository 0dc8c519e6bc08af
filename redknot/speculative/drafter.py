"""MTP drafting (reference §6): catch the MTP layer up with the target, then chain drafts.

After every target step the MTP layer processes the positions the target just
kept: row t pairs the target's pre-head streams at t with token t+1 (the next
input token, the chunk's following prompt token, or the token just sampled).
Its own ring then holds exactly the positions the target holds, so the MTP
state follows every rollback for free: positions are rewritten before they are
read. For a request that sampled, the MTP row of its last position predicts
the token after the one just sampled (draft 1); each further draft runs the MTP
one position on, with its own output streams standing in for the target's and
the previous draft as the next token. Chained rows are written to the ring
speculatively and overwritten by the next catch-up (the ring has room for
``max_draft`` extra rows, see ``StateLayout``).

Drafts are the MTP's argmax (greedy drafting: the draft distribution is the
point mass); the confidence of a draft is its probability under the MTP's
distribution (after the request's own temperature/top-k/top-p/min-p; plain
softmax for greedy requests). Which drafts are verified is decided by the
scheduler (redknot.speculative.schedule) from these confidences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from redknot.step.metadata import StepMetadata
from redknot.speculative.replay import CompactReplay
from redknot.speculative.schedule import draft_limit


@dataclass
class Draft:
    """A request's drafts for its next step."""
    token_ids: List[int]       # drafted tokens (the scheduler verifies a prefix of them)
    confidences: List[float]   # conditional survival estimate of every drafted token
    first_position: int        # position of the first draft in the sequence
    limit: int = 0             # drafts the request may verify (max_tokens, model length, max_draft)
    probs: object = None       # [n, V] draft distributions q (None: point masses, greedy drafting)


@dataclass
class _Seq:
    """One request's MTP work in this step."""
    req_id: str
    slot: int
    block_table: List[int]
    first_pos: int             # first MTP position of the catch-up
    rows: List[int]            # target rows (step row ids) the catch-up reads streams from
    token_ids: List[int]       # target tokens at those positions
    next_ids: List[int]        # token after each of those positions
    limit: int = 0             # drafts this request may propose (0 = none)
    sampling_row: object = None
    tokens: List[int] = field(default_factory=list)
    confidences: List[float] = field(default_factory=list)
    stream: Optional[torch.Tensor] = None  # [n, D] MTP streams of its latest row

    @property
    def next_pos(self) -> int:  # position of the token after the catch-up (the one just sampled)
        return self.first_pos + len(self.rows)


class MTPDrafter:
    """Catch-up + chained drafting over the model's MTP layer and the engine's state."""

    def __init__(self, model, state, sampler, max_draft: int, max_model_len: int,
                 replay: Optional[CompactReplay] = None) -> None:
        self.model, self.state, self.sampler = model, state, sampler
        self.max_draft = max_draft
        self.block_size = max_draft  # drafts per request and step (the chain's length at most)
        self.max_model_len = max_model_len
        self.replay = replay
        self.num_mtp_rows = 0
        self.num_drafted = 0
        self.num_steps = 0  # steps in which the MTP layer ran

    def propose(self, batch, streams: torch.Tensor, sampled: Dict[str, List[int]]) -> Dict[str, Draft]:
        """MTP catch-up for every request of the step, then drafts for those that sampled."""
        seqs = self._plan(batch, sampled)
        if not seqs:
            return {}
        self.num_steps += 1
        drafting = [s for s in seqs if s.limit > 0]
        self._catch_up(seqs, drafting, streams)
        for step in range(1, self.max_draft):
            active = [s for s in drafting if len(s.tokens) < s.limit]
            if not active:
                break
            self._chain(active, step)
        out = {}
        for s in drafting:
            self.num_drafted += len(s.tokens)
            out[s.req_id] = Draft(token_ids=list(s.tokens[:s.limit]), confidences=list(s.confidences[:s.limit]),
                                  first_position=s.next_pos + 1, limit=s.limit)
        return out

    @torch.no_grad()
    def dry_run(self, num_requests: int, slot: int, block: int) -> None:
        """The drafting work of ``num_requests`` requests on ``slot`` (start-up profiling): the
        catch-up row and the chained drafts."""
        device = self.model.device
        meta = StepMetadata.build([[1]] * num_requests, [0] * num_requests, [slot] * num_requests,
                                  [[block]] * num_requests, device=device)
        cfg = self.model.cfg
        prev = torch.zeros(num_requests, cfg.hc_mult, cfg.hidden_size, dtype=self.model.dtype, device=device)
        ids = torch.ones(num_requests, dtype=torch.long, device=device)
        for _ in range(self.max_draft):
            prev, _ = self.model.mtp_forward(meta, self.state, prev, ids)

    # ------------------------------------------------------------------ planning
    def _plan(self, batch, sampled: Dict[str, List[int]]) -> List[_Seq]:
        meta = batch.inputs.meta
        requests = batch.inputs.sched.requests
        ids = meta.input_ids.tolist()
        starts = self.replay.starts(requests) if self.replay is not None else None
        seqs, logits_row = [], 0
        for b, sr in enumerate(requests):
            first_row, logits_row = logits_row, logits_row + sr.num_logits
            s0 = meta.query_start_list[b]
            if sr.num_logits:
                tokens = sampled.get(sr.req_id)
                if not tokens:
                    continue  # failed in this step
                kept = sr.num_tokens - (len(sr.draft_token_ids) + 1 - len(tokens))
                last_next = tokens[-1]
            else:
                kept, last_next = sr.num_tokens, sr.next_token_id
                if last_next is None:
                    continue
            skip = 0 if starts is None else max(0, starts[b] - sr.start_pos)
            if skip >= kept:
                continue  # compact replay: these positions are never read
            seq = _Seq(req_id=sr.req_id, slot=sr.slot, block_table=sr.block_table, first_pos=sr.start_pos + skip,
                       rows=list(range(s0 + skip, s0 + kept)), token_ids=ids[s0 + skip:s0 + kept],
                       next_ids=ids[s0 + skip + 1:s0 + kept] + [int(last_next)])
            if sr.num_logits:
                self._set_limit(seq, batch.rows[first_row], len(tokens))
            seqs.append(seq)
        return seqs

    def _set_limit(self, seq: _Seq, row, num_tokens: int) -> None:
        params = row.params
        if row.req_id != seq.req_id or params.logits_processors or params.structured_output is not None:
            return  # grammar and logits-processor requests are never drafted
        seq.sampling_row = row
        seq.limit = draft_limit(self.max_draft, row.output_index + num_tokens, params.max_tokens, seq.next_pos,
                                self.max_model_len)

    # ------------------------------------------------------------------ MTP runs
    def _catch_up(self, seqs: List[_Seq], drafting: List[_Seq], streams: torch.Tensor) -> None:
        device = streams.device
        ends, acc = {}, 0
        for s in seqs:
            acc += len(s.rows)
            ends[id(s)] = acc - 1
        meta = StepMetadata.build([s.token_ids for s in seqs], [s.first_pos for s in seqs], [s.slot for s in seqs],
                                  [s.block_table for s in seqs], logits_indices=[ends[id(s)] for s in drafting],
                                  device=device)
        rows = torch.tensor([r for s in seqs for r in s.rows], dtype=torch.long, device=device)
        next_ids = torch.tensor([t for s in seqs for t in s.next_ids], dtype=torch.long, device=device)
        mtp_streams, logits = self.model.mtp_forward(meta, self.state, streams[rows], next_ids)
        self.num_mtp_rows += rows.numel()
        for s in drafting:
            s.stream = mtp_streams[ends[id(s)]]
        if drafting:
            self._take(drafting, logits)

    def _chain(self, active: List[_Seq], step: int) -> None:
        """One more draft per active request: MTP at position next_pos + step - 1."""
        device = active[0].stream.device
        prev_tokens = [s.tokens[-2] if step > 1 else s.next_ids[-1] for s in active]
        meta = StepMetadata.build([[t] for t in prev_tokens], [s.next_pos + step - 1 for s in active],
                                  [s.slot for s in active], [s.block_table for s in active], device=device)
        prev = torch.stack([s.stream for s in active])  # [A, n, D]
        next_ids = torch.tensor([s.tokens[-1] for s in active], dtype=torch.long, device=device)
        mtp_streams, logits = self.model.mtp_forward(meta, self.state, prev, next_ids)
        for i, s in enumerate(active):
            s.stream = mtp_streams[i]
        self._take(active, logits)

    def _take(self, seqs: List[_Seq], logits: torch.Tensor) -> None:
        tokens, confs = self._argmax_with_confidence(seqs, logits)
        for s, tok, conf in zip(seqs, tokens, confs):
            s.tokens.append(tok)
            s.confidences.append(conf)

    def _argmax_with_confidence(self, seqs: List[_Seq], logits: torch.Tensor) -> Tuple[List[int], List[float]]:
        probs = logits.float().softmax(dim=1)  # [A, V]
        sampled = [i for i, s in enumerate(seqs) if not s.sampling_row.params.greedy]
        if sampled:
            idx = torch.tensor(sampled, dtype=torch.long, device=logits.device)
            probs[idx] = self.sampler.probs(logits[idx].float(), [seqs[i].sampling_row for i in sampled])
        conf, tok = probs.max(dim=1)
        return tok.tolist(), conf.tolist()
