"""BlockPool and KVCacheManager: free list, LRU eviction of the prefix cache, refcounts, hashing."""
from __future__ import annotations

import pytest

from engine.block_pool import BlockPool
from engine.kv_manager import KVCacheManager, block_hashes, hash_block_tokens
from engine.request import Request, SamplingParams


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def compute(manager: KVCacheManager, request: Request, num_tokens: int) -> None:
    """What the scheduler and a finished step do: allocate, advance, register the full blocks."""
    assert manager.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    manager.cache_full_blocks(request)


# ---- BlockPool ---------------------------------------------------------------------------------
def test_allocate_and_free_counters():
    pool = BlockPool(4)
    assert counts(pool) == (4, 0, 0)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and counts(pool) == (1, 3, 0)
    pool.free(a)
    assert counts(pool) == (4, 0, 0)  # no hash: straight back to the free list
    with pytest.raises(ValueError):
        pool.allocate(5)


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError):
        pool.free([b])


def test_cached_block_becomes_evictable_and_survives_while_free_blocks_remain():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.cache_block(b, "h")
    pool.free([b])
    assert counts(pool) == (2, 0, 1)
    got = pool.allocate(2)  # the two never-used blocks go first
    assert b not in got and pool.lookup("h") == b
    (again,) = pool.allocate(1)  # only now is the cached block evicted
    assert again == b and pool.lookup("h") is None and pool.block_hashes[b] is None
    assert counts(pool) == (0, 3, 0)


def test_eviction_is_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, f"h{i}")
    pool.free([blocks[2], blocks[0]])
    pool.free([blocks[3]])
    pool.free([blocks[1]])
    assert pool.allocate(4) == [blocks[2], blocks[0], blocks[3], blocks[1]]


def test_hit_revives_an_evictable_block():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, "ha")
    pool.cache_block(b, "hb")
    pool.free([a, b])
    assert counts(pool) == (1, 0, 2)
    assert pool.lookup("ha") == a
    pool.touch([a])
    assert pool.ref_counts[a] == 1 and not pool.is_evictable(a)
    assert counts(pool) == (1, 1, 1)
    got = pool.allocate(2)  # the free block, then the only evictable one: never the revived block
    assert a not in got and b in got
    assert pool.lookup("ha") == a and pool.lookup("hb") is None


def test_refcounts_with_a_shared_block():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, "h")
    pool.touch([pool.lookup("h")])
    pool.touch([pool.lookup("h")])
    assert pool.ref_counts[a] == 3
    pool.free([a])
    pool.free([a])
    assert pool.ref_counts[a] == 1 and counts(pool) == (1, 1, 0)
    pool.free([a])
    assert counts(pool) == (1, 0, 1)


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, "h")
    assert not pool.cache_block(b, "h")
    pool.free([b])
    assert counts(pool) == (1, 1, 0)  # the private duplicate is plainly free
    assert pool.lookup("h") == a


def test_prefix_caching_off():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache_block(a, "h")
    assert pool.lookup("h") is None
    pool.free([a])
    assert counts(pool) == (2, 0, 0)


# ---- hashing ------------------------------------------------------------------------------------
def test_equal_prefixes_have_equal_hashes_and_one_early_token_changes_all_later_ones():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 0], 2)
    c = block_hashes([1, 9, 3, 4, 5, 6, 7, 8], 2)
    assert len(a) == 4  # the partial last block has no hash
    assert a == b
    assert all(x != y for x, y in zip(a, c))


def test_hash_depends_on_the_parent():
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(hash_block_tokens(None, [0, 0]), [1, 2])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


# ---- KVCacheManager -----------------------------------------------------------------------------
def test_allocate_slots_covers_the_tokens_and_fails_without_side_effects():
    pool = BlockPool(3)
    m = KVCacheManager(pool, block_size=4)
    r = make_request("a", range(10))
    assert m.allocate_slots(r, 5) and len(r.block_ids) == 2
    r.num_computed_tokens = 5
    assert m.allocate_slots(r, 3) and len(r.block_ids) == 2  # 8 tokens still fit in 2 blocks
    r.num_computed_tokens = 8
    assert not m.allocate_slots(r, 9)  # 17 tokens need 5 blocks
    assert len(r.block_ids) == 2 and pool.num_free_blocks == 1


def test_equal_prompts_share_full_blocks_but_never_the_last_token():
    pool = BlockPool(8)
    m = KVCacheManager(pool, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    compute(m, a, 6)
    b = make_request("b", [1, 2, 3, 4, 5, 6])
    hit, n = m.get_computed_blocks(b)
    # 6 tokens = 3 full blocks, but the last token is recomputed: only 2 blocks are hits.
    assert hit == a.block_ids[:2] and n == 4
    assert m.allocate_slots(b, 2, hit)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [pool.ref_counts[x] for x in a.block_ids] == [2, 2, 1]


def test_a_differing_early_token_misses_every_later_block():
    pool = BlockPool(8)
    m = KVCacheManager(pool, block_size=2)
    compute(m, make_request("a", [1, 2, 3, 4, 5, 6, 7]), 7)
    hit, n = m.get_computed_blocks(make_request("b", [1, 9, 3, 4, 5, 6, 7]))
    assert hit == [] and n == 0
    hit, n = m.get_computed_blocks(make_request("c", [1, 2, 3, 9, 5, 6, 7]))
    assert len(hit) == 1 and n == 2


def test_generated_tokens_are_cached_too():
    pool = BlockPool(8)
    m = KVCacheManager(pool, block_size=2)
    a = make_request("a", [1, 2, 3])
    compute(m, a, 3)
    a.output_token_ids.append(4)
    compute(m, a, 1)  # the decode fills block 1 with [3, 4]
    a.output_token_ids.append(5)
    hit, n = m.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5]))
    assert hit == a.block_ids[:2] and n == 4


def test_blocks_are_registered_only_when_full_of_computed_tokens():
    pool = BlockPool(8)
    m = KVCacheManager(pool, block_size=4)
    a = make_request("a", list(range(10)))
    compute(m, a, 3)
    assert m.get_computed_blocks(make_request("b", list(range(10))))[1] == 0
    compute(m, a, 3)  # 6 computed: block 0 full
    assert m.get_computed_blocks(make_request("c", list(range(10))))[1] == 4


def test_free_releases_the_tail_first_and_hits_revive():
    pool = BlockPool(5)
    m = KVCacheManager(pool, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    compute(m, a, 7)
    blocks = list(a.block_ids)
    m.free(a)
    assert a.block_ids == [] and pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 3 and pool.num_free_blocks == 2  # the partial last block is plain free
    # A newcomer needing 3 blocks takes the 2 free ones, then evicts a's tail (block 2), not its head.
    other = make_request("x", [9, 9, 9, 9, 9])
    assert m.allocate_slots(other, 5)
    assert blocks[2] in other.block_ids and not {blocks[0], blocks[1]} & set(other.block_ids)
    m.free(other)
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7])
    hit, n = m.get_computed_blocks(b)
    assert hit == blocks[:2] and n == 4
    assert m.allocate_slots(b, 3, hit)
    assert b.block_ids[:2] == blocks[:2] and len(b.block_ids) == 4
    assert [pool.ref_counts[x] for x in hit] == [1, 1] and pool.num_cached_blocks == 0


def test_reviving_hits_counts_against_free_space():
    pool = BlockPool(3)
    m = KVCacheManager(pool, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(m, a, 5)
    m.free(a)
    assert pool.num_allocatable_blocks == 3
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit, n = m.get_computed_blocks(b)
    assert n == 4
    # 2 hits revived leave 1 allocatable block: 2 more tokens fit, 3 do not.
    assert not m.allocate_slots(b, 3, hit)
    assert m.allocate_slots(b, 2, hit)
    assert pool.num_used_blocks == 3


def test_manager_with_caching_off_never_hits():
    pool = BlockPool(8, enable_caching=False)
    m = KVCacheManager(pool, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(m, a, 5)
    assert m.get_computed_blocks(make_request("b", [1, 2, 3, 4, 5])) == ([], 0)
    m.free(a)
    assert pool.num_free_blocks == 8
