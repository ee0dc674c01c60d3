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

A long step goes to flash-attn-4 whole, decodes and short chunks included. Splitting it by kind (fresh prompts
over their own K/V without pages, short cached chunks and decodes to Triton's kernels) was built, checked
against the reference and timed on an H100 (docs/benchmarks.md, twenty-first session). One layer took 478,
628 and 571 us against the single call's 459, 555 and 543 on W-L's three step shapes (128-token pages, where
flash-attn-4 already loads pages by TMA). W-L end to end took 2.26 against 2.29 s, one process each, within
what separates two processes. So it was taken out.
"""
from __future__ import annotations

import torch

from attention.base import AttentionBackend, AttentionImpl, AttentionMetadata, GraphSupport
from attention.flash_attn import FlashAttn4Backend, FlashAttn4Impl, flash_attn_4_block_size
from attention.triton_paged import TritonAttentionBackend, TritonAttentionImpl

FLASH_MIN_TOKENS = 1024
FLASH_MIN_QUERY_LEN = 2048


class HybridAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self.decode = TritonAttentionImpl(num_heads, head_dim, scale, num_kv_heads)
        self.prefill = FlashAttn4Impl(num_heads, head_dim, scale, num_kv_heads)

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        long_prefill = (meta.num_prefills and query.shape[0] > FLASH_MIN_TOKENS
                        and meta.max_query_len >= FLASH_MIN_QUERY_LEN)
        impl = self.prefill if long_prefill else self.decode
        return impl.forward(query, key, value, key_cache, value_cache, meta)

    def warm_up(self, key_cache: torch.Tensor, value_cache: torch.Tensor, metas: list[AttentionMetadata]) -> None:
        self.decode.warm_up(key_cache, value_cache, metas)
        self.prefill.warm_up(key_cache, value_cache, [m for m in metas if m.num_prefills])


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
