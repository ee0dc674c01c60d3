"""Llama / Mistral / Qwen2 / Qwen3 over a paged KV cache, gpt-fast style: one file, top to bottom.

A step is one flat batch of tokens (prefills first, then decodes, as attention/base.py lays out).
Every token carries its own absolute position, so RoPE is a gather from a precomputed cos/sin table
and the whole forward has no host syncs and no branching on tensor values (CUDA-graph friendly;
the attention backend decides for itself whether it is).

Numerics follow Hugging Face: RMSNorm in float32, inv_freq in float32, rotate-half RoPE applied in
the model dtype, logits in the model dtype then cast to float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from attention.base import AttentionBackend, AttentionMetadata
from engine.kernels import add_rms_norm, pack_weight_for_cpu, packed_linear, packed_rows, rope_, silu_and_mul
from engine.mlp_kernel import DEFAULT_TILE, FUSED_MIN_TOKENS, fused_pays, gate_up_silu_fused

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArgs:
    """What the modules need from a Hugging Face config; architecture quirks are resolved here only."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict
    qkv_bias: bool  # Qwen2 always; Llama / Qwen3 with attention_bias
    o_bias: bool  # attention_bias of Llama / Qwen3 also covers o_proj; Qwen2's o_proj has none
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k, before RoPE
    tie_word_embeddings: bool

    @classmethod
    def from_hf(cls, cfg) -> "ModelArgs":
        model_type = getattr(cfg, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported; supported: {MODEL_TYPES}")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        num_heads = cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            rope=rope_parameters(cfg),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


def rope_parameters(cfg) -> dict:
    """RoPE settings as transformers 5 writes them (`rope_parameters`), else from the legacy
    `rope_theta` / `rope_scaling` attributes. Returns a dict with at least rope_type and rope_theta."""
    params = getattr(cfg, "rope_parameters", None)
    if not params:
        params = dict(getattr(cfg, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    params = dict(params)
    # Old configs spell the type "type".
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"RoPE type {params['rope_type']!r} is not implemented; supported: {ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not implemented")
    return params


def rope_inv_freq(rope: dict, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, scaled as the rope type says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    if rope["rope_type"] == "linear":
        return inv_freq / rope["factor"]
    if rope["rope_type"] == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths slowed down by `factor`, short ones kept, a linear blend in between.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """A [max_positions, head_dim] table of (cos | sin), gathered by position each step."""

    def __init__(self, rope: dict, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = rope, head_dim, max_positions
        self.register_buffer("cos_sin_cache", self._table(), persistent=False)

    def _table(self) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.rope, self.head_dim)  # [head_dim // 2]
        positions = torch.arange(self.max_positions, device="cpu").float()
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2], as HF: one fp32 product
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def reset_cache(self) -> None:
        """Rebuild the table on the buffer's device, in float32; needed after `to_empty()` (the loader builds
        on the meta device) and after `model.to(dtype)`, which would otherwise leave it in bfloat16."""
        self.cos_sin_cache = self._table().to(self.cos_sin_cache.device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # q [T, H, D], k [T, KVH, D]: HF's x * cos + rotate_half(x) * sin (kernels.rope_ref).
        return rope_(positions, q, k, self.cos_sin_cache)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype: HF's order, so bf16 results match bit for bit.
        shape = x.shape
        return add_rms_norm(x.reshape(-1, shape[-1]), None, self.weight, self.eps)[0].view(shape)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear that, after pack_for_cpu(), multiplies through a oneDNN-packed copy of its weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def pack_for_cpu(self) -> bool:
        weight = pack_weight_for_cpu(self.weight)
        if weight is not None:
            self.packed = weight, None if self.bias is None else self.bias.detach()
        return weight is not None

    def drop_dense_weight(self) -> None:
        """Once packed, nothing reads the dense weight again: free it (an empty parameter stays, so the
        module keeps nn.Linear's attributes). No way back to F.linear after this."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.packed is None else packed_linear(x, *self.packed)


class MergedLinear(Linear):
    """Several HF projections stacked along the output rows (q|k|v, gate|up): one matmul instead of
    several. The loader copies HF's projection i into rows shard_slice(i)."""

    def __init__(self, in_features: int, shard_sizes: tuple[int, ...], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_sizes = shard_sizes
        self._offsets = tuple(accumulate(shard_sizes, initial=0))

    def shard_slice(self, shard_id: int) -> slice:
        return slice(self._offsets[shard_id], self._offsets[shard_id + 1])


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = MergedLinear(args.hidden_size, (q_size, kv_size, kv_size), bias=args.qkv_bias)
        self.o_proj = Linear(q_size, args.hidden_size, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.attn = backend.impl_cls(args.num_heads, args.head_dim, args.head_dim ** -0.5, args.num_kv_heads)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = self.attn.forward(q, k, v, key_cache, value_cache, meta)  # [T, H, D]
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    # Steps of fused_min_tokens rows or more run gate/up and SiLU*mul as one kernel (engine/mlp_kernel.py says
    # when that pays); class-wide, read at each forward (benchmarks/profile_workload.py sets them for an A/B).
    fused_min_tokens = FUSED_MIN_TOKENS
    fused_tile = DEFAULT_TILE

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = MergedLinear(args.hidden_size, (inter, inter), bias=args.mlp_bias)
        self.down_proj = Linear(inter, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        if fused_pays(x, self.fused_min_tokens) and proj.packed is None:
            return self.down_proj(gate_up_silu_fused(x, proj.weight, proj.bias, self.fused_tile))
        return self.down_proj(silu_and_mul(proj(x)))  # [T, 2 * inter] -> [T, inter] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, backend)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added to `residual` (the add is fused into the norm)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        x = self.self_attn(x, positions, rotary, key_cache, value_cache, meta)
        x, residual = self.post_attention_layernorm.add_norm(x, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """Parameter names are HF's without the `model.` prefix, except the merged qkv_proj / gate_up_proj."""

    def __init__(self, hf_config, backend: type[AttentionBackend]) -> None:
        super().__init__()
        args = ModelArgs.from_hf(hf_config)
        self.args = args
        # Built on the meta device (engine/loader.py): a weight given skips nn.Embedding's normal_ init, whose
        # meta path imports torch._dynamo (~1 s of every CPU server start, 2026-12-07).
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size,
                                         _weight=torch.empty(args.vocab_size, args.hidden_size))
        self.rotary_emb = RotaryEmbedding(args.rope, args.head_dim, args.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(args, backend) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        # Tied: the logits reuse embed_tokens.weight, so no lm_head parameter exists to untie by accident.
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.packed_logits_weight: torch.Tensor | None = None  # see pack_for_cpu

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, positions, self.rotary_emb, key_cache, value_cache, meta)
        return self.norm.add_norm(h, residual)[0]  # [T, hidden]

    @property
    def logits_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def is_packed(self) -> bool:
        return self.packed_logits_weight is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # [n, vocab] in the model dtype: greedy rows need only an argmax; the sampler casts where it computes.
        if self.is_packed:
            return packed_linear(hidden, self.packed_logits_weight, None)
        return F.linear(hidden, self.logits_weight)

    def pack_for_cpu(self) -> bool:
        """Pack every matmul's weight for oneDNN (float32 on a CPU), then free the dense copies: all but the
        embedding, which its lookup needs (tied, it is also the logits' weight). Call after loading.
        Returns whether it did."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if not all([m.pack_for_cpu() for m in linears]):
            for m in linears:
                m.packed = None
            return False
        self.packed_logits_weight = pack_weight_for_cpu(self.logits_weight)
        for m in linears:
            m.drop_dense_weight()
        if self.lm_head is not None and self.packed_logits_weight is not None:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.new_empty(0), requires_grad=False)
        return True

    @torch.inference_mode()
    def warm_up_packed(self, max_rows: int, max_logit_rows: int) -> None:
        """Run one layer's packed matmuls once per row count packed_linear can see (and the logits' up to
        max_logit_rows): oneDNN builds and keeps a primitive per shape, so their memory is taken at start,
        not while serving. The layers share shapes, so one layer covers them all."""
        if not self.is_packed:
            return
        linears = [m for m in self.layers[0].modules() if isinstance(m, Linear)]
        for rows in sorted({packed_rows(n) for n in range(1, max_rows + 1)}):
            for m in linears:
                m(torch.zeros(rows, m.in_features))
        for rows in sorted({packed_rows(n) for n in range(1, max_logit_rows + 1)}):
            self.compute_logits(torch.zeros(rows, self.args.hidden_size))
