"""Process memory: the C allocator's free pages (glibc only; elsewhere nothing changes), and the garbage
collector's view of what a serving process built at startup.

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
import gc


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


def freeze_startup_objects() -> int:
    """Collect, then move every object alive now out of the collector's reach (gc.freeze); returns how many.

    A process that built an engine holds ~360k container objects (torch, transformers, the model's
    modules) that live as long as it does. Every full collection walks them all: ~250 ms on this
    project's CPU, which lands on one step in a few thousand and stalls every request in the batch
    (docs/benchmarks.md). Frozen, a full collection walks only what was made since. Only for processes
    that build one engine and serve with it (the server, benchmarks): a frozen object that later becomes
    part of a garbage cycle is never freed."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


STEP_LOOP_YOUNG_THRESHOLD = 10_000  # generation-0 threshold of a process that runs the step loop (Python: 700)
DEFAULT_THRESHOLDS = (700, 10, 10)  # Python's


def collect_young_less_often() -> None:
    """For a process that runs the step loop, after freeze_startup_objects: generation 0 is collected every
    STEP_LOOP_YOUNG_THRESHOLD net allocations instead of 700. A decode step of 256 requests allocates a few
    thousand objects that refcounting frees (outputs, lists, metadata) and each young collection walked the
    step's live state again. benchmarks/host_step.py --batch 256 --decode-only, 2 rounds of 5 runs on this
    project's CPU: frozen heap 1.306-1.362 ms/step; this 1.242-1.276; the collector off 1.244-1.273."""
    gc.set_threshold(STEP_LOOP_YOUNG_THRESHOLD, *DEFAULT_THRESHOLDS[1:])
