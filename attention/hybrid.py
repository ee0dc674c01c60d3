"""Triton for decodes and short mixed steps, flash-attn-4 for steps with long prefills.

Both read the same paged KV layout and the same metadata. Each is the faster one on its side:
- Triton is 1.4-3.2x faster on decode batches (docs/benchmarks.md, "Attention kernels").
- flash-attn-4 is faster on prefill-heavy batches. On W-L's 16k-token steps, one layer on the H200 takes
  628 us against Triton's 1,012 us for 8k chunks over cached context, and 510 against 730 us for two
  fresh 8k prompts (385-471 TFLOP/s against 239-329).

The rule is per step, from the host's shapes alone. A step goes to flash-attn-4, eagerly, when it has more than
FLASH_MIN_TOKENS tokens and a prompt chunk of at least FLASH_MIN_QUERY_LEN of them. Every other step goes to
Triton. That includes decode-only steps and mixed
steps of up to MAX_MIXED_GRAPH_TOKENS (engine/cuda_graphs.py), so CUDA graphs only ever capture the
Triton path. Below that size a step's launches cost more than its kernels, and flash-attn-4's eager
launch takes ~80 us of host time a layer. Short chunks stay on Triton too. On W-B (512-token prompts,
16k-token steps), routing every long step to flash-attn-4 ran at 58.5k output tok/s, against Triton's 64.7k.
On W-A the two tied at 51.6k and 51.7k. W-L's 8k prompts are where flash-attn-4 pays: 2.03 s against
2.21 s.
FLASH_MIN_TOKENS must be at least the engine's largest mixed graph (tests/test_attention_gpu.py).

A long step is split by kind, each part to the kernel made for it (issue 19):
- fresh prompts (no cached context) -> flash-attn-4 over their own K/V, without the page table;
- prompt chunks over cached context -> flash-attn-4 through the pages, or Triton when they hold fewer than
  FLASH_MIN_QUERY_LEN tokens (W-L's: a few dozen tokens finishing an 8k prompt);
- decodes -> Triton's split-KV decode kernel. flash-attn-4 takes no split on Hopper, so in its one call for the
  whole batch each decode's 8k keys were walked by one program per head: on the H200 one layer of W-L's
  chunk-and-decodes step took 628 us against 510 us for the same prompt FLOPs without decodes.
"""
from __future__ import annotations

import torch

from attention.base import AttentionBackend, AttentionImpl, AttentionMetadata, GraphSupport
from attention.flash_attn import (FlashAttn4Backend, FlashAttn4Impl, flash_attn_4_block_size, flash_attn_4_dense,
                                  flash_attn_4_paged)
from attention.triton_paged import TritonAttentionBackend, TritonAttentionImpl, write_kv_triton

FLASH_MIN_TOKENS = 1024
FLASH_MIN_QUERY_LEN = 2048


def cached_prefill_part(meta: AttentionMetadata) -> AttentionMetadata:
    """The batch's first prefills, those before its fresh tail: views of `meta`'s tensors."""
    n = meta.num_prefills - meta.num_fresh_prefills
    t = meta.num_prefill_tokens - meta.num_fresh_prefill_tokens
    return AttentionMetadata(n, t, 0, meta.slot_mapping[:t], meta.block_tables[:n], meta.seq_lens[:n],
                             meta.context_lens[:n], meta.query_start_loc[:n + 1], meta.seq_start_loc[:n + 1],
                             meta.max_query_len, meta.max_seq_len)


def decode_part(meta: AttentionMetadata) -> AttentionMetadata:
    """The batch's decodes as a decode-only batch: views of `meta`'s tensors. Decode-only kernels find a
    sequence's one query row by its index, so query_start_loc (offset by the prefill tokens) goes unread."""
    n, p = meta.num_prefills, meta.num_prefill_tokens
    return AttentionMetadata(0, 0, meta.num_decode_tokens, meta.slot_mapping[p:], meta.block_tables[n:],
                             meta.seq_lens[n:], meta.context_lens[n:], meta.query_start_loc[n:],
                             meta.seq_start_loc[n:], 1, meta.max_seq_len)


class HybridAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self.decode = TritonAttentionImpl(num_heads, head_dim, scale, num_kv_heads)
        self.prefill = FlashAttn4Impl(num_heads, head_dim, scale, num_kv_heads)

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        long_prefill = (meta.num_prefills and query.shape[0] > FLASH_MIN_TOKENS
                        and meta.max_query_len >= FLASH_MIN_QUERY_LEN)
        if not long_prefill:
            return self.decode.forward(query, key, value, key_cache, value_cache, meta)
        write_kv_triton(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        self._cached_prefills(out, query, key_cache, value_cache, meta)
        self._fresh_prefills(out, query, key, value, meta)
        if meta.num_decode_tokens:
            p = meta.num_prefill_tokens
            out[p:] = self.decode.attend(query[p:], key_cache, value_cache, decode_part(meta))
        return out

    def _cached_prefills(self, out, query, key_cache, value_cache, meta: AttentionMetadata) -> None:
        part = cached_prefill_part(meta)
        t = part.num_prefill_tokens
        if not part.num_prefills:
            return
        if t < FLASH_MIN_QUERY_LEN:
            out[:t] = self.decode.attend(query[:t], key_cache, value_cache, part)
            return
        out[:t] = flash_attn_4_paged(query[:t], key_cache, value_cache, part.query_start_loc, part.seq_lens,
                                     part.block_tables, part.max_query_len, self.scale)

    def _fresh_prefills(self, out, query, key, value, meta: AttentionMetadata) -> None:
        if not meta.num_fresh_prefills:
            return
        n, p = meta.num_prefills - meta.num_fresh_prefills, meta.num_prefill_tokens
        s = p - meta.num_fresh_prefill_tokens
        cu_seqlens = meta.query_start_loc[n:meta.num_prefills + 1] - s
        out[s:p] = flash_attn_4_dense(query[s:p], key[s:p], value[s:p], cu_seqlens, meta.max_query_len, self.scale)

    def warm_up(self, key_cache: torch.Tensor, value_cache: torch.Tensor, metas: list[AttentionMetadata]) -> None:
        """Triton's kernels for every meta and for each prefill meta's first sequence as a decode (a long
        step's decodes run eagerly, at widths no decode graph holds); flash-attn-4's paged and dense ones."""
        prefills = [m for m in metas if m.num_prefills]
        self.decode.warm_up(key_cache, value_cache, metas + [_first_as_decode(m) for m in prefills])
        self.prefill.warm_up(key_cache, value_cache, prefills)
        for m in (m for m in prefills if m.num_fresh_prefills):
            query = key_cache.new_zeros((m.num_tokens, self.num_heads, self.head_dim))
            kv = key_cache.new_zeros((m.num_tokens, self.num_kv_heads, self.head_dim))
            flash_attn_4_dense(query, kv, kv, m.query_start_loc, m.max_query_len, self.scale)


def _first_as_decode(meta: AttentionMetadata) -> AttentionMetadata:
    """meta's first sequence read as a decode: one query token over its keys (a warm-up shape)."""
    return AttentionMetadata(0, 0, 1, meta.slot_mapping[:1], meta.block_tables[:1], meta.seq_lens[:1],
                             meta.context_lens[:1], meta.query_start_loc[:2], meta.seq_start_loc[:2], 1,
                             meta.max_seq_len)


class HybridAttentionBackend(AttentionBackend):
    name = "triton+flash-attn-4"
    impl_cls = HybridAttentionImpl
    graph_support = GraphSupport.MIXED  # graphs capture decode-only and short mixed steps: the Triton path
    supported_dtypes = FlashAttn4Backend.supported_dtypes

    @classmethod
    def preferred_block_size(cls, head_dim: int, device: torch.device) -> int:
        # flash-attn-4's page size for its TMA loads. Triton's decode kernel reads a 128-token page in two
        # contiguous 64-key tiles.
        return flash_attn_4_block_size(head_dim, device)

    @classmethod
    def check_config(cls, head_dim: int, block_size: int, device: torch.device) -> None:
        TritonAttentionBackend.check_config(head_dim, block_size, device)
        FlashAttn4Backend.check_config(head_dim, block_size, device)
