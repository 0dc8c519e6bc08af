"""SWA bounded replay (``features.swa_replay.mode=compact``), pure Python.

Some layers' prefix state is only ever read through the sliding window: the MTP
layer, and any sliding-window-only layers above the model's last CSA/HCA layer.
For a sequence heading to ``seq_len`` known tokens, those layers compute only
positions ``>= seq_len - keep_tokens``; a prefill, or the recompute of a
preempted request, replays at most ``keep_tokens`` positions through them, and a
rollback replays none (rings hold ``max_draft`` extra rows).

Why that is exact: the MTP's kv row at t depends only on its inputs at t (the
target's streams and token t+1), and its first query after the prefill reads
positions ``seq_len - W .. seq_len - 1``, so ``W`` kept positions suffice. Each
window-only main layer below it widens what must be exact by ``W - 1``
positions. The configuration rule (``keep_tokens >= W + max_draft + 1``,
redknot.config) covers the MTP layer with margin; models with window-only top
layers are checked here against ``W + max_draft + 1 + t * (W - 1)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from redknot.config.schema import SwaReplayMode


def required_keep_tokens(window: int, max_draft: int, num_trailing_sliding: int) -> int:
    """The smallest ``keep_tokens`` compact replay accepts for this model and draft length."""
    return window + max_draft + 1 + num_trailing_sliding * (window - 1)


@dataclass(frozen=True)
class CompactReplay:
    """Where each sequence's window-only layers start computing in compact mode."""
    keep_tokens: int

    @classmethod
    def from_features(cls, features, cfg) -> Optional["CompactReplay"]:
        """None unless ``features.swa_replay.mode == compact``; raises ValueError naming
        ``features.swa_replay.keep_tokens`` when it is too small for this model (``cfg``: the family's
        architecture config)."""
        replay = features.swa_replay
        if SwaReplayMode(replay.mode) != SwaReplayMode.compact:
            return None
        max_draft = features.dspark.effective_max_draft
        trailing = cfg.num_trailing_sliding_layers
        need = required_keep_tokens(cfg.sliding_window, max_draft, trailing)
        if replay.keep_tokens < need:
            raise ValueError(
                f"features.swa_replay.keep_tokens={replay.keep_tokens}: compact replay needs >= "
                f"sliding_window ({cfg.sliding_window}) + features.dspark.max_draft ({max_draft}) + 1 + "
                f"{trailing} window-only top layer(s) x (sliding_window - 1) = {need} for this model")
        return cls(keep_tokens=replay.keep_tokens)

    def start(self, seq_len: int) -> int:
        return max(0, seq_len - self.keep_tokens)

    def starts(self, requests: Sequence) -> List[int]:
        """Per scheduled request (``seq_len``: known tokens when scheduled), in order."""
        return [self.start(sr.seq_len) for sr in requests]
