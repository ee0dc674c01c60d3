"""Random paged batches for the attention tests and the kernel benchmark (no test framework here).

A batch is a list of (context_len, query_len): its context K/V are pre-written into the cache, its new
tokens' K/V are handed to the backend. Blocks are a random permutation of the pool, and every cache
slot no sequence owns holds large garbage, so reading past a sequence shows up as a wrong result.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from attention.base import AttentionMetadata
from attention.metadata import AttentionMetadataBuilder, SeqSpec


@dataclass
class RandomBatch:
    specs: list[SeqSpec]
    meta: AttentionMetadata
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] (padding tokens included)
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    full_keys: list[torch.Tensor]  # per sequence: [seq_len, num_kv_heads, head_dim], context then new
    full_values: list[torch.Tensor]


def random_mixed_lens(rng: random.Random, num_prefills: int, num_decodes: int, max_len: int) -> list[tuple[int, int]]:
    """(context_len, query_len) pairs, prefills first: fresh prompts and chunks over cached context alike."""
    lens = []
    for i in range(num_prefills):
        query_len = rng.randint(2, max(2, max_len // 2))
        context_len = 0 if i % 2 == 0 else rng.randint(1, max_len - query_len)
        lens.append((context_len, query_len))
    return lens + [(rng.randint(0, max_len - 1), 1) for _ in range(num_decodes)]


def make_random_batch(lens: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                      block_size: int, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                      pad_to_num_tokens: int | None = None, num_blocks: int | None = None,
                      pad_to_blocks_per_seq: int | None = None, pad_to_num_seqs: int | None = None) -> RandomBatch:
    """num_blocks: the pool size (default: just enough, plus 3); fixed sizes let batches share a cache shape.
    Padding as AttentionMetadataBuilder.build's (unequal token and sequence padding: a mixed graph's layout)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // block_size) for c, q in lens]
    num_blocks = num_blocks or sum(needed) + 3
    assert num_blocks >= sum(needed), "the pool is too small for these sequences"
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    specs, used = [], 0
    for (c, q), n in zip(lens, needed):
        specs.append(SeqSpec(context_len=c, query_len=q, block_ids=perm[used:used + n]))
        used += n

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = randn(*cache_shape, scale=30.0), randn(*cache_shape, scale=30.0)
    full_keys = [randn(c + q, num_kv_heads, head_dim) for c, q in lens]
    full_values = [randn(c + q, num_kv_heads, head_dim) for c, q in lens]
    for spec, k, v in zip(specs, full_keys, full_values):
        pos = torch.arange(spec.context_len)
        slots = (torch.tensor(spec.block_ids, dtype=torch.int64)[pos // block_size] * block_size
                 + pos % block_size).to(device)
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = k[:spec.context_len]
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = v[:spec.context_len]

    meta = AttentionMetadataBuilder(block_size, device).build(specs, pad_to_num_tokens=pad_to_num_tokens,
                                                              pad_to_num_seqs=pad_to_num_seqs,
                                                              pad_to_blocks_per_seq=pad_to_blocks_per_seq)
    num_pad = meta.num_tokens - sum(q for _, q in lens)
    key = torch.cat([k[s.context_len:] for s, k in zip(specs, full_keys)] + [randn(num_pad, num_kv_heads, head_dim)])
    value = torch.cat([v[s.context_len:] for s, v in zip(specs, full_values)]
                      + [randn(num_pad, num_kv_heads, head_dim)])
    query = randn(meta.num_tokens, num_heads, head_dim)
    return RandomBatch(specs, meta, query, key, value, key_cache, value_cache, full_keys, full_values)


def owned_slots(batch: RandomBatch) -> torch.Tensor:
    """[num_blocks * block_size] bool: the cache slots some sequence of the batch owns (context and new tokens);
    tests fill the others with NaN to show a kernel never lets what it reads there reach its output."""
    block_size = batch.key_cache.shape[1]
    device = batch.key_cache.device
    owned = torch.zeros(batch.key_cache.shape[0] * block_size, dtype=torch.bool, device=device)
    for spec in batch.specs:
        slots = torch.tensor(spec.block_ids, device=device)[:, None] * block_size + torch.arange(block_size,
                                                                                                 device=device)
        owned[slots.flatten()[:spec.context_len + spec.query_len]] = True
    return owned
