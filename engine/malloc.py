"""The C allocator's settings for the CPU engine (glibc only; elsewhere nothing changes).

glibc serves a request of M_MMAP_THRESHOLD bytes or more (128 KiB at start) by its own mmap, returned to
the system on free, but each such free of up to 32 MiB raises the threshold to its size. The packed
matmuls' warm-up frees buffers of ~30 MiB (the logits of 160+ rows), so afterwards every step's buffers
are carved from the engine thread's arena, whose freed pieces stay resident: the soak's server grew
20-50 MB that way (docs/benchmarks.md). A threshold set explicitly stays where it is set.
"""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number, from glibc's malloc.h
# Larger buffers (a step's activations, logits) get their own mapping; smaller ones come from the arena.
# 1 MiB kept the soak flat; 4 MiB did too but started 40 MB higher; 64 KiB was no lower than 1 MiB.
MMAP_THRESHOLD_BYTES = 1 << 20


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at nbytes, so that it no longer rises by itself. Returns whether it
    was set: False where the C library has no mallopt (or, like musl, ignores it)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))
