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

# The "auto" order on CUDA (docs/benchmarks.md). First is the hybrid: Triton for every step except those with
# a prompt chunk of 2,048 tokens or more, which go to flash-attn-4 (attention/hybrid.py). On the H200 on
# 2026-12-04 it matched Triton on W-A (51.6k against 51.7k output tok/s) and beat it on W-L (2.03 s against
# 2.21 s). That was measured with the earlier rule that sent every long step to flash-attn-4, which cost W-B
# 10%; W-B's 512-token prompts now stay on Triton. Next is Triton alone: float32-capable, with greedy
# bfloat16 tokens closest to transformers'. The earlier measurements of 2026-12-02 (W-B: triton 54.4k,
# flash-attn-4 52.7k; W-A: 38.0k and 44.3k) put triton ahead of flash-attn-4 alone. flash-attn-4 is also
# slower on decode batches and had outlier repetitions.
CUDA_AUTO_ORDER = ("triton+flash-attn-4", "triton", "flash-attn-4", "flash-attn")


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
