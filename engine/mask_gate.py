"""The device waits for a step's grammar masks itself (structured_outputs_wait "device"), so the engine thread
queues a constrained step whole, sampling included, as it queues an unconstrained one.

Why: on the H200 the forward of a W-B step (2.5-3.6 ms) is shorter than the engine thread's own work on a
constrained step. With the host waiting for the masks before it queues the sampling, every section of the
step sat between one forward and the next, and the device waited 0.66-1.16 ms a step for the masks
(json 100% at 0.79x of json 0%; docs/benchmarks.md, sixteenth session).

How: each grammar process writes its rows of the shared, page-locked mask buffer, then its flag (an int64 in
the same mapping: the number of the last Step it filled). A side stream runs `_wait` (one program that reads
the flags until every one has reached the step's number; volatile loads of host memory go over the bus each
time), then copies the rows to the device; the sampling, queued on the main stream behind the forward, waits
for that copy. The copy thus overlaps the forward when the masks come early. The spinning program takes one
warp of one SM while the forward runs beside it. It is the one hot loop of this file; `reached` is its rule.

A flag that is never written would stall the device: the link writes the flags itself for a grammar process
that is lost or not ready, for a step given up before its masks were asked for (GrammarLink.release), and at
shutdown.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

RELEASED = 2 ** 62  # a flag value past every step: nothing waits on it


if triton is not None:
    @triton.jit(do_not_specialize=["seq"])  # one compile for every step number
    def _wait(flags_ptr, count, seq):
        k = 0
        while k < count:
            if tl.load(flags_ptr + k, volatile=True) >= seq:
                k += 1


def available() -> bool:
    return triton is not None


def reached(flags: torch.Tensor, count: int, seq: int) -> bool:
    """The rule `_wait` waits for: every one of the first `count` flags is at least `seq`."""
    return bool((flags[:count] >= seq).all())


def wait(flags: torch.Tensor, count: int, seq: int) -> None:
    """Queue, on the current stream, a wait until reached(flags, count, seq). flags: int64, page-locked host
    memory (or device memory) the device can read."""
    _wait[(1,)](flags, count, seq, num_warps=1)


class MaskGate:
    """The side stream and the device's mask buffers: `masks` (host, shared with the grammar processes, page-locked)
    is copied buffer by buffer into `device_masks` once its flags are reached."""

    def __init__(self, masks: torch.Tensor, flags: torch.Tensor, shards: int, device: torch.device) -> None:
        self.masks, self.flags, self.shards, self.device = masks, flags, shards, device
        self.device_masks = torch.empty(masks.shape, dtype=masks.dtype, device=device)
        self.stream = torch.cuda.Stream(device)
        self.freed = [None] * masks.shape[0]  # per buffer: an event after the last kernel that read its rows

    def copy_when_filled(self, buffer: int, rows: int, seq: int) -> torch.Tensor:
        """The buffer's first `rows` rows on the device, copied once every flag reached `seq`; the current stream
        waits for that copy. Queued only: the host does not wait."""
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if self.freed[buffer] is not None:
                self.stream.wait_event(self.freed[buffer])
            wait(self.flags, self.shards, seq)
            out = self.device_masks[buffer, :rows]
            out.copy_(self.masks[buffer, :rows], non_blocking=True)
        main.wait_stream(self.stream)
        return out

    def check(self) -> str | None:
        """None if `wait` compiles and returns here for flags already reached (step 0: the flags start at 0, and
        steps are numbered from 1), with the shard count it will serve (a count of 1 compiles apart); else why
        not (the engine then waits for the masks on the host)."""
        try:
            with torch.cuda.stream(self.stream):
                wait(self.flags, self.shards, 0)
            self.stream.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported; the host waits instead
            return f"{type(exc).__name__}: {exc}"[:300]
        return None

    def used(self, buffer: int) -> None:
        """The current stream's kernels that read the buffer's device rows are queued: the next copy into it waits
        for them."""
        event = torch.cuda.Event()
        event.record()
        self.freed[buffer] = event
