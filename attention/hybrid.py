"""Decode-only steps through our Triton kernel, steps with prefills through flash-attn-4.

Both read the same paged KV layout and the same metadata, and each is the faster one on its side
(docs/benchmarks.md, "Attention kernels": Triton 1.4-3.2x faster on decode batches, flash-attn-4 up
to 2.2x faster on prefill-heavy batches). Decode steps are the ones replayed from CUDA graphs, so the
graphs hold only the Triton path; prefill steps run eagerly through flash-attn-4.
"""
from __future__ import annotations

import torch

from attention.base import AttentionBackend, AttentionImpl, AttentionMetadata
from attention.flash_attn import FlashAttn4Backend, FlashAttn4Impl
from attention.triton_paged import TritonAttentionBackend, TritonAttentionImpl


class HybridAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__(num_heads, head_dim, scale, num_kv_heads)
        self.decode = TritonAttentionImpl(num_heads, head_dim, scale, num_kv_heads)
        self.prefill = FlashAttn4Impl(num_heads, head_dim, scale, num_kv_heads)

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        impl = self.prefill if meta.num_prefills else self.decode
        return impl.forward(query, key, value, key_cache, value_cache, meta)


class HybridAttentionBackend(AttentionBackend):
    name = "triton+flash-attn-4"
    impl_cls = HybridAttentionImpl
    supports_cuda_graphs = True  # graphs capture decode-only steps: the Triton path
    supported_dtypes = FlashAttn4Backend.supported_dtypes

    @classmethod
    def check_config(cls, head_dim: int, block_size: int, device: torch.device) -> None:
        TritonAttentionBackend.check_config(head_dim, block_size, device)
        FlashAttn4Backend.check_config(head_dim, block_size, device)
