"""Turns scheduler updates into RequestOutputs: detokenization, stop strings, grammar state, metrics."""
from __future__ import annotations

from typing import Dict, List, Optional

from redknot.engine.detokenizer import IncrementalDetokenizer
from redknot.engine.outputs import RequestMetrics, RequestOutput
from redknot.engine.request import FinishReason, Request
from redknot.engine.scheduler import RequestUpdate, Scheduler
from redknot.sample import GrammarState


class OutputProcessor:
    """Per-request detokenizers and grammar matchers; builds the outputs of a step."""

    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.detok: Dict[str, IncrementalDetokenizer] = {}
        self.grammars: Dict[str, GrammarState] = {}

    def add(self, req: Request, grammar: Optional[GrammarState]) -> None:
        self.detok[req.req_id] = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        if grammar is not None:
            self.grammars[req.req_id] = grammar

    def advance_grammars(self, updates: List[RequestUpdate]) -> None:
        """Feed sampled tokens to the matchers (before the next step's mask is built).
        A token the grammar rejects fails the request; a terminated grammar finishes it."""
        for up in updates:
            state = self.grammars.get(up.request.req_id)
            if state is None or not up.new_token_ids:
                continue
            for tok in up.new_token_ids:
                if not state.accept(tok):
                    self.scheduler.finish_request(up.request.req_id, FinishReason.ERROR,
                                                  f"sampled token {tok} is not allowed by the grammar")
                    break
            if state.is_terminated and not up.request.is_finished:
                self.scheduler.finish_request(up.request.req_id, FinishReason.STOP)

    def grammar_of(self, req_id: str) -> Optional[GrammarState]:
        state = self.grammars.get(req_id)
        return None if state is None or state.is_terminated else state

    def process(self, updates: List[RequestUpdate], now: float) -> List[RequestOutput]:
        """Detokenize new tokens, apply stop strings, stamp times; one output per update."""
        outputs = []
        for up in updates:
            req = up.request
            detok = self.detok.get(req.req_id)
            if detok is None:
                continue  # already reported as finished
            if up.new_token_ids and req.times.first_token is None:
                req.times.first_token = now
            self._add_tokens(detok, req, up.new_token_ids)
            outputs.append(self.output(req, now))
        return outputs

    def _add_tokens(self, detok: IncrementalDetokenizer, req: Request, new_token_ids: List[int]) -> None:
        """Feed tokens one at a time, as plain decoding delivers them: a stop string completed
        inside a block of accepted draft tokens ends the output at the token that completed it."""
        for i, tok in enumerate(new_token_ids):
            if detok.add([tok]) is None:
                continue
            extra = len(new_token_ids) - i - 1
            if extra:
                del req.output_token_ids[len(req.output_token_ids) - extra:]
            if req.is_finished:  # a later token of the block (EOS, max_tokens) had finished it
                req.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish_request(req.req_id, FinishReason.STOP)
            return

    def output(self, req: Request, now: float) -> RequestOutput:
        """The request's output; a finished request is reported once and then forgotten."""
        detok = self.detok[req.req_id]
        if req.is_finished:
            req.times.finish = req.times.finish or now
            text = detok.finish()
            del self.detok[req.req_id]
            self.grammars.pop(req.req_id, None)
        else:
            text = detok.text
        t = req.times
        metrics = RequestMetrics(arrival_time=t.arrival, scheduled_time=t.scheduled, first_token_time=t.first_token,
                                 finish_time=t.finish, num_prompt_tokens=req.num_prompt_tokens,
                                 num_output_tokens=len(req.output_token_ids),
                                 num_draft_proposed=req.num_draft_proposed,
                                 num_draft_accepted=req.num_draft_accepted, num_preemptions=req.num_preemptions)
        reason = req.finish_reason.value if req.finish_reason is not None else None
        return RequestOutput(req_id=req.req_id, prompt_token_ids=list(req.prompt_token_ids),
                             token_ids=list(req.output_token_ids), text=text, finished=req.is_finished,
                             finish_reason=reason, error=req.error, metrics=metrics)
