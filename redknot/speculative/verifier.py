"""Verification of a step that feeds draft tokens: which drafts each request keeps.

Called by the model runner (its ``verifier`` hook) with the step's sampling rows
and logits. A request scheduled with k drafts owns k+1 consecutive logits rows:
row i is the target's distribution for the token after draft i (row 0: after
the request's last real token). Requests of the step without drafts are sampled
exactly as the runner would sample them.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from redknot.config.schema import VerificationMode
from redknot.speculative.metrics import SpecDecodeStats
from redknot.speculative.rejection import (accept_uniforms, block_sample, greedy_accept, point_mass,
                                          speculative_sample)

class Verifier:
    """Greedy requests keep the longest prefix of drafts equal to the target's argmax, then the
    target's token. Sampled requests are verified token-wise or as a block
    (``features.dspark.verification``) against the distributions their drafts were drawn from
    (``draft_probs``, set by the drafter each step with the tokens they belong to; greedy drafting:
    the point mass of each draft), which keeps every token distributed exactly as plain sampling
    would draw it. With ``probabilistic`` drafts whose q is not at hand (drafts a request kept
    from an older step while it was not scheduled) every draft is rejected and the token comes
    from the target's first row: one plain sample, still exact."""

    def __init__(self, sampler, method: VerificationMode, stats: SpecDecodeStats,
                 probabilistic: bool = False) -> None:
        self.sampler = sampler
        self.method = VerificationMode(method)
        self.stats = stats
        self.probabilistic = probabilistic
        # req_id -> (the drafted tokens, [g, V] q they were drawn from), replaced after every step
        self.draft_probs: Dict[str, Tuple[Tuple[int, ...], torch.Tensor]] = {}

    def __call__(self, batch, logits: torch.Tensor) -> Dict[str, List[int]]:
        """{req_id: accepted drafts + one token} for every request of the step with logits rows."""
        out: Dict[str, List[int]] = {}
        plain: List[int] = []
        row = 0
        for sr in batch.inputs.sched.requests:
            n = sr.num_logits
            if not n:
                continue
            if sr.draft_token_ids:
                out[sr.req_id] = self.verify_request(logits[row:row + n], batch.rows[row:row + n],
                                                     sr.draft_token_ids)
            else:
                plain.append(row)
            row += n
        if plain:
            out.update(self._sample_plain(batch, logits, plain))
        return out

    def _sample_plain(self, batch, logits: torch.Tensor, rows: List[int]) -> Dict[str, List[int]]:
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        mask = batch.bitmask[idx.to(batch.bitmask.device)] if batch.bitmask is not None else None
        tokens = self.sampler.sample(logits[idx], [batch.rows[r] for r in rows], mask)
        return {batch.rows[r].req_id: [tok] for r, tok in zip(rows, tokens)}

    def verify_request(self, logits: torch.Tensor, rows: Sequence, draft_token_ids: Sequence[int]) -> List[int]:
        """logits [k+1, V] and sampling rows of one request with k drafts -> kept tokens."""
        k = len(draft_token_ids)
        if logits.shape[0] != k + 1:
            raise ValueError(f"request {rows[0].req_id!r}: {k} drafts need {k + 1} logits rows, got {logits.shape[0]}")
        params = rows[0].params
        if params.logits_processors or params.structured_output is not None:
            raise ValueError(f"request {rows[0].req_id!r}: drafts were scheduled for a request with logits "
                             f"processors or a grammar (they are never drafted)")
        if params.greedy:
            tokens = greedy_accept(draft_token_ids, self.sampler.sample(logits, list(rows)))
        else:
            tokens = self._sampled(logits, rows, draft_token_ids)
        self.stats.record_verify(k, len(tokens) - 1)
        return tokens

    def _sampled(self, logits: torch.Tensor, rows: Sequence, draft_token_ids: Sequence[int]) -> List[int]:
        k, vocab = len(draft_token_ids), logits.shape[1]
        entry = self.draft_probs.get(rows[0].req_id)
        if entry is not None and tuple(entry[0][:k]) != tuple(int(t) for t in draft_token_ids):
            entry = None  # q of other drafts
        if entry is None and self.probabilistic:
            return self.sampler.sample(logits[:1], [rows[0]])
        p = self.sampler.probs(logits, list(rows))  # [k+1, V]
        q = point_mass(draft_token_ids, vocab, logits.device) if entry is None else entry[1][:k].to(p)  # [k, V]
        seed = rows[0].seed
        coins = accept_uniforms(seed, [r.output_index for r in rows[:-1]])
        noise = torch.stack([self.sampler.noise.exponential(r.seed, r.output_index, vocab) for r in rows])
        verify = block_sample if self.method == VerificationMode.block else speculative_sample
        return verify(p, q, draft_token_ids, coins, noise)
