"""BlockPool: the KV blocks of the paged cache, as ids. No torch here.

Every block is in exactly one of three states:
  free       ref 0, no cached hash: in the free list, handed out first.
  used       ref > 0: held by that many live requests (more than one only through the prefix cache).
  evictable  ref 0 but holds a cached hash: still findable by the prefix cache, reused least recently
             freed first, and only once the free list is empty.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[Hashable | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first: the eviction order
        self._cached: dict[Hashable, int] = {}  # block hash -> block id

    # ---- counters -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable prefix-cache blocks (ref 0, hash kept)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_allocatable_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n blocks with ref 1: never-used/free ones first, then evicted cache blocks, LRU first."""
        if n > self.num_allocatable_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_allocatable_blocks} can be allocated")
        blocks = []
        for _ in range(n):
            block = self._free.popleft() if self._free else self._evict()
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        h = self.block_hashes[block]
        if self._cached.get(h) == block:
            del self._cached[h]
        self.block_hashes[block] = None
        return block

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block. Blocks reaching 0 with a cached hash become evictable in the
        given order (the first one given is evicted first), the others go back to the free list."""
        for block in block_ids:
            if self.ref_counts[block] <= 0:
                raise ValueError(f"block {block} freed more often than it was taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] > 0:
                continue
            if self.block_hashes[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- prefix cache ---------------------------------------------------------------------------
    def lookup(self, block_hash: Hashable) -> int | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference to cache-hit blocks; an evictable one is revived (ref 1)."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._evictable[block]  # KeyError here means a free block was "hit": a bug
            self.ref_counts[block] += 1

    def cache_block(self, block_id: int, block_hash: Hashable) -> bool:
        """Make a full, computed, used block findable under block_hash. A hash already cached keeps its
        first block (the duplicate stays private and goes to the free list when freed)."""
        if not self.enable_caching or block_hash in self._cached or self.block_hashes[block_id] is not None:
            return False
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"block {block_id} is not in use and cannot be cached")
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id
        return True
