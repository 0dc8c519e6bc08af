"""The target tokenizer as the harness uses it: text → uint32 token ids, plus its file's sha256.

The file is chosen and loaded by the model family's own loader
(:meth:`redknot.models.family.ModelFamily.load_tokenizer`: ``model.tokenizer_path``,
else the checkpoint's tokenizer, else the family's packaged one), so the harness
always tokenizes exactly as the engine's model does.
The file's sha256 goes into every frozen-input manifest, so inputs built with
another tokenizer are never reused.

Neither this module nor the family's tokenizer loader imports torch or the
engine: ``mode=prepare`` runs on machines without a GPU runtime.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from redknot.config.schema import ModelConfig


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
    """The harness tokenizer for ``model`` (the model's tokenizer, with its file's sha256)."""
    from redknot.models.registry import family_for

    tokenizer = family_for(model).load_tokenizer(model)
    return BenchTokenizer(path=Path(tokenizer.source), sha256=file_sha256(Path(tokenizer.source)),
                          backend=tokenizer.tokenizer)
