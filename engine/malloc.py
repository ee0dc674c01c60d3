"""The C allocator and the CPU engine's memory (glibc only; elsewhere nothing changes).

glibc serves a request of M_MMAP_THRESHOLD bytes or more by its own mmap, given back on free; each such
free of up to 32 MiB raises the threshold to that size, and the packed matmuls' warm-up frees ~30 MiB
buffers, so afterwards a step's buffers are carved from the engine thread's arena. That is what keeps a
CPU step fast: pinning the threshold at 1 MiB kept every step's logits and activations in fresh mappings
and cost 2.8 million page faults and half the throughput on `cpu-smollm2` (docs/benchmarks.md). But the
arena's freed pieces stay resident: a soak's server grew 20-50 MB that way. So the engine gives the
arena's free pages back whenever it goes idle (and after the warm-up): under load the arena holds what
the steps reuse; idle, the process is back to what it really holds.
"""
from __future__ import annotations

import ctypes


def trim_free_memory() -> bool:
    """Give the allocator's free pages back to the system (malloc_trim(0)). Returns whether it could:
    False where the C library has no malloc_trim (not glibc)."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    malloc_trim(0)
    return True
