"""The attention interface, after the seed's four roles.

- AttentionBackend: a name, the KV-cache layout, what head sizes / block sizes it supports, its Impl.
- AttentionMetadata: one step's tensors (built by attention.metadata.AttentionMetadataBuilder).
- AttentionImpl: writes new K/V into the paged cache through slot_mapping, then attends.

Token layout of one step (the seed's): prefill tokens first, decode tokens after, one flat batch.

    |<------- num_prefill_tokens ------->|<----- num_decode_tokens ----->|
    |<-prefill_0->|...|<-prefill_{P-1}->|<-decode_0->|...|<-decode_{D-1}->|

A "prefill" is any sequence with query_len > 1 this step (a fresh prompt, or a chunk of one over
cached context); a "decode" has query_len == 1. Vocabulary per sequence:
context_len (tokens already in the cache), query_len (new tokens now), seq_len = context_len + query_len.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

class GraphSupport(enum.Enum):
    """Which steps a backend's forward can be captured in a CUDA graph for, and replayed with new metadata:
    it must read nothing on the host. DECODE: decode-only steps. MIXED: also steps with prefills, in the
    mixed graphs' layout (attention.metadata: every sequence a prefill, empty padded sequences)."""

    NEVER = "never"
    DECODE = "decode"
    MIXED = "mixed"


PAD_SLOT_ID = -1  # slot_mapping entry of a padding token: its K/V are not written
DEFAULT_BLOCK_SIZE = 16


@dataclass
class AttentionMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset, PAD_SLOT_ID for padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


class AttentionImpl:
    """Paged attention for one layer."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        raise NotImplementedError

    def warm_up(self, key_cache: torch.Tensor, value_cache: torch.Tensor, metas: list[AttentionMetadata]) -> None:
        """Compile now every kernel variant an eager step of the shapes in `metas` may pick later, so none
        compiles mid-serving (none here; JIT backends override it). The metas' slots are PAD_SLOT_ID: nothing
        is written to the caches."""


class AttentionBackend:
    name: str = ""
    impl_cls: type[AttentionImpl] = AttentionImpl
    supported_head_sizes: tuple[int, ...] = (32, 64, 96, 128, 160, 192, 224, 256)
    graph_support: GraphSupport = GraphSupport.NEVER
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

    @classmethod
    def check_config(cls, head_dim: int, block_size: int, device: torch.device) -> None:
        """Raise ValueError with a clear message if this backend cannot run the configuration."""
        if head_dim not in cls.supported_head_sizes:
            raise ValueError(f"attention backend {cls.name!r} supports head sizes {cls.supported_head_sizes}, "
                             f"not {head_dim}")

    @classmethod
    def preferred_block_size(cls, head_dim: int, device: torch.device) -> int:
        """The KV block size the engine uses when none is set: 16 (vLLM's), unless a backend's kernels load
        whole pages faster at another size."""
        return DEFAULT_BLOCK_SIZE

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        # One such tensor for K and one for V, per layer: the flash-attn family's paged layout.
        return (num_blocks, block_size, num_kv_heads, head_dim)
