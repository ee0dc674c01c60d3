"""Attention backend registry.

    get_backend(name, device, head_dim, block_size) -> type[AttentionBackend]
    explain_backend_choice(name, device, head_dim, block_size) -> (type[AttentionBackend], reason: str)

`name` is "auto" or one of BACKEND_NAMES. An explicit name that cannot run the configuration raises
ValueError saying why (package missing, head size, block size, device). "auto" never raises: on CPU
it is "torch"; on CUDA it is the first of CUDA_AUTO_ORDER that is installed and accepts the
configuration, else "torch". GPU backends are imported lazily, so a CPU machine never imports triton
or flash_attn.
"""
from __future__ import annotations

import importlib

import torch

from attention.base import AttentionBackend

# name -> (module, class): imported only when asked for.
_REGISTRY = (
    ("torch", "attention.torch_ref", "TorchAttentionBackend"),
    ("triton", "attention.triton_paged", "TritonAttentionBackend"),
    ("flash-attn", "attention.flash_attn", "FlashAttnBackend"),
    ("flash-attn-4", "attention.flash_attn", "FlashAttn4Backend"),
    ("triton+flash-attn-4", "attention.hybrid", "HybridAttentionBackend"),
)
BACKEND_NAMES = tuple(name for name, _, _ in _REGISTRY)

# The "auto" order on CUDA, measured on the H200 on 2026-12-02 (docs/benchmarks.md, one machine session,
# Qwen2.5-0.5B shape, output tok/s, median of 3): triton 54.4k on W-B and 38.0k on W-A, flash-attn-4 52.7k
# and 44.3k, the hybrid (Triton decode graphs, flash-attn-4 prefills) 45.9k and 42.1k; vLLM 0.24.0 24.1k
# and 25.5k beside them. No backend wins both; triton is first: the best on W-B, within 14% of the best on
# W-A, greedy bfloat16 tokens closest to transformers' (7 of 8 SmolLM2 prompts over 32 tokens against
# flash-attn-4's 5), float32-capable, and steady: runs through flash-attn-4 had outlier repetitions (W-A
# 6.2 s against ~3 s), which look like its just-in-time compiles of new shape variants (not confirmed).
CUDA_AUTO_ORDER = ("triton", "flash-attn-4", "triton+flash-attn-4", "flash-attn")


def load_backend(name: str) -> type[AttentionBackend]:
    """The backend class by name. Raises ValueError for an unknown name or a missing package."""
    for entry_name, module, cls_name in _REGISTRY:
        if entry_name == name:
            try:
                return getattr(importlib.import_module(module), cls_name)
            except ImportError as e:
                raise ValueError(f"attention backend {name!r} is not available: {e}") from e
    raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {BACKEND_NAMES}")


def _checked(name: str, device: torch.device, head_dim: int, block_size: int,
             dtype: torch.dtype | None) -> type[AttentionBackend]:
    backend = load_backend(name)
    backend.check_config(head_dim, block_size, device)
    if dtype is not None and dtype not in backend.supported_dtypes:
        raise ValueError(f"attention backend {name!r} supports {[str(d)[6:] for d in backend.supported_dtypes]}, "
                         f"not {str(dtype)[6:]}")
    return backend


def explain_backend_choice(name: str, device: torch.device | str, head_dim: int, block_size: int,
                           dtype: torch.dtype | None = None) -> tuple[type[AttentionBackend], str]:
    """The backend for this configuration and a one-line human-readable reason."""
    device = torch.device(device)
    if name != "auto":
        return _checked(name, device, head_dim, block_size, dtype), f"{name!r} was asked for"
    if device.type != "cuda":
        return _checked("torch", device, head_dim, block_size, dtype), f"auto on {device.type}: 'torch'"
    skipped = []
    for candidate in CUDA_AUTO_ORDER:
        try:
            backend = _checked(candidate, device, head_dim, block_size, dtype)
        except ValueError as e:
            skipped.append(f"{candidate}: {e}")
            continue
        reason = f"auto on cuda: {candidate!r}, the fastest usable of {CUDA_AUTO_ORDER}"
        return backend, reason + (f" (skipped {'; '.join(skipped)})" if skipped else "")
    return _checked("torch", device, head_dim, block_size, dtype), f"auto on cuda: 'torch' ({'; '.join(skipped)})"


def get_backend(name: str, device: torch.device | str, head_dim: int, block_size: int,
                dtype: torch.dtype | None = None) -> type[AttentionBackend]:
    return explain_backend_choice(name, device, head_dim, block_size, dtype)[0]


__all__ = ["BACKEND_NAMES", "CUDA_AUTO_ORDER", "explain_backend_choice", "get_backend", "load_backend"]
