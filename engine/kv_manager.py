"""KVCacheManager: which blocks each request holds, prefix lookup, slot allocation. No torch here.

A full block is named by a hash chained through the whole prefix: hash(parent_hash, its tokens). Equal
prefixes therefore give equal hashes, and a token that differs early changes every later hash. A block is
registered in the prefix cache once it is full of tokens whose K/V a finished step has written.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.block_pool import BlockPool
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    # A cryptographic digest: a collision would silently hand one prompt another prompt's K/V.
    h = hashlib.blake2b(parent_hash or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of token_ids."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks computed so far
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already offered to the cache

    def _full_block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = request.token_ids_between(i * bs, (i + 1) * bs)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks at the start of the request's tokens, and how many tokens
        they hold. Never all tokens: the last one is recomputed so that the step yields its logits."""
        if not self.pool.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for h in self._full_block_hashes(request, max_blocks)[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Give the request blocks for num_computed_tokens + cache hits + num_new_tokens tokens. False, and
        nothing changed, if the pool cannot."""
        if computed_blocks and request.block_ids:
            raise ValueError("cache hits are only taken by a request that holds no blocks")
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if not computed_blocks and num_tokens <= len(request.block_ids) * self.block_size:
            return True  # most decode steps: the last block still has room
        num_new_blocks = max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(computed_blocks))
        # Reviving an evictable hit takes it out of what can be allocated.
        num_revived = sum(1 for b in computed_blocks if self.pool.is_evictable(b))
        if num_new_blocks > self.pool.num_allocatable_blocks - num_revived:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            self._num_registered[request.request_id] = len(computed_blocks)
        request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request, num_computed: int | None = None) -> None:
        """Register the request's blocks that are now full of computed tokens (prompt or generated).
        Call it after the step that computed them ran, never before: a hit must find K/V already written."""
        if not self.pool.enable_caching:
            return
        # `num_computed`: what the finished step computed (later steps may already be scheduled); and only
        # blocks whose token values the host knows.
        num_computed = request.num_computed_tokens if num_computed is None else num_computed
        num_full = min(num_computed, request.num_tokens) // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._full_block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(request.block_ids[i], hashes[i])
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that its tail is evicted before its shared head."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        self._hashes.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
