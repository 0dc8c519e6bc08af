"""Incremental detokenization and stop strings (pure Python; works on any tokenizer with ``decode``)."""
from __future__ import annotations

from typing import List, Optional

# Tokens decoded again before the new ones, so merges across the boundary resolve correctly.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Appends text as tokens arrive and watches for stop strings.

    Only the last few tokens are re-decoded per step; text ending in an
    incomplete UTF-8 sequence (U+FFFD) is held back until the rest arrives.
    """

    def __init__(self, tokenizer, stop: Optional[List[str]] = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self.token_ids: List[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def add(self, new_token_ids: List[int]) -> Optional[str]:
        """Feed new tokens; returns the stop string hit (text is then cut before it), else None."""
        if self.stopped or not new_token_ids:
            return None
        self.token_ids.extend(new_token_ids)
        before = len(self.text)
        self.text += self._delta()
        if not self.stop:
            return None
        search_from = max(0, before - self._max_stop + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        idx, stop = min(hits)
        self.text = self.text[:idx]
        self.stopped = True
        return stop

    def finish(self) -> str:
        """Final text: flush a held-back tail (unless a stop string already cut the text)."""
        if not self.stopped and self._read_offset < len(self.token_ids):
            head = self.tokenizer.decode(self.token_ids[self._prefix_offset:self._read_offset])
            self.text += self.tokenizer.decode(self.token_ids[self._prefix_offset:])[len(head):]
            self._read_offset = len(self.token_ids)
        return self.text

    def _delta(self) -> str:
        ids = self.token_ids
        head = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset])
        full = self.tokenizer.decode(ids[self._prefix_offset:])
        if len(full) <= len(head) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset = max(self._prefix_offset, len(ids) - _CONTEXT_TOKENS)
        self._read_offset = len(ids)
        return full[len(head):]
