"""Tokenized dataset contexts kept between ``prepare`` runs (e.g. suite=64k, then suite=128k).

Keyed by the source file's sha256 and the tokenizer file's sha256, so a changed
source or tokenizer never hits. Only ``prepare`` reads it: ``validate``
re-tokenizes from the sources, so a damaged cache entry cannot vouch for itself.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import List, Optional

import numpy as np

TOKENS_VERSION = "contexts-v1"


def context_key(source_sha256: str, tokenizer_sha256: str) -> str:
    return hashlib.sha256(f"{TOKENS_VERSION}/{source_sha256}/{tokenizer_sha256}".encode()).hexdigest()[:24]


class TokenCache:
    """``<cache_dir>/tokens/<key>.npz``: all contexts of one dataset file, concatenated, with offsets."""

    def __init__(self, cache_dir: Path):
        self.root = Path(cache_dir) / "tokens"

    def get(self, key: str) -> Optional[List[np.ndarray]]:
        path = self.root / f"{key}.npz"
        if not path.is_file():
            return None
        with np.load(path, allow_pickle=False) as data:
            ids, offsets = data["ids"], data["offsets"]
        return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]

    def put(self, key: str, arrays: List[np.ndarray]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)  # [rows + 1]
        offsets[1:] = np.cumsum([len(a) for a in arrays])
        ids = np.concatenate(arrays) if arrays else np.zeros(0, np.uint32)  # [total tokens]
        tmp = self.root / f".{key}.{os.getpid()}.npz"
        np.savez(tmp, ids=ids.astype(np.uint32), offsets=offsets)
        os.replace(tmp, self.root / f"{key}.npz")
