"""Engram n-gram hashing for DeepSeek-V4.1 (reference §2.6, §3.2): the pure-integer part.

Everything here is exact integer arithmetic, pure Python at import (torch and numpy
are imported inside the functions that need them):

* :func:`engram_primes` -- the bucket moduli. One global "seen" set; for each Engram
  layer, for each n-gram size 2..max, the running value restarts at
  ``engram_vocab_size - 1`` and each head takes the next unused prime above it.
  A layer's table has exactly ``sum(primes)`` rows.
* :func:`hash_multipliers` -- ``default_rng(10007 * layer).integers(0, bound, 4) * 2 + 1``
  with ``bound = max(1, (INT64_MAX // compressed_vocab) // 2)``: odd and small enough
  that ``id * multiplier`` never overflows int64 (every intermediate stays >= 0).
* :class:`EngramHasher` -- the row ids ``[..., n_engram_layers, (max_ngram-1) * n_heads]``
  of the n-grams ending at each absolute position. History crosses chunk and
  prefill/decode boundaries by absolute position and never resets at BOS/EOS; a
  DEAD (-1) compressed id (an image-span token) blocks the look-back through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch

INT64_MAX = (1 << 63) - 1
DEAD = -1              # compressed id of a token that takes no part in an n-gram (image span)
SEED_STRIDE = 10007    # multiplier RNG seed = SEED_STRIDE * layer id

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for every n < 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every 64-bit integer)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _next_prime(start: int, seen: set) -> int:
    """The smallest prime above ``start`` not handed out yet."""
    candidate = start + 1
    while candidate in seen or not is_prime(candidate):
        candidate += 1
    return candidate


def engram_primes(num_engram_layers: int, max_ngram_size: int, n_heads: int,
                  vocab_size: int) -> Tuple[Tuple[Tuple[int, ...], ...], ...]:
    """``[engram layer][n-gram size - 2][head]`` bucket moduli (reference §2.6)."""
    seen: set = set()
    layers = []
    for _ in range(num_engram_layers):
        per_ngram = []
        for _ in range(max_ngram_size - 1):
            current, sizes = vocab_size - 1, []
            for _ in range(n_heads):
                current = _next_prime(current, seen)
                seen.add(current)
                sizes.append(current)
            per_ngram.append(tuple(sizes))
        layers.append(tuple(per_ngram))
    return tuple(layers)


def table_rows(primes_of_layer: Sequence[Sequence[int]]) -> int:
    """Rows of one layer's table: the sum of its primes."""
    return sum(sum(p) for p in primes_of_layer)


def offsets(primes_of_layer: Sequence[Sequence[int]]) -> Tuple[int, ...]:
    """Exclusive cumulative sum of the layer's flat (n-major, head-minor) prime list."""
    flat = [p for per_ngram in primes_of_layer for p in per_ngram]
    out, acc = [], 0
    for p in flat:
        out.append(acc)
        acc += p
    return tuple(out)


def multiplier_bound(compressed_vocab_size: int) -> int:
    return max(1, (INT64_MAX // compressed_vocab_size) // 2)


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> Tuple[int, ...]:
    """The layer's ``max_ngram_size`` odd multipliers (numpy PCG64, reference §2.6)."""
    import numpy as np

    rng = np.random.default_rng(SEED_STRIDE * layer_id)
    values = rng.integers(0, multiplier_bound(compressed_vocab_size), size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in values)


def hash_position(history: Sequence[int], multipliers: Sequence[int], primes_of_layer: Sequence[Sequence[int]],
                  pad_c: int) -> List[int]:
    """Row ids of one position in pure Python (the specification, used to check the tensor path).

    ``history[s]`` is the compressed id at ``p - s`` for s = 0..max_ngram-1, or None when
    ``p - s < 0``; DEAD blocks it and everything older.
    """
    ys, blocked = [], False
    for c in history:
        blocked = blocked or c is None or c == DEAD
        ys.append(pad_c if blocked else c)
    offs = offsets(primes_of_layer)
    out, rolling = [], ys[0] * multipliers[0]
    for n in range(1, len(ys)):
        rolling ^= ys[n] * multipliers[n]
        for j, prime in enumerate(primes_of_layer[n - 1]):
            out.append(rolling % prime + offs[(n - 1) * len(primes_of_layer[n - 1]) + j])
    return out


@dataclass(frozen=True)
class EngramLayout:
    """Primes, offsets and multipliers of every Engram layer of a config (pure Python)."""
    layer_ids: Tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: Tuple[Tuple[Tuple[int, ...], ...], ...]
    multipliers: Tuple[Tuple[int, ...], ...]
    pad_c: int          # compressed id of ``engram_pad_id``

    @classmethod
    def create(cls, cfg, pad_c: int) -> "EngramLayout":
        primes = engram_primes(len(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                               cfg.engram_vocab_size)
        mults = tuple(hash_multipliers(layer, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size)
                      for layer in cfg.engram_layer_ids)
        return cls(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads, primes, mults, pad_c)

    @property
    def n_cols(self) -> int:
        """Hash columns per Engram layer: (max_ngram - 1) * n_heads."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def lookback(self) -> int:
        """Earlier positions a position's hash reads (max_ngram - 1)."""
        return self.max_ngram_size - 1


class EngramHasher:
    """Tensor hashing over absolute positions (int64, exact).

    ``hash(compressed, positions)``: ``compressed`` is ``[N, lookback + S]`` -- the
    compressed ids of the ``lookback`` positions before the chunk (anything for
    positions < 0; they are blocked by position) followed by the chunk's S ids --
    and ``start_pos`` the absolute position of the chunk's first token. Returns
    ``[N, S, n_engram_layers, n_cols]`` int64 row ids into each layer's table.
    """

    def __init__(self, layout: EngramLayout, device=None):
        import torch

        self.layout = layout
        self.primes = torch.tensor([[p for per in layer for p in per] for layer in layout.primes],
                                   dtype=torch.int64, device=device)                 # [L, n_cols]
        self.offsets = torch.tensor([offsets(layer) for layer in layout.primes], dtype=torch.int64, device=device)
        self.multipliers = torch.tensor(layout.multipliers, dtype=torch.int64, device=device)  # [L, max_ngram]

    def hash(self, compressed: "torch.Tensor", start_pos: "int | torch.Tensor") -> "torch.Tensor":
        import torch

        lb = self.layout.lookback
        n, total = compressed.shape
        s = total - lb
        start = torch.as_tensor(start_pos, dtype=torch.int64, device=compressed.device).reshape(-1, 1)
        pos = start + torch.arange(s, device=compressed.device)                      # [N|1, S]
        blocked = torch.zeros((n, s), dtype=torch.bool, device=compressed.device)
        ys = []
        for shift in range(self.layout.max_ngram_size):
            src = compressed[:, lb - shift: lb - shift + s]
            blocked = blocked | (pos < shift) | (src == DEAD)
            ys.append(torch.where(blocked, torch.full_like(src, self.layout.pad_c), src))
        y = torch.stack(ys, dim=-1)                                                   # [N, S, max_ngram]
        prod = y.unsqueeze(2) * self.multipliers                                      # [N, S, L, max_ngram]
        rolling = prod[..., 0]
        heads = self.layout.n_heads
        cols = []
        for i in range(1, self.layout.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, prod[..., i])
            cols.append(rolling.unsqueeze(-1) % self.primes[:, (i - 1) * heads: i * heads])
        return torch.cat(cols, dim=-1) + self.offsets


def check_num_embeddings(num_embeddings: Sequence[int], primes: Sequence, layer_ids: Sequence[int]) -> Optional[str]:
    """None when every layer's rows equal the sum of its primes, else a message naming the layer."""
    for k, (rows, layer_primes) in enumerate(zip(num_embeddings, primes)):
        want = table_rows(layer_primes)
        if rows != want:
            return (f"engram_num_embeddings[{k}]={rows} (layer {layer_ids[k]}) must equal the sum of "
                    f"that layer's primes, {want}")
    return None
