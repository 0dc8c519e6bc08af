"""The Engram compressed-token map (reference §3.2), built from a ``tokenizer.json``.

Every raw token id is decoded alone (raw Rust tokenizer, special tokens kept). Text
holding U+FFFD (a partial UTF-8 byte token) is keyed by its raw token string;
otherwise by the normalised text (NFKC -> NFD -> StripAccents -> Lowercase ->
``[ \\t\\r\\n]+`` to one space -> a lone space to a sentinel -> Strip -> sentinel back
to a space), or the raw text when normalising leaves nothing. Compressed ids are
assigned in order of first appearance over ids 0..vocab-1. The number of distinct
keys sizes the hash multipliers, so a checkpoint's ``engram_compressed_vocab_size``
must equal it (:func:`check_compressed_vocab`).

Building the map decodes every id (about a second per 100k ids); :func:`cached_token_map`
stores it next to nothing but the cache directory it is given.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

SENTINEL = "\ue000"   # private-use char: a token that is exactly one space survives Strip()
REPLACEMENT = "\ufffd"


def engram_normalizer():
    """The normaliser sequence of reference §3.2 (``tokenizers`` normalizers)."""
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), SENTINEL),
        normalizers.Strip(), normalizers.Replace(SENTINEL, " "),
    ])


@dataclass(frozen=True)
class TokenMap:
    """``lookup[raw id] -> compressed id`` and the compressed vocabulary size."""
    lookup: Tuple[int, ...]
    size: int
    source: str

    def compressed(self, token_id: int) -> int:
        return self.lookup[token_id]


def token_map_key(backend: Any, normalizer: Any, token_id: int) -> str:
    """The key one raw token id collapses under."""
    text = backend.decode([token_id], skip_special_tokens=False)
    if REPLACEMENT in text:
        return backend.id_to_token(token_id)
    normalized = normalizer.normalize_str(text)
    return normalized if normalized else text


def build_token_map(tokenizer: Any, source: str = "", vocab_size: Optional[int] = None) -> TokenMap:
    """The map of a ``tokenizers.Tokenizer`` over ids ``0..vocab_size-1`` (default: the
    tokenizer's size with added tokens)."""
    n = vocab_size if vocab_size is not None else tokenizer.get_vocab_size(with_added_tokens=True)
    normalizer = engram_normalizer()
    keys: dict = {}
    lookup: List[int] = []
    for token_id in range(n):
        key = token_map_key(tokenizer, normalizer, token_id)
        new = keys.get(key)
        if new is None:
            new = keys[key] = len(keys)
        lookup.append(new)
    return TokenMap(tuple(lookup), len(keys), source)


def token_map_from_file(path: str, vocab_size: Optional[int] = None) -> TokenMap:
    from tokenizers import Tokenizer

    return build_token_map(Tokenizer.from_file(path), source=path, vocab_size=vocab_size)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def cached_token_map(tokenizer_file: str, cache_dir: Optional[str], vocab_size: Optional[int] = None) -> TokenMap:
    """:func:`token_map_from_file`, stored under ``cache_dir`` keyed by the file's digest."""
    if not cache_dir:
        return token_map_from_file(tokenizer_file, vocab_size)
    name = f"engram_token_map_{_digest(tokenizer_file)}_{vocab_size or 'all'}.json"
    path = os.path.join(cache_dir, name)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return TokenMap(tuple(d["lookup"]), d["size"], tokenizer_file)
    tmap = token_map_from_file(tokenizer_file, vocab_size)
    os.makedirs(cache_dir, exist_ok=True)
    # A private temporary name per writer: ranks of one launch may build the same map at the same time,
    # and each must replace the file whole (same content) without removing another's temporary.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=cache_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"size": tmap.size, "lookup": list(tmap.lookup)}, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return tmap


def check_compressed_vocab(cfg, tmap: TokenMap) -> None:
    """``engram_compressed_vocab_size`` must equal the map built from the checkpoint's tokenizer:
    every hash multiplier is derived from it, so a mismatch would silently rehash every table."""
    if cfg.engram_layer_ids and cfg.engram_compressed_vocab_size != tmap.size:
        raise ValueError(
            f"config.json field 'engram_compressed_vocab_size'={cfg.engram_compressed_vocab_size}: must equal the "
            f"size of the Engram token map built from the tokenizer {tmap.source or '(given)'}, which is "
            f"{tmap.size}; this tokenizer is not the one the checkpoint's Engram tables were hashed with")
