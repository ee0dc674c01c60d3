"""Two flash-attn backends behind the same interface; each imports its package only when used.

- "flash-attn": the flash-attn 2.x API, as the seed calls it: `flash_attn_varlen_func(..., block_table=)`
  for the prefill part (fresh prompts and chunks over cached context alike) and
  `flash_attn_with_kvcache` for the decodes. Upstream 2.x takes paged KV only with a block size that
  is a multiple of 256.
- "flash-attn-4": `flash_attn.cute.flash_attn_varlen_func` with page_table / seqused_k: ONE call for
  the whole mixed batch, any block size (Hopper and Blackwell).

New K/V go in with our Triton write kernel when triton is installed, else with index_copy_.
"""
from __future__ import annotations

import torch

from attention.base import DEFAULT_BLOCK_SIZE, AttentionBackend, AttentionImpl, AttentionMetadata, GraphSupport


def _write_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Triton's copy on a CUDA device, PyTorch's elsewhere (a CPU host may have triton installed, without a
    driver for it: xgrammar pulls it in)."""
    if key.is_cuda:
        try:
            from attention.triton_paged import write_kv_triton as write
        except ImportError:
            from attention.torch_ref import write_kv_torch as write
    else:
        from attention.torch_ref import write_kv_torch as write
    write(key, value, key_cache, value_cache, slot_mapping)


def _check_cuda(name: str, device: torch.device) -> None:
    if torch.device(device).type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, not {device}")


class FlashAttnImpl(AttentionImpl):
    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        _write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
        p, n = meta.num_prefill_tokens, meta.num_prefills
        if n:
            out[:p] = flash_attn_varlen_func(
                q=query[:p], k=key_cache, v=value_cache,
                cu_seqlens_q=meta.query_start_loc[:n + 1], max_seqlen_q=meta.max_query_len,
                cu_seqlens_k=meta.seq_start_loc[:n + 1], max_seqlen_k=meta.max_seq_len,
                softmax_scale=self.scale, causal=True, block_table=meta.block_tables[:n])
        if meta.num_decode_tokens:
            out[p:] = flash_attn_with_kvcache(
                query[p:].unsqueeze(1), key_cache, value_cache,  # [num_decodes, 1, num_heads, head_dim]
                cache_seqlens=meta.seq_lens[n:], block_table=meta.block_tables[n:],
                softmax_scale=self.scale, causal=True).squeeze(1)
        return out


class FlashAttnBackend(AttentionBackend):
    name = "flash-attn"
    impl_cls = FlashAttnImpl
    supported_dtypes = (torch.bfloat16, torch.float16)
    graph_support = GraphSupport.NEVER  # the prefill call takes host ints; decode-only would be fine, unverified

    @classmethod
    def preferred_block_size(cls, head_dim: int, device: torch.device) -> int:
        return 256  # the only page sizes upstream 2.x takes (check_config)

    @classmethod
    def check_config(cls, head_dim: int, block_size: int, device: torch.device) -> None:
        super().check_config(head_dim, block_size, device)
        _check_cuda(cls.name, device)
        if block_size % 256 != 0:
            raise ValueError(f"attention backend 'flash-attn' (flash-attn 2.x) needs block_size to be a "
                             f"multiple of 256 for a paged KV cache, not {block_size}")
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
        except ImportError as e:
            raise ValueError(f"attention backend 'flash-attn' needs the flash-attn 2.x package: {e}") from e


class FlashAttn4Impl(AttentionImpl):
    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> torch.Tensor:
        from flash_attn.cute import flash_attn_varlen_func

        _write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        # max_seqlen_k stays unset: the kernel then bounds keys by the block-table width, a shape,
        # so nothing here depends on this step's lengths beyond max_query_len (1 for decode graphs).
        # num_splits=1: flash-attn-4 4.0.0b36 asserts "SplitKV not supported on SM 9.0" otherwise.
        out, _ = flash_attn_varlen_func(
            query, key_cache, value_cache, cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len,
            seqused_k=meta.seq_lens, page_table=meta.block_tables, softmax_scale=self.scale, causal=True,
            num_splits=1)
        return out  # [num_tokens, num_heads, head_dim]

    def warm_up(self, key_cache: torch.Tensor, value_cache: torch.Tensor, metas: list[AttentionMetadata]) -> None:
        """flash-attn-4 compiles its kernel (CuTe DSL) on the first call with a new compile key, which holds no
        length: one call per meta compiles what a step of that kind needs. Otherwise the first long prompt a
        server sees waits for the compile."""
        for meta in metas:
            query = key_cache.new_zeros((meta.num_tokens, self.num_heads, self.head_dim))
            kv = key_cache.new_zeros((meta.num_tokens, self.num_kv_heads, self.head_dim))
            self.forward(query, kv, kv, key_cache, value_cache, meta)


def flash_attn_4_block_size(head_dim: int, device: torch.device) -> int:
    """128 on Hopper for head dims up to 128: flash-attn-4's SM90 forward walks keys in tiles of 128 there and
    loads a page by TMA only when the page is exactly one tile; any other page size takes its cp.async gather
    path (flash_attn/cute/interface.py, paged_kv_non_tma). On the H200, one layer of two fresh 8k prompts took
    510 us through 16-token pages against 445 us over the same K/V unpaged (docs/benchmarks.md, W-L)."""
    if torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 and head_dim <= 128:
        return 128
    return DEFAULT_BLOCK_SIZE


class FlashAttn4Backend(AttentionBackend):
    name = "flash-attn-4"
    impl_cls = FlashAttn4Impl
    supported_dtypes = (torch.bfloat16, torch.float16)  # its kernels have no float32 path
    # Captured and replayed with new metadata on the H200 (tests/test_attention_gpu.py's graph test):
    # nothing is read on the host, and its one host int, max_query_len, is 1 in every decode graph.
    graph_support = GraphSupport.DECODE

    @classmethod
    def preferred_block_size(cls, head_dim: int, device: torch.device) -> int:
        return flash_attn_4_block_size(head_dim, device)

    @classmethod
    def check_config(cls, head_dim: int, block_size: int, device: torch.device) -> None:
        super().check_config(head_dim, block_size, device)
        _check_cuda(cls.name, device)
        major = torch.cuda.get_device_capability(device)[0]
        if major < 9:
            raise ValueError(f"attention backend 'flash-attn-4' needs a Hopper or newer GPU (sm90+), not sm{major}x")
        try:
            from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
        except ImportError as e:
            raise ValueError(f"attention backend 'flash-attn-4' needs the flash-attn-4 package: {e}") from e
