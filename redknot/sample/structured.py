"""Structured outputs through xgrammar: regex, JSON schema and EBNF constraints.

Each distinct grammar is compiled once and cached; every constrained request
gets its own matcher, which advances with the request's sampled tokens and
fills that request's row of the token bitmask before sampling.
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch


_COMPILERS: Dict[tuple, object] = {}
_COMPILERS_LOCK = threading.Lock()


def _make_compiler(tokenizer, vocab_size: int, stop_token_ids: List[int]):
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "tokenizer", tokenizer)  # the tokenizers.Tokenizer inside V4Tokenizer
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                              vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    return xgr.GrammarCompiler(info, max_threads=2)


class GrammarError(ValueError):
    """A structured-output spec that does not compile (message from the compiler)."""


class StructuredOutputManager:
    """Compiles grammars (cached) and builds bitmasks for a batch of matchers."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._compiled: Dict[Tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self.num_compiled = 0

    def _get_compiler(self):
        # Built on first use and shared by every engine of the process: the tokenizer scan
        # takes a second or two and most runs never need it.
        if self._compiler is None:
            key = (getattr(self._tokenizer, "source", id(self._tokenizer)), self.vocab_size,
                   tuple(self._stop_token_ids))
            with _COMPILERS_LOCK:
                if key not in _COMPILERS:
                    _COMPILERS[key] = _make_compiler(self._tokenizer, self.vocab_size, self._stop_token_ids)
                self._compiler = _COMPILERS[key]
        return self._compiler

    def compile(self, spec: Dict[str, str]):
        """Compiled grammar for a normalised spec; raises GrammarError with the compiler's message."""
        key = (spec["schema_type"], spec["schema"])
        with self._lock:
            if key not in self._compiled:
                compiler = self._get_compiler()
                # Compact JSON: free whitespace lets a weak model pad forever without closing the object.
                build = {"regex": compiler.compile_regex,
                         "json": lambda s: compiler.compile_json_schema(s, any_whitespace=False),
                         "ebnf": compiler.compile_grammar}[key[0]]
                try:
                    self._compiled[key] = build(key[1])
                except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses
                    raise GrammarError(f"structured_output {key[0]} does not compile: "
                                       f"{str(exc).strip()}") from exc
                self.num_compiled += 1
            return self._compiled[key]

    def new_matcher(self, spec: Dict[str, str]) -> "GrammarState":
        import xgrammar as xgr
        return GrammarState(xgr.GrammarMatcher(self.compile(spec)))

    def bitmask(self, states: List[Optional["GrammarState"]]) -> Optional[torch.Tensor]:
        """``[N, ceil(V/32)]`` int32 allowed-token bits; unconstrained rows allow everything."""
        if not any(s is not None for s in states):
            return None
        import xgrammar as xgr
        mask = xgr.allocate_token_bitmask(len(states), self.vocab_size)  # [N, W] int32, all ones
        for i, state in enumerate(states):
            if state is not None:
                state.matcher.fill_next_token_bitmask(mask, i)
        return mask


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar rejects it."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()
