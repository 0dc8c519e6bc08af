"""Block manager and cache sizing: allocation, rollback, freeing, leak detection."""
import random

import pytest

from redknot.cache import CacheLeakError, CacheSpec, StateCacheManager, plan_cache

SPEC = CacheSpec(block_size=16, bytes_per_block=1000, bytes_per_slot=5000)


def test_allocate_grows_by_whole_blocks_and_is_all_or_nothing():
    cm = StateCacheManager(SPEC, num_slots=2, num_blocks=4)
    assert cm.allocate("a", 17)
    assert len(cm.block_table("a")) == 2 and cm.num_free_blocks == 2
    assert cm.allocate("a", 32)  # still two blocks
    assert cm.num_free_blocks == 2
    assert not cm.allocate("b", 49)  # needs 4 blocks, 2 free: nothing taken
    assert not cm.has("b") and cm.num_free_blocks == 2 and cm.num_free_slots == 1
    cm.check()


def test_slots_limit_admission():
    cm = StateCacheManager(SPEC, num_slots=1, num_blocks=8)
    assert cm.allocate("a", 1)
    assert not cm.can_allocate("b", 1)
    cm.free("a")
    assert cm.allocate("b", 1) and cm.slot("b") == 0
    cm.free("b")
    cm.assert_empty()


def test_rollback_frees_blocks_past_new_length():
    cm = StateCacheManager(SPEC, num_slots=1, num_blocks=4)
    cm.allocate("a", 33)  # 3 blocks
    table = cm.block_table("a")
    cm.rollback("a", 1)   # 32 tokens: 2 blocks
    assert cm.block_table("a") == table[:2] and cm.num_tokens("a") == 32
    cm.rollback("a", 0)
    assert cm.num_tokens("a") == 32
    cm.truncate("a", 16)
    assert cm.block_table("a") == table[:1] and cm.num_free_blocks == 3
    with pytest.raises(ValueError, match="holds 16 tokens"):
        cm.truncate("a", 17)
    with pytest.raises(ValueError, match="k must be >= 0"):
        cm.rollback("a", -1)
    cm.check()
    cm.free("a")
    cm.assert_empty()


def test_random_operations_never_leak():
    rng = random.Random(0)
    cm = StateCacheManager(SPEC, num_slots=4, num_blocks=12)
    lengths = {}
    for _ in range(2000):
        op = rng.random()
        rid = f"r{rng.randrange(6)}"
        if op < 0.5:
            n = lengths.get(rid, 0) + rng.randrange(1, 40)
            if cm.allocate(rid, n):
                lengths[rid] = n
        elif op < 0.75 and rid in lengths:
            k = rng.randrange(0, lengths[rid] + 1)
            cm.rollback(rid, k)
            lengths[rid] -= k
        elif rid in lengths:
            cm.free(rid)
            del lengths[rid]
        cm.check()
        used = sum(SPEC.blocks_for(n) for n in lengths.values())
        assert cm.num_free_blocks == 12 - used
    for rid in list(lengths):
        cm.free(rid)
    cm.assert_empty()


def test_check_detects_lost_and_duplicated_blocks():
    cm = StateCacheManager(SPEC, num_slots=2, num_blocks=4)
    cm.allocate("a", 20)
    cm._seqs["a"].block_table.pop()  # a block vanishes from the books
    with pytest.raises(CacheLeakError, match="lost"):
        cm.check()
    cm = StateCacheManager(SPEC, num_slots=2, num_blocks=4)
    cm.allocate("a", 20)
    cm._blocks.give([cm.block_table("a")[0]])  # a block both owned and free
    with pytest.raises(CacheLeakError, match="duplicated"):
        cm.check()
    cm = StateCacheManager(SPEC, num_slots=2, num_blocks=4)
    cm.allocate("a", 20)
    with pytest.raises(CacheLeakError, match="still hold"):
        cm.assert_empty()


def test_plan_fills_budget_and_caps_at_need():
    plan = plan_cache(SPEC, max_num_seqs=2, max_model_len=64, budget_bytes=10_000 + 5 * 1000 + 999)
    assert (plan.num_slots, plan.num_blocks) == (2, 5)
    assert plan.bytes_total == 2 * 5000 + 5 * 1000
    plan = plan_cache(SPEC, max_num_seqs=2, max_model_len=64, budget_bytes=10**9)
    assert plan.num_blocks == 2 * 4  # two full-length sequences, no more
    assert plan_cache(SPEC, max_num_seqs=2, max_model_len=64, num_blocks=7).num_blocks == 7


def test_plan_too_small_names_the_knobs():
    with pytest.raises(ValueError, match=r"model.max_position=64.*needs 4 blocks.*max_num_seqs"):
        plan_cache(SPEC, max_num_seqs=2, max_model_len=64, budget_bytes=12_000)
    with pytest.raises(ValueError, match="num_cache_blocks=0"):
        plan_cache(SPEC, max_num_seqs=2, max_model_len=64, num_blocks=0)
    with pytest.raises(ValueError, match="CacheSpec.block_size=0"):
        CacheSpec(block_size=0, bytes_per_block=1, bytes_per_slot=1)


def test_spec_from_layout_duck_typed():
    class Layout:
        block_size, bytes_per_block, bytes_per_slot, swa_ring = 64, 123, 456, 10
    assert CacheSpec.from_layout(Layout()) == CacheSpec(64, 123, 456)
